"""Does the persistent draft kernel keep full verification exact in the engine? magicdec (a streaming draft, full
verification) with and without the kernel, as one step graph, per-forward graphs and eager, against vanilla, on
the engine test's setup (random weights of the default pair's shapes, 2 layers each, four ragged prompts, greedy).

    PYTHONPATH=. python3 scripts/gpu_draft_engine_check.py [LAYERS [DEVICE]]

Prints, per run, τ, whether greedy drafts took the LM head in the launch, and each prompt's first token that
differs from vanilla's (-1: none). tests/kernels/test_draft_decoder.py's engine test asserts equality.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from dustin.bench.e2e import _shape, build_engine
    from dustin.engine.config import ExecutionOptions, GenerationConfig
    from dustin.engine.core import EngineCore
    from dustin.engine.request import SamplingParams

    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    engine = build_engine(replace(_shape("qwen2.5-1.5b"), n_layers=layers),
                          replace(_shape("qwen2.5-0.5b"), n_layers=layers), device)
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(40 + 9 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(method, **opts):
        cfg = GenerationConfig(method=method, max_slots=4, max_context=256, options=ExecutionOptions(**opts))
        core = EngineCore(engine.pair, cfg)
        out = core.generate(prompts, greedy)
        kern = engine.pair.draft.layer_kernel
        return out, core.stats().get("tau"), kern is not None and kern.vocab is not None

    want, _, _ = run("vanilla")
    rows = {}
    for name, method, opts in [("magicdec", "magicdec", {}),
                               ("magicdec+kernel", "magicdec", {"draft_kernel": True}),
                               ("magicdec+kernel, per-forward graphs", "magicdec",
                                {"draft_kernel": True, "step_graph": False}),
                               ("magicdec+kernel, eager", "magicdec", {"draft_kernel": True, "cuda_graphs": False}),
                               ("magicdec, eager", "magicdec", {"cuda_graphs": False}),
                               ("classic", "classic", {})]:
        out, tau, head = run(method, **opts)
        first = [next((i for i, (a, b) in enumerate(zip(o, w, strict=True)) if a != b), -1)
                 for o, w in zip(out, want, strict=True)]
        rows[name] = {"tau": tau, "head_in_kernel": head, "first_divergence": first}
        print(f"{name:40s} tau {tau if tau is None else round(tau, 3)}  head {head}  first divergence {first}",
              flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
