"""`dustin bench e2e`: end-to-end decoding throughput of vanilla, classic, magicdec and dustin (the paper's Table 2)
on random-weight model pairs of real shapes, single GPU or tensor-parallel under torchrun:

    torchrun --nproc-per-node 2 -m dustin bench e2e --pairs qwen2.5-72b:qwen2.5-0.5b --contexts 8192,16384

Random weights cannot agree with a draft, so acceptance is *controlled*: every draft token is accepted with
probability p (`--accept-prob`, or `--tau` solved for p; default τ = 2.2 at Γ = 4 as in the paper), through
`GenerationConfig.accept_prob`. Everything else of each method runs for real: Γ draft forwards (full or streaming
draft cache), score estimation on the configured heads, selection, the sparse or full verify forward, all_reduces.
Results are labelled "acceptance-controlled". The prompt caches are filled with noise (`random_prefill`) instead
of running a prefill, which does not change a decode step's cost.

Per (pair, batch, context, method): `--warmup` steps (CUDA-graph capture, Triton compiles), then `--steps` timed
steps (each ends in the engine's one host sync). Reported: ms per step, measured τ, tokens/s over the batch, and
the speedup in tokens/s over our own vanilla decoding of the same shapes.
"""
from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import replace

import torch

from dustin.bench.plots import e2e_throughput
from dustin.cli.args import add_sparse_args, add_speculation_args
from dustin.errors import InputError

DEFAULT_PAIRS = "qwen2.5-72b:qwen2.5-0.5b,llama-3.3-70b:llama-3.2-1b"
METHODS = ("vanilla", "classic", "magicdec", "dustin")


def add_arguments(p) -> None:
    p.add_argument("--pairs", default=DEFAULT_PAIRS,
                   help="target:draft, each a named config or a model folder (its config.json), comma separated")
    p.add_argument("--contexts", default="8192,16384,32768", help="prompt tokens per sequence")
    p.add_argument("--batches", default="8,16")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--tau", type=float, default=2.2, help="target tokens per step for the acceptance control")
    p.add_argument("--accept-prob", type=float, default=None, help="per-token acceptance (overrides --tau)")
    add_speculation_args(p)
    add_sparse_args(p)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graphs", action="store_true", help="eager forwards instead of CUDA graphs")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot-out", default=None, help="PNG of tokens/s against context")


def _shape(name: str):
    """A named config, or the config.json of a model folder (its shape only: the weights stay random)."""
    from pathlib import Path

    from dustin.models.args import named_config
    from dustin.models.loader import read_args

    return read_args(Path(name)) if os.path.isdir(name) else named_config(name)


def _pairs(spec: str):
    out = []
    for item in spec.split(","):
        if item.count(":") != 1:
            raise InputError(f"--pairs wants target:draft (named configs or model folders), got {item!r}")
        t, d = item.split(":")
        out.append((os.path.basename(t.rstrip("/")), os.path.basename(d.rstrip("/")), _shape(t), _shape(d)))
    return out


def build_engine(t_args, d_args, device, attention: str = "auto"):
    """Random target (each rank materializes only its tensor-parallel shard) and random replicated draft."""
    from dustin.attention.backend import AttentionBackend
    from dustin.engine.engine import Engine
    from dustin.models.loader import random_model
    from dustin.parallel.tp import current_parallel, init_distributed, rank_device

    init_distributed()
    dev = rank_device(torch.device(device))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    backend = AttentionBackend.for_device(dev, attention)
    parallel = current_parallel()
    target = random_model(t_args, dev, dtype, seed=0, backend=backend, shard=parallel)
    draft = random_model(replace(d_args, vocab_size=t_args.vocab_size), dev, dtype, seed=1, backend=backend)
    return Engine(target, draft, parallel=parallel)


def run_method(engine, method: str, batch: int, context: int, a) -> dict:
    """Time `a.steps` decode steps of one method after `a.warmup` untimed ones."""
    from dustin.engine.config import METHODS, GenerationConfig
    from dustin.engine.sampling import accept_prob_for_tau

    p = a.accept_prob if a.accept_prob is not None else accept_prob_for_tau(a.tau, a.gamma)
    total_steps = a.warmup + a.steps
    sparse = METHODS[method].policy != "full"
    cfg = GenerationConfig(method=method, gamma=a.gamma, max_new_tokens=total_steps * (a.gamma + 1) + 1,
                           stop_at_eos=False, cuda_graphs=not a.no_graphs, draft_window=a.draft_window,
                           budget=a.budget if sparse else None, sparse_config=a.config if sparse else None,
                           accept_prob=None if method == "vanilla" else p)
    prompts = [[1] * context for _ in range(batch)]  # only the lengths matter: the caches are filled with noise
    s = engine.session(prompts, cfg, random_prefill=True)
    for _ in range(a.warmup):
        s.step()
    s.timer.totals()
    s.timer = type(s.timer)(s.device)  # phases of the timed steps only
    steps0, tokens0, seq_steps0 = s.stats.steps, s.stats.step_tokens, s.stats.active_seq_steps
    _sync(s.device)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        s.step()
    _sync(s.device)
    elapsed = time.perf_counter() - t0
    tokens = s.stats.step_tokens - tokens0
    row = {"method": method, "batch": batch, "context": context, "steps": s.stats.steps - steps0,
           "ms_per_step": round(1e3 * elapsed / a.steps, 3),
           "tau": round(tokens / max(s.stats.active_seq_steps - seq_steps0, 1), 3),
           "tokens_per_s": round(tokens / elapsed, 2), "accept_prob": cfg.accept_prob,
           "cuda_graphs": bool(s.use_graphs),
           "phases_ms_per_step": {k: round(1e3 * v / a.steps, 3) for k, v in s.timer.totals().items()}}
    if method == "vanilla" and getattr(a, "copy_bw", None):  # what a vanilla step must read: weights + the whole KV cache
        t = engine.target
        weights = sum(p.numel() * p.element_size() for n, p in t.named_parameters()
                      if n != "embed_tokens.weight" or t.args.tie_word_embeddings)
        kv = batch * (context + s.stats.produced // batch) * t.args.kv_bytes_per_token(t.embed_tokens.weight.element_size())
        row["fraction_of_bw_limit"] = round((weights + kv) / (elapsed / a.steps) / a.copy_bw, 3)
    del s
    _free(engine.device)
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()  # sessions, graphs and the TP policy hook form reference cycles: free them before the next pair
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"{flag} wants comma-separated positive integers, got {text!r}") from None
    if min(values) < 1:
        raise InputError(f"{flag} wants positive integers, got {text!r}")
    return values


def _fits(engine, batch: int, context: int, a) -> bool:
    """KV caches of target (this rank's heads) and draft, plus 4 GiB of work space, against free memory."""
    if engine.device.type != "cuda":
        return True
    cap = context + (a.warmup + a.steps + 2) * (a.gamma + 1) + 2 * (a.gamma + 2)
    return engine.kv_cache_bytes(batch, cap) + (4 << 30) < torch.cuda.mem_get_info(engine.device)[0]


def run(a) -> int:
    from dustin.parallel.tp import init_distributed, is_main_process, tp_rank_world

    init_distributed()  # under torchrun: join the group first, so that only rank 0 prints
    contexts, batches = _ints(a.contexts, "--contexts"), _ints(a.batches, "--batches")
    if a.accept_prob is None:
        from dustin.engine.sampling import accept_prob_for_tau
        try:
            accept_prob_for_tau(a.tau, a.gamma)
        except ValueError as e:
            raise InputError(f"--tau: {e}") from None
    elif not 0.0 <= a.accept_prob <= 1.0:
        raise InputError(f"--accept-prob must be in [0, 1], got {a.accept_prob}")
    methods = a.methods.split(",")
    unknown = set(methods) - set(METHODS) - {"dustin-t", "dustin-d", "streaming"}
    if unknown:
        raise InputError(f"bench e2e: unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("dustin bench e2e --device cuda needs a CUDA GPU")
    main = is_main_process()
    a.copy_bw = None
    if a.device.startswith("cuda"):
        from dustin.bench.decode import copy_bandwidth
        a.copy_bw = copy_bandwidth()  # bytes/s: the limit a vanilla step (weights + KV per rank) is held to
    results = []
    for t_name, d_name, t_args, d_args in _pairs(a.pairs):
        reach = max(contexts) + 4096  # random weights: any position is fine, lift the context limit
        t_args = replace(t_args, max_position_embeddings=max(t_args.max_position_embeddings, reach))
        d_args = replace(d_args, max_position_embeddings=max(d_args.max_position_embeddings, reach))
        engine = build_engine(t_args, d_args, a.device)
        world = tp_rank_world()[1]
        if main:
            dev = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
            bw = f" | copy bandwidth {a.copy_bw / 1e12:.2f} TB/s" if a.copy_bw else ""
            print(f"# {t_name} target (TP {world}) + {d_name} draft | {dev}{bw} | acceptance-controlled "
                  f"| {time.strftime('%Y-%m-%d')}", flush=True)
            print("| batch | context | method | ms/step | τ | tokens/s | speedup vs vanilla | phases ms/step |")
            print("|---|---|---|---|---|---|---|---|", flush=True)
        for B in batches:
            for ctx in contexts:
                if not _fits(engine, B, ctx, a):
                    results.append({"target": t_name, "draft": d_name, "tp": world, "batch": B, "context": ctx,
                                    "skipped": "KV caches do not fit in GPU memory"})
                    if main:
                        print(f"| {B} | {ctx} | skipped: KV caches do not fit | | | | | |", flush=True)
                    continue
                vanilla = None
                for method in methods:
                    r = {"target": t_name, "draft": d_name, "tp": world, **run_method(engine, method, B, ctx, a)}
                    vanilla = r["tokens_per_s"] if method == "vanilla" else vanilla
                    r["speedup_vs_vanilla"] = round(r["tokens_per_s"] / vanilla, 3) if vanilla else None
                    results.append(r)
                    if main:
                        _write(results, a, plot_too=False)  # after every row: a run cut short keeps its rows
                        sp = f"{r['speedup_vs_vanilla']:.2f}x" if vanilla else "-"
                        if "fraction_of_bw_limit" in r:
                            sp += f" ({100 * r['fraction_of_bw_limit']:.0f}% of BW limit)"
                        ph = ", ".join(f"{k} {v:.1f}" for k, v in r["phases_ms_per_step"].items())
                        print(f"| {B} | {ctx} | {method} | {r['ms_per_step']:.2f} | {r['tau']:.2f} | "
                              f"{r['tokens_per_s']:.1f} | {sp} | {ph} |", flush=True)
        del engine
        _free(torch.device(a.device))
    if main:
        _write(results, a)
    return 0


def _write(results, a, plot_too: bool = True) -> None:
    out = {"label": "acceptance-controlled", "date": time.strftime("%Y-%m-%d"), "settings": {
        k: v for k, v in vars(a).items() if isinstance(v, (int, float, str, bool, type(None)))}, "results": results}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
    json_path = a.json_out or (os.path.join(os.environ["OUT"], "bench_e2e.json") if os.environ.get("OUT") else None)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot_out and plot_too:
        e2e_throughput(out, a.plot_out)
