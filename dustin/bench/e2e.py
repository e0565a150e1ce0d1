"""`dustin bench e2e`: end-to-end decoding throughput of vanilla, classic, magicdec and dustin (the paper's Table 2),
in two modes that share the per-method timing (`run_method`).

Random weights (default): model pairs of real shapes, single GPU or tensor-parallel under torchrun:

    torchrun --nproc-per-node 2 -m dustin bench e2e --pairs qwen2.5-72b:qwen2.5-0.5b --contexts 8192,16384

Random weights cannot agree with a draft, so acceptance is *controlled*: every draft token is accepted with
probability p (`--accept-prob`, or `--tau` solved for p; default τ = 2.2 at Γ = 4 as in the paper), through
`ExecutionOptions.accept_prob`. Everything else of each method runs for real: Γ draft forwards (full or streaming
draft cache), score estimation on the configured heads, selection, the sparse or full verify forward, all_reduces.
Results are labelled "acceptance-controlled". The prompt caches are filled with noise (a "noise" gang,
dustin/engine/offline/prefill.py) instead of running a prefill, which does not change a decode step's cost.

Real weights (`--real`): the staged pair (`--target`/`--draft`, default the fetched default pair) on real
prompts, verified for real (greedy), so τ is measured; labelled "real weights":

    dustin bench e2e --real --contexts 8192,16384,32768 --batches 8,16 --prompts code,prose

`--prompts` kinds are separate row sets (τ depends on the text): code = held-out Python sources of the standard
library and installed packages, prose = held-out essays (the data package, downloaded on first use); both through
`dustin.data.corpora.long_texts` as in `bench serve`: shuffled documents joined, each drawn once until the corpus
runs out (the held-out essays hold ~310k tokens, so at 16 x 32k some recur, in other sequences at other offsets),
cut to exactly the context in tokens. A context up to the model's context that leaves no room for the decoded tokens is
cut to fit (the row keeps the requested context and records `prompt_tokens`); one past it is an error. Each
(prompts, batch, context) is prefilled once: every method's session copies the saved prompt caches
(`PrefillCache`), which is exact for greedy sessions.

Per (batch, context, method): `--warmup` steps (CUDA-graph capture, Triton compiles; their wall time is reported as
`warmup_s`), then `--steps` timed steps (each ends in the engine's one host sync). Reported: ms per step with the
session's phase timer, measured τ, tokens/s over the batch, the speedup in tokens/s over our own vanilla decoding of
the same shapes, and the byte roofline (`dustin.bench.roofline`): the bytes a step must read, and the time a
read-only kernel measured in the same run takes for them (`dustin.bench.decode.read_bandwidth`) as a % of the step.
Where the draft's phase is timed on its own (`--no-step-graph`, or eager forwards), a speculative row also reports
the draft's ms per forward (its phase / Γ) and the read GB/s it achieves (its bytes / its phase). On a CPU the
bandwidth is a 64 MB sum: those rows check the plumbing, not the hardware.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from dustin.bench.plots import e2e_real, e2e_throughput
from dustin.bench.serve import make_prompts
from dustin.defaults import GAMMA_AUTO_MAX
from dustin.engine.config import METHODS as ENGINE_METHODS
from dustin.engine.config import ExecutionOptions, GenerationConfig
from dustin.engine.request import SamplingParams
from dustin.errors import InputError
from dustin.flags import add_draft_kernel_arg, add_model_args, add_sparse_args, add_speculation_args, budget_settings
from dustin.models.args import named_config, pair_context, with_rope_scaling
from dustin.models.fetch import resolve_model_path
from dustin.selection.config import DUSTIN_POLICIES

if TYPE_CHECKING:
    import torch

DEFAULT_PAIRS = "qwen2.5-72b:qwen2.5-0.5b,llama-3.3-70b:llama-3.2-1b"
METHODS = ("vanilla", "classic", "magicdec", "dustin")
REAL_METHODS = ("vanilla", "classic", "magicdec", "streaming", "dustin")
# also accepted: the ablations and the per-layer baselines (graph-safe: each step one CUDA graph like dustin's). Not
# snapkv / oracle: SnapKV needs its own prefill's observation window, the oracle reads the whole cache.
EXTRA_METHODS = ("dustin-t", "dustin-d", "streaming", "quest", "specattn")
DEFAULT_TAU = 2.2
PROMPT_KINDS = {"code": "code", "prose": "essays"}  # --prompts kind -> `dustin.data.corpora` text kind


class _Default(str):
    """A flag's default text, told apart from the same text given on the command line (argparse keeps it)."""


def add_arguments(p) -> None:
    add_model_args(p)  # --target/--draft (--real), --device, --dtype, --attention
    p.add_argument("--real", action="store_true",
                   help="the real pair (--target/--draft) on real code and prose prompts, greedy verification "
                        "(τ measured), instead of random-weight pairs with acceptance control")
    p.add_argument("--pairs", default=_Default(DEFAULT_PAIRS),
                   help="random weights: target:draft, each a named config or a model folder (its config.json), "
                        "comma separated")
    p.add_argument("--prompts", default=None,
                   help="--real: prompt kinds, comma separated, one row set each: code, prose (default code,prose)")
    p.add_argument("--contexts", default="8192,16384,32768", help="prompt tokens per sequence")
    p.add_argument("--batches", default="8,16")
    p.add_argument("--methods", default=_Default(",".join(METHODS)),
                   help=f"default {','.join(METHODS)}; with --real {','.join(REAL_METHODS)}")
    p.add_argument("--tau", type=float, default=None,
                   help=f"target tokens per step for the acceptance control (random weights; default {DEFAULT_TAU})")
    p.add_argument("--accept-prob", type=float, default=None, help="per-token acceptance (overrides --tau)")
    add_draft_kernel_arg(add_speculation_args(p, auto=True))
    add_sparse_args(p)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (graph capture, Triton compiles)")
    p.add_argument("--steps", type=int, default=12, help="timed steps")
    p.add_argument("--seed", type=int, default=0, help="--real: which documents the prompts are cut from")
    p.add_argument("--no-graphs", action="store_true", help="eager forwards instead of CUDA graphs")
    p.add_argument("--no-step-graph", action="store_true",
                   help="one CUDA graph per forward instead of one per speculative step (A/B of the step graph)")
    p.add_argument("--no-overlap", action="store_true",
                   help="read each step back before queueing the next (A/B of the engine loop's one-step lookahead)")
    p.add_argument("--json-out", default=None, help="write the results JSON here (default: none)")
    p.add_argument("--plot-out", default=None,
                   help="PNG of tokens/s (and, --real, %% of byte roofline) against context")


def _shape(name: str):
    """A named config, or the config.json of a model folder (its shape only: the weights stay random)."""
    from pathlib import Path

    from dustin.models.loader import read_args

    return read_args(Path(name)) if os.path.isdir(name) else named_config(name)


def _pairs(spec: str, rope_scaling: str | None = None):
    """(target name, draft name, target args, draft args) per pair; --rope-scaling applies to both shapes."""
    out = []
    for item in spec.split(","):
        if item.count(":") != 1:
            raise InputError(f"--pairs wants target:draft (named configs or model folders), got {item!r}")
        t, d = item.split(":")
        out.append((os.path.basename(t.rstrip("/")), os.path.basename(d.rstrip("/")),
                    with_rope_scaling(_shape(t), rope_scaling), with_rope_scaling(_shape(d), rope_scaling)))
    return out


def build_engine(t_args, d_args, device, attention: str = "auto", dtype: str = "auto"):
    """Random target (each rank materializes only its tensor-parallel shard) and random replicated draft."""
    import torch

    from dustin.attention.backend import AttentionBackend
    from dustin.engine.engine import Engine
    from dustin.engine.pair import resolve_dtype
    from dustin.models.loader import random_model
    from dustin.parallel.tp import current_parallel, init_distributed, rank_device

    init_distributed()
    dev = rank_device(torch.device(device))
    dt = resolve_dtype(dtype, dev)
    backend = AttentionBackend.for_device(dev, attention)
    parallel = current_parallel()
    target = random_model(t_args, dev, dt, seed=0, backend=backend, shard=parallel)
    draft = random_model(replace(d_args, vocab_size=t_args.vocab_size), dev, dt, seed=1, backend=backend)
    return Engine.from_models(target, draft, parallel=parallel)


def _params(a, steps: int):
    """Each sequence's sampling in a benchmark session: greedy, room for `steps` steps, EOS ignored (every sequence
    decodes every step)."""
    return SamplingParams(max_tokens=steps * (gamma_max(a) + 1) + 1, temperature=0, ignore_eos=True)


def _config(method: str, a, accept_prob: float | None = None):
    """The GenerationConfig of one benchmark session."""
    sparse = ENGINE_METHODS[method].policy != "full"
    return GenerationConfig(method=method, gamma=a.gamma, draft_window=a.draft_window,
                            options=ExecutionOptions(cuda_graphs=not a.no_graphs,
                                                     step_graph=not getattr(a, "no_step_graph", False),
                                                     overlap=not getattr(a, "no_overlap", False),
                                                     accept_prob=accept_prob,
                                                     draft_kernel=a.draft_kernel,
                                                     fused_ops=not getattr(a, "no_fused_ops", False)),
                            sparse_config=a.config if sparse else None,
                            **budget_settings(a, sparse, ENGINE_METHODS[method].policy in DUSTIN_POLICIES))


def gamma_max(a) -> int:
    """The largest Γ a step may take: --gamma, or under --gamma auto the largest any sequence picks."""
    return GAMMA_AUTO_MAX if a.gamma == "auto" else a.gamma


def bench_session(engine, method: str, batch: int, context: int, a, steps: int):
    """An acceptance-controlled engine core of `method` over noise-filled caches of `batch` x `context`, with room
    for `steps` steps, and its config."""
    from dustin.engine.sampling import accept_prob_for_tau

    tau = a.tau if a.tau is not None else DEFAULT_TAU
    p = a.accept_prob if a.accept_prob is not None else accept_prob_for_tau(tau, gamma_max(a))
    cfg = _config(method, a, None if method == "vanilla" else p)
    prompts = [[1] * context for _ in range(batch)]  # only the lengths matter: the caches are filled with noise
    return engine.start(prompts, cfg, _params(a, steps), fill="noise"), cfg


PROFILED_STEPS = 2  # steps after the timed ones whose GPU kernels are counted (CUDA only)


def run_steps(core, steps: int) -> None:
    """`steps` engine steps (the device a step ahead of the host, as in offline generation), all read back."""
    for _ in range(steps):
        core.step()
    core.drain()


def _kernels_per_step(core, steps: int) -> float:
    """GPU kernels (and memory copies) per step over `steps` more steps, from the profiler's CUDA activity: the
    number of launches a step pays, each with its own launch latency and tail (inside a CUDA graph too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps(core, steps)
        _sync(core.runner.device)
    return round(sum(e.device_type.name == "CUDA" for e in prof.events()) / steps, 1)


def run_method(engine, method: str, batch: int, context: int, a, prompts=None, prefill_cache=None) -> dict:
    """Time `a.steps` decode steps of one method after `a.warmup` untimed ones (the first of which prefills), then
    (on a GPU) count the kernels of `PROFILED_STEPS` more. prompts: real token ids, `batch` of `context` each,
    verified for real (greedy; runs given the same `prefill_cache` share one prefill); None: acceptance-controlled
    over noise-filled caches (`bench_session`)."""
    profiled = PROFILED_STEPS if engine.pair.device.type == "cuda" else 0
    total = max(a.warmup, 1) + a.steps + profiled
    if prompts is None:
        core, cfg = bench_session(engine, method, batch, context, a, total)
    else:
        cfg = _config(method, a)
        core = engine.start(prompts, cfg, _params(a, total), prefill_cache=prefill_cache)
    # tensor parallelism: rank 0 steps and times, the other ranks follow its plans; every rank gets its row
    row = core.executor.lead_or_follow(functools.partial(_time_method, engine, core, cfg, method, batch, context, a,
                                                profiled))
    del core
    _free(engine.pair.device)
    return row


def _time_method(engine, core, cfg, method: str, batch: int, context: int, a, profiled: int) -> dict:
    """`run_method`'s timing of a started core (rank 0's part under tensor parallelism)."""
    s = core.runner
    _sync(s.device)
    t0 = time.perf_counter()
    run_steps(core, 1)  # the prefill, and the first decode step
    _sync(s.device)
    prefill_s = time.perf_counter() - t0
    run_steps(core, max(a.warmup - 1, 0))
    _sync(s.device)
    warmup_s = time.perf_counter() - t0
    s.reset_timer()  # phases of the timed steps only
    s.policy.budget_stats(reset=True)  # --budget auto: the k of the timed steps only
    st = core.decode_stats
    steps0, tokens0, seq_steps0, gammas0 = st.steps, st.step_tokens, st.active_seq_steps, dict(st.gammas)
    _sync(s.device)
    t0 = time.perf_counter()
    run_steps(core, a.steps)
    _sync(s.device)
    elapsed = time.perf_counter() - t0
    tokens = st.step_tokens - tokens0
    row = {"method": method, "batch": batch, "context": context, "steps": st.steps - steps0,
           "ms_per_step": round(1e3 * elapsed / a.steps, 3),
           "tau": round(tokens / max(st.active_seq_steps - seq_steps0, 1), 3),
           "tokens_per_s": float(f"{tokens / elapsed:.5g}"),  # 5 digits: a CPU run makes ~2 tokens/s
           "accept_prob": cfg.options.accept_prob,
           "cuda_graphs": bool(s.use_graphs),
           "phases_ms_per_step": {k: round(1e3 * v / a.steps, 3) for k, v in s.timer.totals().items()},
           "warmup_s": round(warmup_s, 3), "capture_s": round(s.capture_total(), 3),
           "prefill_s": round(prefill_s, 3), "budget_k": s.policy.budget_stats()}
    if core.gamma_rule is not None:  # --gamma auto: sequence steps of each Γ in the timed steps
        row["gamma_steps"] = {g: n - gammas0.get(g, 0) for g, n in sorted(st.gammas.items()) if n > gammas0.get(g, 0)}
        c = core.gamma_rule.costs  # the cost model the rows chose by: ms of a step of each Γ at the row's context
        row["step_costs_ms"] = {g: round(1e3 * c.seconds(g, context), 3) for g in c.gammas}
    # the bytes a step must read (at the mean context of the timed steps; not under --gamma auto, whose steps differ)
    if getattr(a, "read_bw", None) and core.gamma_rule is None:
        from dustin.bench.roofline import step_bytes

        mean_ctx = context + st.produced // (2 * batch)
        pair = engine.pair
        b = step_bytes(method, pair.target, pair.draft, batch, mean_ctx, a.gamma, draft_window=a.draft_window,
                       sparse_cfg=s.policy.cfg, target_args=pair.target_args)
        row["bytes_per_step"] = {"target": b.target, "draft": b.draft, "estimate": b.estimate, "total": b.total}
        # 4 significant digits: on a CPU a step reads its bytes in ~0.01% of its time (1 decimal rounded to 0)
        share = b.seconds(a.read_bw) / (elapsed / a.steps)
        row["fraction_of_bw_limit"] = float(f"{share:.4g}")
        row["roofline_ms_per_step"] = float(f"{1e3 * b.seconds(a.read_bw):.4g}")
        row["pct_of_byte_roofline"] = float(f"{100 * share:.4g}")
        draft_ms = row["phases_ms_per_step"].get("draft")
        if draft_ms and b.draft:  # the draft's phase timed apart: its cost per forward and the rate it reads at
            row["draft_ms_per_forward"] = round(draft_ms / a.gamma, 4)
            row["draft_read_gb_s"] = round(b.draft / (draft_ms / 1e3) / 1e9, 1)
            row["draft_pct_of_read_bw"] = round(100 * b.draft / (draft_ms / 1e3) / a.read_bw, 1)
    if profiled:
        row["kernels_per_step"] = _kernels_per_step(core, profiled)
    return row


def real_prompts(tokenizer, kind: str, n_tokens: int, batch: int, seed: int) -> list[list[int]]:
    """`batch` prompts of exactly `n_tokens` token ids from real `kind` texts (code or prose, see the module
    docstring): the same texts as `bench serve`'s; sequence i is the same for every batch size."""
    ids = make_prompts(tokenizer, PROMPT_KINDS[kind], (n_tokens, n_tokens), batch, seed, len(tokenizer))
    short = min(len(x) for x in ids)
    if short < n_tokens:
        raise InputError(f"the {kind} texts gave a prompt of {short} tokens, fewer than the {n_tokens} asked")
    return ids


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    import torch

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
    """KV caches of target (this rank's heads) and draft against free GPU memory; with --real held twice, the
    session's and the saved prefill's (`PrefillCache`: a copy of the prompt caches)."""
    if engine.pair.device.type != "cuda":
        return True
    from dustin.engine.kv_manager import cache_capacity

    g = gamma_max(a)
    cap = cache_capacity([context], [(a.warmup + a.steps) * (g + 1) + 1], g)  # as `_config` asks
    return engine.pair.kv_fit().fits(batch, cap, copies=2 if a.real else 1)


def _read_bandwidth(device: str) -> float:
    """Bytes/s of a read-only kernel on the device: the bandwidth of the byte roofline (a step only reads)."""
    from dustin.bench.decode import read_bandwidth
    return read_bandwidth(device)


def _plan(a) -> dict:
    """Every flag checked (one InputError line each) before any model is built or loaded."""
    import torch

    plan = {"contexts": _ints(a.contexts, "--contexts"), "batches": _ints(a.batches, "--batches")}
    if a.warmup < 0 or a.steps < 1:
        raise InputError(f"--warmup must be >= 0 and --steps >= 1, got {a.warmup} and {a.steps}")
    if a.real:
        if a.tau is not None or a.accept_prob is not None:
            flag = "--tau" if a.tau is not None else "--accept-prob"
            raise InputError(f"{flag} sets acceptance control (random weights); --real verifies for real and "
                             f"measures τ")
        if not isinstance(a.pairs, _Default):
            raise InputError("--pairs names random-weight pairs; --real takes --target and --draft")
    else:
        if a.prompts is not None or a.target != "default" or a.draft != "default":
            raise InputError("--prompts, --target and --draft apply to --real; random weights take --pairs")
        if a.accept_prob is None:
            from dustin.engine.sampling import accept_prob_for_tau
            try:
                accept_prob_for_tau(a.tau if a.tau is not None else DEFAULT_TAU, gamma_max(a))
            except ValueError as e:
                raise InputError(f"--tau: {e}") from None
        elif not 0.0 <= a.accept_prob <= 1.0:
            raise InputError(f"--accept-prob must be in [0, 1], got {a.accept_prob}")
    methods = (",".join(REAL_METHODS) if a.real and isinstance(a.methods, _Default) else a.methods).split(",")
    unknown = set(methods) - set(METHODS + EXTRA_METHODS)
    if unknown:
        raise InputError(f"bench e2e: unknown methods {sorted(unknown)}; choose from "
                         f"{', '.join(METHODS + EXTRA_METHODS)}")
    plan["methods"] = methods
    a.methods = ",".join(methods)  # the settings written with the results name what ran
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("dustin bench e2e --device cuda needs a CUDA GPU")
    if a.real:
        kinds = (a.prompts or ",".join(PROMPT_KINDS)).split(",")
        if not kinds or set(kinds) - set(PROMPT_KINDS):
            raise InputError(f"--prompts wants kinds from {', '.join(PROMPT_KINDS)}, got {a.prompts!r}")
        plan["kinds"] = list(dict.fromkeys(kinds))
        a.prompts = ",".join(plan["kinds"])
        plan.update(_real_models(a, any(ENGINE_METHODS[m].speculative for m in methods), plan["contexts"]))
    return plan


def _real_models(a, speculative: bool, contexts: list[int]) -> dict:
    """The pair's names and the prompt length that leaves room for the decoded tokens, from config.json alone
    (no weights read): a missing model or a context past the model's is one line before the slow load."""
    from dustin.models.loader import read_args

    t_path = resolve_model_path(a.target, "target")
    rope = getattr(a, "rope_scaling", None)  # --rope-scaling yarn:F: the context the Engine loads with (F x)
    d_path = resolve_model_path(a.draft, "draft") if speculative and a.draft else None
    if speculative and d_path is None:
        raise InputError("speculative methods need a draft model (--draft)")
    limit = pair_context(read_args(t_path, rope), read_args(d_path, rope) if d_path is not None else None)
    if max(contexts) > limit:
        raise InputError(f"--contexts {max(contexts)} is past the model context ({limit} positions)")
    from dustin.engine.kv_manager import positions_needed

    # the longest prompt that leaves the positions of `_params`' max_tokens
    room = limit - positions_needed(0, _params(a, a.warmup + a.steps + PROFILED_STEPS).max_tokens, gamma_max(a))
    if room < 1:
        raise InputError(f"--warmup {a.warmup} + --steps {a.steps} decode past the model context ({limit})")
    return {"target": t_path.name, "draft": d_path.name if d_path else None, "limit": limit, "room": room,
            "load": (str(t_path), str(d_path) if d_path else None)}


def run(a) -> int:
    from dustin.parallel.tp import init_distributed, is_main_process

    init_distributed()  # under torchrun: join the group first, so that only rank 0 prints
    plan = _plan(a)
    a.read_bw = _read_bandwidth(a.device)
    results: list[dict] = []
    if a.real:
        meta = {"label": "real weights", "models": {"target": plan["target"], "draft": plan["draft"]}}
        _run_real(a, plan, results, meta)
    else:
        meta = {"label": "acceptance-controlled"}
        _run_random(a, plan, results, meta)
    if is_main_process():
        _write(results, a, meta)
    return 0


def _run_random(a, plan: dict, results: list[dict], meta: dict) -> None:
    """Random-weight pairs of real shapes, noise-filled caches, acceptance control."""
    import torch

    from dustin.parallel.tp import tp_rank_world

    for t_name, d_name, t_args, d_args in _pairs(a.pairs, a.rope_scaling):
        reach = max(plan["contexts"]) + 4096  # random weights: any position is fine, lift the context limit
        t_args = replace(t_args, max_position_embeddings=max(t_args.max_position_embeddings, reach))
        d_args = replace(d_args, max_position_embeddings=max(d_args.max_position_embeddings, reach))
        engine = build_engine(t_args, d_args, a.device, a.attention, a.dtype)
        base = {"target": t_name, "draft": d_name, "tp": tp_rank_world()[1]}
        _header(engine, base, a)
        for B in plan["batches"]:
            for ctx in plan["contexts"]:
                _run_group(engine, B, ctx, a, base, plan["methods"], results, meta)
        del engine
        _free(torch.device(a.device))


def _run_real(a, plan: dict, results: list[dict], meta: dict) -> None:
    """The real pair, real prompts per kind, one shared prefill per (kind, batch, context)."""
    import torch

    from dustin.engine.engine import Engine
    from dustin.parallel.tp import is_main_process, tp_rank_world

    engine = Engine.from_pretrained(plan["load"][0], plan["load"][1], device=a.device, dtype=a.dtype,
                                    attention=a.attention,
                                    rope_scaling=a.rope_scaling)
    if engine.pair.tokenizer is None:
        raise InputError("the target model folder has no tokenizer: --real prompts are text")
    base = {"target": plan["target"], "draft": plan["draft"], "tp": tp_rank_world()[1]}
    _header(engine, base, a)
    for ctx in plan["contexts"]:
        if ctx > plan["room"] and is_main_process():
            print(f"# context {ctx}: prompts of {plan['room']} tokens (model context {plan['limit']} minus the "
                  f"decoded tokens)", flush=True)
    for kind in plan["kinds"]:
        for B in plan["batches"]:
            for ctx in plan["contexts"]:
                group = {**base, "prompts": kind, "prompt_tokens": min(ctx, plan["room"])}
                _run_group(engine, B, ctx, a, group, plan["methods"], results, meta)
    del engine
    _free(torch.device(a.device))


def _run_group(engine, B: int, ctx: int, a, base: dict, methods: list[str], results: list[dict], meta: dict) -> None:
    """Every method at one (batch, context): rows appended, written and printed as they complete. With --real the
    prompts (base["prompts"] kind, base["prompt_tokens"] each) are built and prefilled once for all methods."""
    from dustin.engine.offline.prefill import PrefillCache
    from dustin.parallel.tp import is_main_process

    main = is_main_process()
    n = base.get("prompt_tokens", ctx)
    if not _fits(engine, B, n, a):
        results.append({**base, "batch": B, "context": ctx, "skipped": "KV caches do not fit in GPU memory"})
        if main:
            _print_row(results[-1], a.real)
        return
    prompts = real_prompts(engine.pair.tokenizer, base["prompts"], n, B, a.seed) if a.real else None
    shared = PrefillCache() if a.real else None  # the prompt caches of the first method, copied by the others
    vanilla = None
    for method in methods:
        r = {**base, **run_method(engine, method, B, n, a, prompts, shared), "context": ctx}
        vanilla = r["tokens_per_s"] if method == "vanilla" else vanilla
        r["speedup_vs_vanilla"] = round(r["tokens_per_s"] / vanilla, 3) if vanilla else None
        results.append(r)
        if main:
            _write(results, a, meta, plot_too=False)  # after every row: a run cut short keeps its rows
            _print_row(r, a.real)
    del shared, prompts
    _free(engine.pair.device)


def _header(engine, base: dict, a) -> None:
    import torch

    from dustin.parallel.tp import is_main_process

    if not is_main_process():
        return
    dev = torch.cuda.get_device_name() if engine.pair.device.type == "cuda" else "cpu"
    bw = f" | read bandwidth {a.read_bw / 1e9:.1f} GB/s" if a.read_bw else ""
    label = "real weights, greedy verification" if a.real else "acceptance-controlled"
    print(f"# {base['target']} target (TP {base['tp']}) + {base['draft']} draft | {dev}{bw} | {label} "
          f"| {time.strftime('%Y-%m-%d')}", flush=True)
    cols = ["prompts"] * a.real + ["batch", "context", "method", "ms/step", "τ", "tokens/s", "speedup vs vanilla",
                                   "% of byte roofline", "kernels/step", "warm-up s", "phases ms/step"]
    print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|", flush=True)


def _print_row(r: dict, real: bool) -> None:
    n = r.get("prompt_tokens", r["context"])
    context = r["context"] if n == r["context"] else f"{r['context']} ({n})"
    cells = ([r["prompts"]] if real else []) + [r["batch"], context]
    if "skipped" in r:
        cells += [f"skipped: {r['skipped']}"] + [""] * 8
    else:
        sp, roof = r["speedup_vs_vanilla"], r.get("pct_of_byte_roofline")
        cells += [r["method"], f"{r['ms_per_step']:.2f}", f"{r['tau']:.2f}", f"{r['tokens_per_s']:.1f}",
                  "-" if sp is None else f"{sp:.2f}x", "-" if roof is None else f"{roof:.0f}%",
                  r.get("kernels_per_step", "-"), f"{r['warmup_s']:.1f}",
                  ", ".join(f"{k} {v:.1f}" for k, v in r["phases_ms_per_step"].items())]
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def _write(results, a, meta: dict, plot_too: bool = True) -> None:
    import torch

    other_mode = {"pairs", "tau", "accept_prob"} if a.real else {"target", "draft", "prompts", "seed"}
    out = {**meta, "date": time.strftime("%Y-%m-%d"), "settings": {
        k: v for k, v in vars(a).items() if isinstance(v, (int, float, str, bool, type(None))) and k not in other_mode},
        "results": results}
    out["device"] = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot_out and plot_too:
        (e2e_real if a.real else e2e_throughput)(out, a.plot_out)
