"""GPU check of the one-graph-per-step decode loop.

Run on a GPU machine: PYTHONPATH=. python3 scripts/gpu_step_graph_check.py

Tiny random Qwen2 pair in fp32 on the GPU (Triton backend): for every graph-safe method, greedy and sampled, the
whole-step CUDA graph (`ExecutionOptions.step_graph`, the default) must give exactly the tokens of one graph per
forward (same kernels, same sizes) and of eager forwards, and the overlapped engine loop (a step ahead)
those of the step-by-step one; acceptance control likewise; the serving engine
(slot mode, step graph) must equal offline generation. fp32 so that equality is exact, not near-tie-limited.
The `*-gamma-auto` cases run per-row Γ (a step graph per G, Γ = 0 steps and the draft's catch-up for classic)
under a fixed cost model, so every variant takes the same Γ decisions.
Writes $OUT/step_graph_check.json. An argument (e.g. `quest,specattn`) runs those cases only.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dustin.engine.config import ExecutionOptions, GenerationConfig  # noqa: E402
from dustin.engine.gamma import StepCosts  # noqa: E402
from tests.offline import offline  # noqa: E402
from tests.tiny_models import gpu_check_pair  # noqa: E402


def main() -> int:
    eng, prompts, (target, draft) = gpu_check_pair(torch.float32)
    report, ok = {}, True

    # --gamma auto: a step of Γ costs 1 + 0.3 Γ whatever the context (a cheap draft): rows move between Γ 0-2
    costs = StepCosts(tuple(range(7)), tuple(1.0 + 0.3 * g for g in range(7)), (0.0,) * 7)

    def run(options=None, **kw):
        kw.setdefault("stop_at_eos", False)
        options = replace(options or ExecutionOptions(), accept_prob=kw.pop("accept_prob", None))
        return eng.generate(prompts, *offline(max_new_tokens=48, options=options, **kw), step_costs=costs)

    cases = {"vanilla": dict(method="vanilla"), "classic": dict(method="classic"),
             "magicdec": dict(method="magicdec", draft_window=256),
             "streaming": dict(method="streaming", budget=128), "dustin": dict(method="dustin", budget=128),
             "dustin-t": dict(method="dustin-t", budget=128), "dustin-d": dict(method="dustin-d", budget=128),
             "quest": dict(method="quest", budget=128), "specattn": dict(method="specattn", budget=128),
             "classic-sampled": dict(method="classic", temperature=0.8, top_p=0.9, seed=3),
             "dustin-sampled": dict(method="dustin", budget=128, temperature=0.7, top_k=50, seed=4),
             "dustin-accept-controlled": dict(method="dustin", budget=128, accept_prob=0.7),
             "classic-gamma-auto": dict(method="classic", gamma="auto"),
             "dustin-gamma-auto": dict(method="dustin", budget=128, gamma="auto"),
             # the sampled tail: per-layer plans with log-weights, drawn inside the step graph
             "dustin-tail": dict(method="dustin", budget=128, tail_share=0.5),
             "dustin-tail-sampled": dict(method="dustin", budget=128, tail_share=0.5, temperature=0.7, seed=4)}
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None  # e.g. "quest,specattn": those cases only
    cases = {k: v for k, v in cases.items() if only is None or k in only}
    for name, kw in cases.items():
        step = run(**kw)
        fwd = run(ExecutionOptions(step_graph=False), **kw)
        eager = run(ExecutionOptions(cuda_graphs=False), **kw)
        stepwise = run(ExecutionOptions(overlap=False), **kw)  # each step read back before the next is queued
        same_stepwise = [a.token_ids == b.token_ids for a, b in zip(step.sequences, stepwise.sequences, strict=True)]
        ok &= all(same_stepwise)
        same_fwd = [a.token_ids == b.token_ids for a, b in zip(step.sequences, fwd.sequences, strict=True)]
        same_eager = [a.token_ids == b.token_ids for a, b in zip(step.sequences, eager.sequences, strict=True)]
        ok &= all(same_fwd)
        report[name] = {"step_graph_equals_forward_graphs": same_fwd, "step_graph_equals_eager": same_eager,
                        "overlapped_equals_stepwise": same_stepwise,
                        "tau": round(step.tau, 3), "capture_s": round(step.capture_s, 3),
                        "tokens_per_s": {"step_graph": round(step.tokens_per_s, 1),
                                         "forward_graphs": round(fwd.tokens_per_s, 1),
                                         "eager": round(eager.tokens_per_s, 1)}}
        print(name, report[name], flush=True)
    if only is not None:
        return _finish(report, ok)
    # the fused kernels (RoPE + cache write, norms, SiLU-mul; fused projections) against the plain PyTorch ops
    from dustin.attention.backend import AttentionBackend
    from dustin.engine.engine import Engine
    from dustin.models.loader import load_model

    be = AttentionBackend("triton")
    plain = Engine.from_models(load_model(target, "cuda", torch.float32, be, fuse=False),
                               load_model(draft, "cuda", torch.float32, be, fuse=False))
    for method in ("vanilla", "dustin"):
        kw = dict(method=method, stop_at_eos=False, **({"budget": 128} if method == "dustin" else {}))
        a = eng.generate(prompts, *offline(max_new_tokens=48, **kw))
        eager = ExecutionOptions(cuda_graphs=False, fused_ops=False)
        b = plain.generate(prompts, *offline(max_new_tokens=48, options=eager, **kw))
        same = [x.token_ids == y.token_ids for x, y in zip(a.sequences, b.sequences, strict=True)]
        ok &= all(same)
        report[f"fused-vs-plain-ops-{method}"] = same
        print(f"fused-vs-plain-ops-{method}", same, flush=True)
    del plain
    # graphs persist across generate calls: the second identical call captures nothing and gives the same tokens
    eng.release_cached()  # the fused-vs-plain run above kept a core of this very config
    first, second = run(method="dustin", budget=128), run(method="dustin", budget=128)
    same = [a.token_ids == b.token_ids for a, b in zip(first.sequences, second.sequences, strict=True)]
    ok &= all(same) and second.capture_s == 0.0 and first.capture_s > 0.0
    report["generate-twice"] = {"same_tokens": same, "capture_s": [round(first.capture_s, 3), second.capture_s],
                                "tokens_per_s": [round(first.tokens_per_s, 1), round(second.tokens_per_s, 1)]}
    print("generate-twice", report["generate-twice"], flush=True)
    # the serving core: slots, chunked prefill, the step graph replayed across requests
    from dustin.engine.core import EngineCore
    from dustin.engine.request import SamplingParams

    for method in ("dustin", "classic"):
        llm = EngineCore(eng.pair, GenerationConfig(method=method, budget=128 if method == "dustin" else None,
                                               max_slots=3, max_context=4096, prefill_chunk=1024))
        served = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        offline_run = run(method=method, **({"budget": 128} if method == "dustin" else {}))
        same = [a == b.token_ids for a, b in zip(served, offline_run.sequences, strict=True)]
        ok &= all(same)
        report[f"serve-{method}"] = {"equals_offline": same, "step_graph_captured": bool(llm.runner.graph_keys())}
        print(f"serve-{method}", report[f"serve-{method}"], flush=True)
        del llm
    return _finish(report, ok)


def _finish(report: dict, ok: bool) -> int:
    report["all_step_graph_equal"] = bool(ok)
    print(json.dumps({"all_step_graph_equal": bool(ok)}))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "step_graph_check.json").write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
