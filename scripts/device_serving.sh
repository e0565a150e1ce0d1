#!/usr/bin/env bash
# The H200 serving run on the real pair behind docs/serving.md, made right after the weights were staged in
# /root/w (see scripts/README.md): assemble and convert the pair (timed), then
#   - the 16-request prefill-heavy burst: Engine.generate, LLMEngine without HTTP, and 3 HTTP bursts plus each
#     request alone (wall time; token equality across bursts, alone, and with Engine.generate);
#   - `dustin bench serve` with the burst, decode-heavy and Poisson scenarios (TTFT / TPOT / ITL, offline and
#     roofline baselines, a plot).
# Results and logs land in $OUT.
set -uo pipefail
log="$OUT/device_serving.log"
t0=$SECONDS
python3 .carry/assemble.py >> "$log" 2>&1 || { echo "assemble failed"; tail -3 "$log"; exit 1; }
t1=$SECONDS
. scripts/device_env.sh >> "$log" 2>&1
echo "assemble $((t1 - t0)) s, convert $((SECONDS - t1)) s on $(nproc) cores" | tee -a "$log"
run() {  # run <seconds> <command...>
  echo "== [$SECONDS s] ${*:2}" | tee -a "$log"
  timeout "$1" "${@:2}" >> "$log" 2>&1
  echo "== rc $? [$SECONDS s]" | tee -a "$log"
}
run 220 python3 scripts/gpu_serving_bench.py --real --server --http --out "$OUT/real_burst.json"
grep -E "offline|llm_engine|http" "$log" | grep -v "==" | cut -c1-400
run 300 python3 -m dustin bench serve --device cuda --methods vanilla,dustin --scenario burst,decode,poisson \
  --max-slots 16 --max-context 24576 --json-out "$OUT/bench_serve_real.json"
grep "^|" "$log"
