"""Experiment: the target's verify pass (batch 16 x Γ + 1 = 80 rows) through the fused decode-layer kernels
(dustin/kernels/decode_linear.py) instead of cuBLAS and the fused elementwise kernels. Raises
`decode_linear.MAX_ROWS` to 128 for this process only, then runs one of our GPU scripts:

    PYTHONPATH=. python3 scripts/experiments/verify_rows_decode_kernels.py layers     # kernels at 80 rows: check, time
    PYTHONPATH=. python3 scripts/experiments/verify_rows_decode_kernels.py pipeline   # 80 rows: BK x stages x warps
    PYTHONPATH=. python3 scripts/experiments/verify_rows_decode_kernels.py anatomy \\
        --pair qwen2.5-1.5b:qwen2.5-0.5b --batch 16 --context 32768 --methods vanilla,dustin --tau 3.56 --steps 12 \\
        --config dustin/configs/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.json

Result on one H200 (2026-12-02, docs/results/lookahead_capture/h200_*verify_80_rows*): exact (fp32 logits within
2e-5, argmax equal), but slower: gate/up 33.9 us against cuBLAS's 19.4 us, the dustin step 6.97 -> 7.60 ms
(16 x 32k, random weights, τ 3.56 acceptance-controlled) with 980 -> 846 kernels. So MAX_ROWS stays 32.
Those kernels ran with the 16-row tiles' 4 warps: two [64, 128] fp32 accumulators per program at 80 rows (padded
to 128). `pipeline` times the 1.5B's q/k/v, gate/up and down projections at 80 rows with 4 and 8 warps and
several BK / stages (`gpu_decode_layers.py --pipeline`, tiles over the shared-memory limit reported as errors):
not run yet.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from dustin.kernels import decode_linear

    decode_linear.MAX_ROWS = 128  # read at call time by _check_rows and Transformer._takes_decode_kernels
    what, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    if what in ("layers", "pipeline"):
        from scripts import gpu_decode_layers

        if what == "pipeline":
            gpu_decode_layers.SHAPES = {"qwen2.5-1.5b": (80,)}
            sys.argv += ["--pipeline", "--no-check", "--no-forward"]
        else:
            gpu_decode_layers.SHAPES = {"qwen2.5-1.5b": (16, 32, 80)}
        return gpu_decode_layers.main()
    from scripts import gpu_step_anatomy

    return gpu_step_anatomy.main()


if __name__ == "__main__":
    sys.exit(main())
