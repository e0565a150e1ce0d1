#!/usr/bin/env bash
# The H200 runs behind docs/accuracy.md, made right after the weight staging
# (../shared/tools/device-weights; the machine keeps /root only while warm):
#   bash scripts/device_accuracy.sh first   # assemble + convert the pair, then the jobs below
#   bash scripts/device_accuracy.sh more    # further calls: each job resumes from its JSON in /root/acc
# Results of an earlier machine can be carried in .devacc/ (copied to /root/acc first: the runs resume).
# Jobs, in order (RULER's 13 tasks + code completion, 4 samples each, all of a context in one or two batches):
#   1. 32k, tuned config: vanilla + dustin, its -t/-d variants and the baselines at k = 512, 256, 128
#   2. 16k, the same
#   3. 32k and 16k: specattn and the oracle at k = 512
#   4. 16k + 32k, dustin with the hand-written config (--config builtin)
# A call stops its job in time to pack: the device kills a call at 600 s. Each call returns a tarball of
# /root/acc (JSON, markdown, PNG) and the log under $OUT.
set -uo pipefail
[ "${1:-more}" = first ] && { python3 .carry/assemble.py || exit 1; }
. scripts/device_env.sh
A=/root/acc
mkdir -p $A
[ -d .devacc ] && cp -n .devacc/*.json $A/ 2>/dev/null
deadline=${DEADLINE:-560}
common="--tasks ruler,code --samples 4 --device cuda --gamma 4 --seed 0"
main="vanilla,dustin,dustin-t,dustin-d,streaming,quest,snapkv"
jobs=(
  "--contexts 32768 --batch-size 28 --methods $main --budgets 512,256,128 --json-out $A/h200_32k.json"
  "--contexts 16384 --batch-size 56 --methods $main --budgets 512,256,128 --json-out $A/h200_16k.json"
  "--contexts 32768 --batch-size 28 --methods vanilla,specattn,oracle --budgets 512 --json-out $A/h200_32k.json"
  "--contexts 16384 --batch-size 56 --methods vanilla,specattn,oracle --budgets 512 --json-out $A/h200_16k.json"
  "--contexts 16384,32768 --batch-size 28 --methods vanilla,dustin --budgets 512,256,128 --config builtin --json-out $A/h200_builtin.json"
)
for job in "${jobs[@]}"; do
  left=$((deadline - SECONDS))
  [ $left -lt 30 ] && break
  echo "== $(date -u +%H:%M:%S) [$SECONDS s] dustin eval tasks $common $job" | tee -a "$OUT/accuracy.log"
  timeout $left python3 -m dustin eval tasks $common $job >> "$OUT/accuracy.log" 2>&1
  rc=$?
  echo "== rc $rc [$SECONDS s]" | tee -a "$OUT/accuracy.log"
  [ $rc -eq 124 ] && break
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/accuracy.log" 2>/dev/null || true
tar czf "$OUT/acc.tgz" -C $A . 2>/dev/null
grep -v "━" "$OUT/accuracy.log" | tail -c 5000
