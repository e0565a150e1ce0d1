#!/usr/bin/env bash
# The H200 speed runs on the real default pair behind docs/benchmarks.md, docs/serving.md and docs/accuracy.md,
# made right after the weight staging (../shared/tools/device-weights; /root survives only while warm):
#   bash scripts/device_speed.sh code    # assemble + convert the pair, the step-graph check (tiny fp32 pair),
#                                        # then `dustin bench e2e --real` on code prompts
#   bash scripts/device_speed.sh serve   # `dustin bench serve` (16 slots, 16k-32k prompts) + one-shot generate
#   bash scripts/device_speed.sh prose   # `dustin bench e2e --real` on prose prompts + the step anatomy
#                                        # (random weights of the pair's shapes: kernels/step, GPU busy time)
#   bash scripts/device_speed.sh real    # after staging: the step-graph check of quest/specattn, `bench e2e --real`
#                                        # code 32k x 16 for every method, one-shot generate (vanilla, dustin)
#   bash scripts/device_speed.sh round   # after staging: `bench e2e --real` code 16k / 32k x 16 (vanilla, dustin, with
#                                        # kernels per step), dustin with --budget auto p = 0.99 and no cap (k up to
#                                        # the context; AUTO_CONTEXTS picks the contexts, " " none), and with
#                                        # ALT=<config JSON> dustin on that config (e.g. the 11-layer S_draft one,
#                                        # docs/results/profile_h200/config_11_draft_layers.json); `round` and
#                                        # `long` time 40 steps after 4 warm-up steps (12 steps did not resolve
#                                        # 0.3 ms between configs on real prompts)
#   bash scripts/device_speed.sh long    # right after `round` (AUTO_CONTEXTS=" " skips its auto rows): code 64k x 8
#                                        # (--rope-scaling yarn:4, vanilla and dustin), then --budget auto p 0.99 at 16k
#   bash scripts/device_speed.sh gamma   # after staging: the step-graph check of per-row Γ (tiny fp32 pair, graphs
#                                        # of every G), `bench e2e --real` code 16 x 2k / 16k / 29.5k, vanilla and
#                                        # dustin at --gamma auto then at 4 (the same build and run), then one-shot
#                                        # generate 16 x 2k, 512 tokens: vanilla, dustin at auto and at 4;
#                                        # PARTS=fixed: dustin at Γ = 2 and 3 on the same contexts
#   bash scripts/device_speed.sh random  # no weights: step-graph check, step anatomy (overlapped and not),
#                                        # Llama-3.1-8B + 3.2-1B e2e, 32B attention
#   bash scripts/device_speed.sh draft   # no weights: the persistent draft-layer kernel's compile test and GPU tests
#                                        # (eager and graphed), its time per forward, `bench e2e` 16 x 16k / 32k with
#                                        # and without it, and 16 x 16k with per-forward graphs (the draft's ms per
#                                        # forward); random weights of the pair's shapes, acceptance-controlled;
#                                        # PARTS="drift tests ncu time timeline phase e2e" picks parts (see the mode)
#   bash scripts/device_speed.sh draft8b # no weights: Llama-3.1-8B + 3.2-1B shapes, 32k x 16, with and without it
#   bash scripts/device_speed.sh grid    # after staging: `bench e2e --real` code, vanilla and dustin, on the grid
#                                        # 16 x 2k, 16k, 29.5k, 8 x 64k (YaRN), 32 x 16k, 64 x 8k; FLAGS are added
#                                        # to each (e.g. FLAGS=--draft-kernel), CELLS picks cells ("16x2048 ...")
#   bash scripts/device_speed.sh budget  # no weights: what a larger verify budget costs, dustin at k = 512, 2048 and
#                                        # auto (p 0.95), 16 x 16k / 32k, the pair's shapes at τ 3.6 (+ vanilla)
#   bash scripts/device_speed.sh warmup  # no weights: the kernel warm-up's GPU test (its plan compiles on threads
#                                        # without an error, and the first steps compile nothing on the main thread)
#   bash scripts/device_speed.sh tail    # no weights: the sampled tail (--tail-share) through the step graph
#                                        # (tokens equal to eager and per-forward graphs), then what it costs: bench
#                                        # e2e 16 x 16k / 29.5k, vanilla and dustin@1024 with and without a 50% tail,
#                                        # with phases; random weights of the pair's shapes at τ 3.6
# Each mode fits the device's 600 s per call; results and logs land in $OUT.
set -uo pipefail
mode=${1:-code}
case $mode in random|draft|draft8b|budget|warmup|tail) weights=no ;; *) weights=yes ;; esac
if [ $weights = yes ] && [ ! -f /root/dh/models/qwen2.5-coder-0.5b-instruct/dustin-source.json ]; then
  for a in .carry2/assemble.py .carry/assemble.py; do  # whichever chunking the staging calls carried
    [ -f $a ] && { python3 $a || exit 1; break; }
  done
fi
. scripts/device_env.sh
log="$OUT/speed_$mode.log"
left() {  # left <seconds>: that, or less where END (seconds of this process; default none) comes first
  local t=$1
  [ -n "${END:-}" ] && [ $((END - SECONDS)) -lt $t ] && t=$((END - SECONDS))
  echo $t
}
run() {  # run <seconds> <command...>: logged, cut at the deadline (and at END)
  local t=$(left "$1")
  [ "$t" -lt 10 ] && { echo "== skip (${t}s left): ${*:2}" | tee -a "$log"; return 0; }
  echo "== $(date -u +%H:%M:%S) [$SECONDS s] ${*:2}" | tee -a "$log"
  timeout "$t" "${@:2}" >> "$log" 2>&1
  local rc=$?
  echo "== rc $rc [$SECONDS s]" | tee -a "$log"
  return $rc
}
oneshot() {  # oneshot <context> <new tokens> <method args>...: one-shot `dustin generate`, a fresh process each
  # (16 real code prompts of <context> tokens); stdout is the result JSON (token ids, tokens/s, capture_s)
  local ctx=$1 new=$2; shift 2
  python3 - "$ctx" <<'EOF' >> "$log" 2>&1
import json, sys
from transformers import AutoTokenizer
from dustin.bench.serve import make_prompts
from dustin.models.fetch import resolve_model_path
tok = AutoTokenizer.from_pretrained(str(resolve_model_path("default", "target")))
n = int(sys.argv[1])
ids = make_prompts(tok, "code", (n, n), 16, 0, len(tok))
with open(f"/root/oneshot_{n}.jsonl", "w") as f:
    for p in ids:
        f.write(json.dumps({"prompt": tok.decode(p)}) + "\n")
EOF
  for m in "$@"; do
    local tag=$(echo "$m" | tr -c 'a-z0-9\n' '_')
    [ "$(left 90)" -lt 20 ] && { echo "== skip oneshot $m: no time left" | tee -a "$log"; continue; }
    echo "== $(date -u +%H:%M:%S) dustin generate --method $m (16 x $ctx, $new tokens)" | tee -a "$log"
    t0=$(date +%s.%N)
    timeout $(left 90) python3 -m dustin generate --device cuda --method $m --prompts-jsonl /root/oneshot_$ctx.jsonl \
      --max-new-tokens $new --ignore-eos --json > "$OUT/oneshot_${ctx}_$tag.json" 2>> "$log"
    echo "== rc $? wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee -a "$log"
  done
}
if [ "$mode" = real ]; then
  run 90 python3 scripts/gpu_step_graph_check.py quest,specattn
  run 240 python3 -m dustin bench e2e --real --device cuda --prompts code --contexts 32768 --batches 16 \
    --methods vanilla,classic,magicdec,streaming,dustin,quest,specattn --warmup 3 --steps 12 \
    --json-out "$OUT/bench_e2e_real_code_32k.json" --plot-out "$OUT/bench_e2e_real_code_32k.png"
  oneshot 29500 128 vanilla dustin
elif [ "$mode" = round ]; then
  e2e="python3 -m dustin bench e2e --real --device cuda --prompts code --batches 16 --warmup 4 --steps 40"
  run $((300 - SECONDS)) $e2e --contexts 32768,16384 --methods vanilla,dustin \
    --json-out "$OUT/bench_e2e_real_code.json" --plot-out "$OUT/bench_e2e_real_code.png"
  for c in ${AUTO_CONTEXTS:-16384 32768}; do
    run $((420 - SECONDS)) $e2e --contexts $c --methods dustin --budget auto --budget-p 0.99 --budget-max $c \
      --json-out "$OUT/bench_e2e_real_auto99_$c.json"
  done
  if [ -n "${ALT:-}" ]; then  # another config on the same prompts
    run $((560 - SECONDS)) $e2e --contexts 32768,16384 --methods dustin \
      --config "$ALT" --json-out "$OUT/bench_e2e_real_$(basename "${ALT%.json}").json"
  fi
elif [ "$mode" = gamma ]; then  # --gamma auto against Γ = 4, vanilla measured in the same run each time; PARTS
  # picks and orders the parts (default "e2e check oneshot"), END cuts them all short
  e2e="python3 -m dustin bench e2e --real --device cuda --prompts code --batches 16 --warmup 4 --steps 40"
  for part in ${PARTS:-e2e check oneshot}; do
    case $part in
      e2e) run 150 $e2e --contexts 2048,16384,29500 --methods vanilla,dustin --gamma auto \
             --json-out "$OUT/bench_e2e_real_gamma_auto.json"
           run 130 $e2e --contexts 2048,16384,29500 --methods vanilla,dustin --gamma 4 \
             --json-out "$OUT/bench_e2e_real_gamma_4.json" ;;
      fixed) for g in 2 3; do  # smaller fixed Γ (the cost model's pick at τ ~3.5 is 2-3, not 4)
               run 130 $e2e --contexts 2048,16384,29500 --methods vanilla,dustin --gamma $g \
                 --json-out "$OUT/bench_e2e_real_gamma_$g.json"
             done ;;
      check) run 100 python3 scripts/gpu_step_graph_check.py classic,dustin,classic-gamma-auto,dustin-gamma-auto ;;
      oneshot) oneshot 2048 512 vanilla "dustin --gamma auto" "dustin --gamma 4" ;;  # end to end, offline generation
    esac
  done
elif [ "$mode" = long ]; then  # after `round` on a warm machine: 64k x 8 with YaRN, then --budget auto at 16k
  e2e="python3 -m dustin bench e2e --real --device cuda --prompts code --warmup 4 --steps 40"
  run 330 $e2e --rope-scaling yarn:4 --contexts 65536 --batches 8 --methods vanilla,dustin \
    --json-out "$OUT/bench_e2e_real_code_64k.json"
  run $((560 - SECONDS)) $e2e --batches 16 --contexts 16384 --methods dustin --budget auto --budget-p 0.99 \
    --budget-max 16384 --json-out "$OUT/bench_e2e_real_auto99_16384.json"
elif [ "$mode" = draft8b ]; then
  for flag in "" --draft-kernel; do
    run $(( (580 - SECONDS) / 2 )) python3 -m dustin bench e2e --device cuda --pairs llama-3.1-8b:llama-3.2-1b \
      --contexts 32768 --batches 16 --methods vanilla,dustin --warmup 3 --steps 12 $flag \
      --json-out "$OUT/bench_e2e_llama8b${flag:+_kernel}.json"
  done
elif [ "$mode" = draft ]; then
  # PARTS picks and orders the parts (default "tests time e2e"):
  #   drift  each layer's residual stream, kernel / per-layer kernels / plain ops / emulation against fp32
  #   tests  the compile test (every exported name) first, then the GPU tests (the conftest's interpreter off)
  #   ncu    Nsight Compute's summary of one layer-stack launch (16 rows; speed of light, warp states, memory)
  #   time   the kernel's time per forward against the per-layer kernels (scripts/gpu_draft_decoder.py)
  #   timeline  the profiling build's record: each program's time split into waiting for inputs, staging, weights,
  #          MMAs and epilogue, per stage, and each stage's span per layer (scripts/gpu_draft_timeline.py)
  #   phase  bench e2e 16 x 16k with per-forward graphs, with and without the kernel: the draft's ms per forward
  #   e2e    bench e2e 16 x 16k / 32k, vanilla and dustin, with and without the kernel, then the phases as above
  for part in ${PARTS:-tests time e2e}; do
    case $part in
      drift) run 200 python3 scripts/gpu_draft_drift.py --layers 4,24 --batch 16 ;;
      tests) run 60 env TRITON_INTERPRET=0 DUSTIN_REQUIRE_NVCC=1 python3 -m pytest -q tests/kernels/test_draft_decoder.py \
               -k "compiles or bind" -p no:cacheprovider || exit 1
             run 300 env TRITON_INTERPRET=0 python3 -m pytest -q -x tests/kernels/test_draft_decoder.py \
               -k "matches or stages or head_chooses or engine_with" -p no:cacheprovider || exit 1 ;;
      ncu) run 150 ncu --kernel-name regex:draft_layers --launch-skip 3 --launch-count 1 --section SpeedOfLight \
             --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
             python3 scripts/gpu_draft_decoder.py --unchecked --only stack --batch 16 ;;
      time) run 90 python3 scripts/gpu_draft_decoder.py --draft qwen2.5-0.5b --batch 16 ;;
      timeline) run 90 python3 scripts/gpu_draft_timeline.py --draft qwen2.5-0.5b --batch 16 ;;
      phase|e2e)
        e2e="python3 -m dustin bench e2e --device cuda --pairs qwen2.5-1.5b:qwen2.5-0.5b --batches 16 --warmup 4"
        for flag in --no-draft-kernel --draft-kernel; do  # the step graph; then per-forward graphs (the draft apart)
          [ $part = e2e ] && run $(( (560 - SECONDS) / 2 )) $e2e --contexts 16384,32768 --methods vanilla,dustin \
            --steps 30 $flag --json-out "$OUT/bench_e2e_draft_${flag#--}.json"
          run 90 $e2e --contexts 16384 --methods vanilla,dustin --steps 20 --no-step-graph $flag \
            --json-out "$OUT/bench_e2e_draft_phase_${flag#--}.json"
        done ;;
    esac
  done
elif [ "$mode" = grid ]; then
  tag=$(printf %s "${FLAGS:-}" | tr -c 'a-z0-9' '_')
  for cell in ${CELLS:-16x2048 16x16384 16x29500 32x16384 64x8192 8x65536}; do
    b=${cell%x*} c=${cell#*x}
    run $(( c > 32768 ? 200 : 110 )) python3 -m dustin bench e2e --real --device cuda --prompts code --warmup 4 \
      --steps 40 --batches $b --contexts $c --methods vanilla,dustin $([ $c -gt 32768 ] && echo --rope-scaling yarn:4) \
      ${FLAGS:-} --json-out "$OUT/grid_$cell$tag.json"
  done
elif [ "$mode" = budget ]; then
  for b in 512 2048 auto; do
    run 150 python3 -m dustin bench e2e --device cuda --pairs qwen2.5-1.5b:qwen2.5-0.5b --contexts 16384,32768 \
      --batches 16 --tau 3.6 --warmup 3 --steps 12 --methods $([ $b = 512 ] && echo vanilla,)dustin --budget $b \
      $([ $b = auto ] && echo --budget-p 0.95) --json-out "$OUT/budget_$b.json" --plot-out "$OUT/budget_$b.png"
  done
elif [ "$mode" = tail ]; then  # PARTS picks and orders the parts (default "check e2e")
  e2e="python3 -m dustin bench e2e --device cuda --pairs qwen2.5-1.5b:qwen2.5-0.5b --contexts 16384,29500 --batches 16
    --tau 3.6 --warmup 4 --steps 30 --budget 1024"
  for part in ${PARTS:-check e2e}; do
    case $part in
      check) run 120 python3 scripts/gpu_step_graph_check.py dustin,dustin-tail,dustin-tail-sampled ;;
      e2e) run 200 $e2e --methods vanilla,dustin --json-out "$OUT/tail_exact_1024.json"
           run 120 $e2e --methods dustin --tail-share 0.5 --json-out "$OUT/tail_50_1024.json"
           run 150 $e2e --methods dustin --tail-share 0.5 --no-step-graph --json-out "$OUT/tail_50_1024_phases.json" ;;
    esac
  done
elif [ "$mode" = warmup ]; then
  run 240 env TRITON_INTERPRET=0 python3 -m pytest -q tests/engine/test_warmup.py -k on_a_gpu -p no:cacheprovider
elif [ "$mode" = random ]; then
  cfg=dustin/configs/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.json
  run 150 python3 scripts/gpu_step_graph_check.py
  run 170 python3 scripts/gpu_step_anatomy.py --pair qwen2.5-1.5b:qwen2.5-0.5b --batch 16 --context 32768 \
    --methods vanilla,dustin,streaming,magicdec,quest,specattn --tau 3.56 --steps 12 --config $cfg
  run 60 python3 scripts/gpu_step_anatomy.py --pair qwen2.5-1.5b:qwen2.5-0.5b --batch 16 --context 32768 \
    --methods vanilla,dustin --tau 3.56 --steps 12 --config $cfg --no-overlap
  run $((560 - SECONDS)) python3 -m dustin bench e2e --device cuda --pairs llama-3.1-8b:llama-3.2-1b \
    --contexts 32768 --batches 16 --methods vanilla,magicdec,dustin --warmup 3 --steps 12 \
    --json-out "$OUT/bench_e2e_llama8b.json" --plot-out "$OUT/bench_e2e_llama8b.png"
  run $((590 - SECONDS)) python3 -m dustin bench attention --models qwen2.5-32b --contexts 32768 --batches 16 \
    --json-out "$OUT/bench_attention_32b.json" --plot-out "$OUT/bench_attention_32b.png"
elif [ "$mode" = code ] || [ "$mode" = prose ]; then
  if [ "$mode" = code ]; then
    python3 scripts/gpu_step_graph_check.py > "$OUT/step_graph_check.log" 2>&1 || { echo "step graph check failed"; exit 1; }
  fi
  run $((570 - SECONDS)) python3 -m dustin bench e2e --real --device cuda --prompts $mode \
    --contexts 32768,16384,8192 --batches 16,8 --methods vanilla,classic,magicdec,streaming,dustin \
    --warmup 3 --steps 12 --json-out "$OUT/bench_e2e_real_$mode.json" --plot-out "$OUT/bench_e2e_real_$mode.png"
  if [ "$mode" = prose ]; then
    run $((580 - SECONDS)) python3 scripts/gpu_step_anatomy.py --pair qwen2.5-1.5b:qwen2.5-0.5b --batch 16 \
      --context 32768 --methods vanilla,magicdec,streaming,dustin --tau 3.8 --steps 10 \
      --config dustin/configs/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.json
  fi
else
  run 330 python3 -m dustin bench serve --device cuda --methods vanilla,dustin --prompt-tokens 16384,32768 \
    --num-requests 32 --rate inf --max-tokens 128 --max-slots 16 --json-out "$OUT/bench_serve_h200.json"
  oneshot 29500 128 vanilla dustin
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$log" 2>/dev/null || true
