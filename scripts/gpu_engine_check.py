"""GPU end-to-end check of the engine (run on the device: PYTHONPATH=. python3 scripts/gpu_engine_check.py).

Tiny random Qwen2/Llama checkpoints (head_dim 64, written by transformers), bf16 on the GPU, Triton backend
with CUDA graphs: classic and magicdec must equal vanilla token for token (or diverge only at a bf16 near-tie),
graphs must equal eager, and the batch must equal its sequences one by one.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dustin.attention.backend import AttentionBackend  # noqa: E402
from dustin.engine.config import ExecutionOptions, GenerationConfig  # noqa: E402
from dustin.engine.engine import Engine  # noqa: E402
from dustin.models.loader import load_model  # noqa: E402
from tests.exactness import first_divergence  # noqa: E402
from tests.tiny_models import gpu_check_pair  # noqa: E402


def main() -> int:
    eng, prompts, (target, draft) = gpu_check_pair(torch.bfloat16)
    be = AttentionBackend("triton")
    report = {}

    def gap_at(prompt, ref, i):
        """Top-2 logit gap of the target (bf16, fresh forward) where two outputs first differ."""
        from dustin.attention.context import ForwardContext
        from dustin.cache.kv_cache import KVCache
        ids = prompt + ref[:i]
        a, T = eng.pair.target.args, len(ids)
        cache = KVCache(a.n_layers, 1, a.n_kv_heads, a.head_dim, T, torch.bfloat16, "cuda")
        ctx = ForwardContext(cache, torch.arange(T, device="cuda")[None], torch.zeros(1, dtype=torch.int32,
                             device="cuda"), T, fresh=True)
        with torch.inference_mode():
            top = torch.topk(eng.pair.target(torch.tensor([ids], device="cuda"), ctx)[0, -1], 2).values
        return round(float(top[0] - top[1]), 4)

    def run(graphs=True, **kw):
        kw.setdefault("stop_at_eos", False)
        options = ExecutionOptions(cuda_graphs=graphs)
        return eng.generate(prompts, GenerationConfig(max_new_tokens=64, options=options, **kw))

    van = run(method="vanilla")
    van_eager = run(method="vanilla", graphs=False)
    for name, res in [("vanilla-eager", van_eager), ("classic", run(method="classic", gamma=4)),
                      ("classic-eager", run(method="classic", gamma=4, graphs=False)),
                      ("magicdec", run(method="magicdec", gamma=4, draft_window=256)),
                      # sparse verification with k above every length selects everything: classic's output
                      ("dustin-k4096", run(method="dustin", gamma=4, budget=4096, draft_kv="full")),
                      ("dustin-k128", run(method="dustin", gamma=4, budget=128)),
                      ("streaming-k128", run(method="streaming", gamma=4, budget=128))]:
        div = [first_divergence(a.token_ids, b.token_ids) for a, b in zip(van.sequences, res.sequences, strict=True)]
        gaps = [None if d is None else gap_at(p, a.token_ids, d)
                for p, d, a in zip(prompts, div, van.sequences, strict=True)]
        report[name] = {"first_divergence": div, "top2_gap_there": gaps, "tau": round(res.tau, 3),
                        "steps": res.steps, "tokens_per_s": round(res.tokens_per_s, 1),
                        "time_split_s": {k: round(v, 4) for k, v in res.time_split_s.items()}}
    # sparse policies under CUDA graphs (graph-safe observers, static index plan) must equal their eager runs
    for method in ("dustin", "dustin-t", "dustin-d", "streaming"):
        kw = dict(method=method, gamma=4, budget=128)
        g, e = run(**kw), run(graphs=False, **kw)
        report[f"{method}-k128 graphs vs eager"] = {
            "identical": [a.token_ids == b.token_ids for a, b in zip(g.sequences, e.sequences, strict=True)],
            "tokens_per_s_graphs": round(g.tokens_per_s, 1), "tokens_per_s_eager": round(e.tokens_per_s, 1)}
    # the fused norm / RoPE kernels against the plain PyTorch ops (bf16: equal up to rare near-ties)
    plain_eng = Engine.from_models(load_model(target, "cuda", torch.bfloat16, be, fuse=False),
                                   load_model(draft, "cuda", torch.bfloat16, be, fuse=False))
    plain = plain_eng.generate(prompts, GenerationConfig(max_new_tokens=64, stop_at_eos=False, method="vanilla",
                                                          options=ExecutionOptions(fused_ops=False)))
    del plain_eng
    div = [first_divergence(a.token_ids, b.token_ids) for a, b in zip(van.sequences, plain.sequences, strict=True)]
    report["fused_vs_plain_ops"] = {"first_divergence": div, "top2_gap_there": [
        None if d is None else gap_at(p, a.token_ids, d) for p, d, a in zip(prompts, div, van.sequences, strict=True)],
        "tokens_per_s_fused": round(van.tokens_per_s, 1), "tokens_per_s_plain": round(plain.tokens_per_s, 1)}
    single = [eng.generate([p], GenerationConfig(method="classic", gamma=4, max_new_tokens=64, stop_at_eos=False))
              .sequences[0].token_ids for p in prompts]
    div = [first_divergence(s.token_ids, a) for a, s in zip(single, van.sequences, strict=True)]
    report["batch_vs_single"] = {"first_divergence": div, "top2_gap_there": [
        None if d is None else gap_at(p, s.token_ids, d) for p, d, s in zip(prompts, div, van.sequences, strict=True)]}
    print(json.dumps(report, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "engine_check.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
