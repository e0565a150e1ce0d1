"""`dustin eval arr-kl`: does a higher ARR mean a closer output? (paper appendix B, Table 4, Fig. 9)

On one long input: the target greedily generates T tokens with the full cache; that sequence is then replayed
in one forward over the T tokens with the prompt cache restricted to a sampled subset K of the prompt positions
(4 sinks and the last 16 prompt positions always in, the generated tokens always attended). Per subset:
ARR = the share of the full-cache attention (mean over every head and layer) that K keeps, averaged over the T
steps, and KL(p_full || p_sparse) of the next-token distributions, averaged over the T steps. Subsets span the
ARR range by mixing the top of the true attention with random (and, for the low end, the least attended)
positions. Reported: the Pearson correlation (paper: -0.95 Llama-3.1-8B, -0.81 Qwen2.5-7B) and a scatter plot.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from dustin.attention.context import ForwardContext, SparsePlan
from dustin.cache.kv_cache import KVCache
from dustin.data.corpora import long_texts
from dustin.engine.config import GenerationConfig
from dustin.engine.request import SamplingParams
from dustin.errors import InputError
from dustin.flags import add_model_args
from dustin.scoring import causal_probs

SINKS, RECENT = 4, 16


def add_arguments(p) -> None:
    add_model_args(p, draft_default=None)
    p.add_argument("--kind", default="essays", help="essays, squad, hotpotqa or code (held-out split)")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens")
    p.add_argument("--budget", type=int, default=512, help="k: positions per subset (sinks and recent included)")
    p.add_argument("--subsets", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16, help="generated tokens replayed (T)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="results JSON; a scatter PNG is written beside it")


class _MeanAttention:
    """Observer: the attention of the T replayed queries on the prompt positions, mean over heads and layers."""

    def __init__(self, n_layers: int, prompt_len: int) -> None:
        self.layers, self.P = frozenset(range(n_layers)), prompt_len
        self.total = None

    def __call__(self, layer, q, k_cache, ctx) -> None:
        probs = causal_probs(q, k_cache[:, :, :ctx.max_len], ctx.positions)[0, :, :, :self.P].mean(0)  # [T, P]
        self.total = probs if self.total is None else self.total + probs


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of `model` with the full cache, on the engine core (the model verifying alone)."""
    from dustin.engine.engine import Engine

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = Engine.from_models(model).generate([prompt], GenerationConfig(method="vanilla"), params)
    return out.sequences[0].token_ids


@torch.inference_mode()
def study(model, prompt: list[int], budget: int, subsets: int, new_tokens: int, seed: int) -> dict:
    a, dev = model.args, model.embed_tokens.weight.device
    P, T = len(prompt), new_tokens
    if budget >= P or budget < SINKS + RECENT + 1:
        raise InputError(f"--budget must be in ({SINKS + RECENT}, prompt length {P}), got {budget}")
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, a.head_dim, P + T, model.embed_tokens.weight.dtype, dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    ids = torch.tensor(prompt, device=dev)[None]
    model(ids, ForwardContext(cache, torch.arange(P, device=dev)[None], zero, P, rows=slice(0, 1), fresh=True),
          logits_at=torch.tensor([P - 1], device=dev))  # the prompt's K/V, which the replays below attend to
    gen = greedy(model, prompt, T)
    toks = torch.tensor([gen], device=dev)
    pos = torch.arange(P, P + T, device=dev)[None]
    L = torch.tensor([P], dtype=torch.int32, device=dev)
    obs = _MeanAttention(a.n_layers, P)  # the replay with the full cache: reference logits and attention
    full = model(toks, ForwardContext(cache, pos, L, P + T, observers=[obs])).float().log_softmax(-1)[0]
    attn = obs.total / a.n_layers  # [T, P]
    share = attn / attn.sum(-1, keepdim=True)
    mean = share.mean(0)
    rng = random.Random(seed)
    protected = list(range(SINKS)) + list(range(P - RECENT, P))
    free = [j for j in range(SINKS, P - RECENT)]
    by_mass = sorted(free, key=lambda j: -float(mean[j]))
    points = []
    for i in range(subsets):
        alpha = i / max(subsets - 1, 1)  # share of the picks taken from the top of the true attention
        n_pick = budget - len(protected)
        n_top = round(alpha * n_pick)
        pool = by_mass[n_top:] if i % 4 else by_mass[len(by_mass) // 2:]  # every 4th: the least attended half
        picks = set(by_mass[:n_top]) | set(rng.sample(pool, min(len(pool), n_pick - n_top)))
        idx = torch.tensor(sorted(set(protected) | picks), dtype=torch.int32, device=dev)
        plan = SparsePlan(idx[None], torch.tensor([idx.numel()], dtype=torch.int32, device=dev))
        sparse = model(toks, ForwardContext(cache, pos, L, P + T, sparse=plan)).float().log_softmax(-1)[0]
        kl = (full.exp() * (full - sparse)).sum(-1).mean()
        arr = share[:, idx.long()].sum(-1).mean()
        points.append({"alpha": alpha, "arr": float(arr), "kl": float(kl)})
    xs, ys = torch.tensor([p["arr"] for p in points]), torch.tensor([p["kl"] for p in points])
    r = float(torch.corrcoef(torch.stack([xs, ys]))[0, 1])
    return {"prompt_tokens": P, "new_tokens": T, "budget": budget, "pearson": r, "points": points}


def run(args) -> int:
    from rich.console import Console

    from dustin.engine.engine import Engine

    if args.subsets < 3 or args.new_tokens < 1 or args.context < 64:
        raise InputError("--subsets must be >= 3, --new-tokens >= 1 and --context >= 64")
    engine = Engine.from_pretrained(args.target, None, device=args.device, dtype=args.dtype,
                                    attention=args.attention,
                                    rope_scaling=args.rope_scaling)
    if engine.pair.tokenizer is None:
        raise InputError("the target model folder has no tokenizer")
    text = long_texts(args.kind, "heldout", args.context, engine.pair.tokenizer, 1, args.seed)[0]
    console = Console(stderr=True)
    with console.status(f"ARR-KL study: {args.subsets} subsets of {args.budget} positions..."):
        res = study(engine.pair.target, engine.pair.encode(text)[:args.context], args.budget, args.subsets,
                    args.new_tokens, args.seed)
    res["settings"] = {k: v for k, v in vars(args).items() if k != "func"}
    Console().print(f"ARR-KL Pearson correlation over {args.subsets} subsets (k = {args.budget}, "
                    f"{res['prompt_tokens']} prompt tokens, {args.new_tokens} steps): {res['pearson']:.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))
        scatter(res, Path(args.json_out).with_suffix(".png"))
    return 0


def scatter(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.8))
    ax.scatter([p["arr"] for p in res["points"]], [p["kl"] for p in res["points"]], s=14)
    ax.set_xlabel("ARR (mean over steps; all heads and layers)")
    ax.set_ylabel("KL(full || sparse), mean over steps")
    ax.set_title(f"ARR vs KL, k = {res['budget']}, Pearson r = {res['pearson']:.3f}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
