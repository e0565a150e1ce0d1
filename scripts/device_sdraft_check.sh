#!/usr/bin/env bash
# GPU needle check of the leaner S_draft candidate (docs/profiling.md, "A cheaper S_draft"): held-out needles,
# multi-key then single, at 8k, 16k and 30k tokens, 5 depths, greedy, 32 new tokens, for
#   vanilla; dustin with the shipped config (dustin/configs/; 11 draft layers when this ran, 5 since 2026-12-02) at
#   k = 512 and 256;
#   dustin with the candidate (docs/results/profile_cpu/candidate_config.json, 3 draft score layers; shipped for a
#   few hours on 2026-12-02, withdrawn after RULER, docs/accuracy.md) at k = 512, 256.
# On a GPU machine with the default pair fetched (`dustin models fetch`), from the repository root:
#   bash scripts/device_sdraft_check.sh OUTDIR      # -> OUTDIR/needles_{candidate,shipped}_{multikey,single}.json + logs
#   DEVICE_ENV=1 bash scripts/device_sdraft_check.sh "$OUT"   # on the project's device machine (scripts/device_env.sh)
#   RUNS=candidate bash scripts/device_sdraft_check.sh OUTDIR  # only the candidate's rows (the shipped config's
#                                                               # vanilla and dustin rows measured before)
# Time (DEADLINE seconds, default 300): each of the four calls may use the time left divided by the calls left (a
# call that ends early leaves its time to the next) and none starts with < 30 s left. The candidate's two calls
# took 118 s on the H200 (2026-12-02); four processes, each loading the pair and compiling its kernels once; all depths of a (kind, context) decode as one
# batch, so depths cost little and stay at 5, as in the shipped config's earlier GPU needle runs. Multi-key runs
# first (those earlier runs have multi-key rows to compare with). If a call runs out of time, rerun with the same
# OUTDIR: finished rows are skipped and the rest resume.
set -uo pipefail
out=${1:?usage: bash scripts/device_sdraft_check.sh OUTDIR}
mkdir -p "$out"
[ "${DEVICE_ENV:-0}" = 1 ] && . scripts/device_env.sh
SECONDS=0  # the budget counts from here (device_env.sh may first convert the pair)
deadline=${DEADLINE:-300}
shipped=dustin/configs/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.json
candidate=docs/results/profile_cpu/candidate_config.json
common="--device cuda --contexts 8192,16384,30000 --depths 5 --budgets 512,256"
runs=${RUNS:-candidate shipped}
calls=$((2 * $(wc -w <<< "$runs")))  # each call may use the time left divided by the calls left
for kind in multikey single; do
  for which in $runs; do
    case $which in
      candidate) set -- candidate dustin $candidate ;;
      shipped) set -- shipped vanilla,dustin $shipped ;;
      *) echo "unknown run $which (candidate, shipped)"; exit 2 ;;
    esac
    left=$((deadline - SECONDS))
    [ $left -lt 30 ] && { echo "== out of time before $1 $kind" | tee -a "$out/sdraft_check.log"; break 2; }
    echo "== $(date -u +%H:%M:%S) [$SECONDS s] $1 $kind" | tee -a "$out/sdraft_check.log"
    timeout $((left / calls)) python3 -m dustin eval needles $common --kinds $kind --methods $2 --config $3 \
      --json-out "$out/needles_${1}_${kind}.json" 2>&1 | grep -v "━" | tee -a "$out/sdraft_check.log"
    calls=$((calls - 1))
  done
done
echo "== done [$SECONDS s]" | tee -a "$out/sdraft_check.log"
