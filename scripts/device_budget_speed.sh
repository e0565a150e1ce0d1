#!/usr/bin/env bash
# What a larger verify budget costs in step time: `dustin bench e2e` on random weights of the default pair's shapes
# (Qwen2.5-Coder-1.5B target + 0.5B draft), acceptance-controlled at τ 3.6, 16 sequences at 16k and 32k, vanilla
# and dustin at k = 512, k = 2048 and --budget auto (p 0.95, k 128-2048), one process per budget, results in $OUT.
#   bash scripts/device_budget_speed.sh        # on a GPU machine, from the repository root ($OUT: output folder)
set -uo pipefail
OUT=${OUT:-.}
common="--pairs qwen2.5-1.5b:qwen2.5-0.5b --contexts 16384,32768 --batches 16 --tau 3.6 --warmup 3 --steps 12"
for b in 512 2048 auto; do
  m=vanilla,dustin; [ $b != 512 ] && m=dustin
  extra=""; [ $b = auto ] && extra="--budget-p 0.95"
  echo "== $(date -u +%H:%M:%S) [$SECONDS s] budget $b"
  timeout 150 python3 -m dustin bench e2e --device cuda $common --methods $m --budget $b $extra \
    --json-out "$OUT/budget_$b.json" --plot-out "$OUT/budget_$b.png" 2>&1 | grep -v "━"
done
echo "== done [$SECONDS s]"
