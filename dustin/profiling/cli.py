"""`dustin profile srh|trace|search|all`: the offline profile of a target-draft pair (docs/profiling.md).

Everything lands in --out (default profile/<target>+<draft>): srh_<role>_trials.jsonl, srh_<role>.json and
srh_<role>.png; trace/<split>/*.safetensors; search.json, config.json (the tuned SparseConfig, keyed on the
pair's weight fingerprints) and the figures. Each stage skips what is already there, so an interrupted run
resumes; seeds are fixed.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dustin.data.corpora import KINDS, essays, long_texts
from dustin.errors import InputError
from dustin.eval.needles import PROFILE_NEEDLES
from dustin.flags import add_model_args, add_speculation_args, int_list
from dustin.profiling.plots import srh_heatmap

STAGES = ("srh", "trace", "search", "all")


def add_arguments(p) -> None:
    p.add_argument("stage", choices=STAGES, help="srh: retrieval heads; trace: attention rows; search: Algorithm 1")
    add_model_args(p)
    p.add_argument("--out", type=Path, default=None, help="output folder (default profile/<target>+<draft>)")
    p.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("srh")
    s.add_argument("--contexts", default=None,
                   help="needle prompt lengths (default: 20 from 1024 up to the model context, log-spaced)")
    s.add_argument("--max-context", type=int, default=None, help="cap of the default lengths")
    s.add_argument("--depths", type=int, default=10, help="needle depths per length, 0..100%%")
    s.add_argument("--needles", type=int, default=3, help="how many of the profiling needles")
    s.add_argument("--srh-max-new-tokens", type=int, default=50)
    s.add_argument("--batch-tokens", type=int, default=1 << 18, help="prompt tokens per trial batch")
    s.add_argument("--roles", default="target,draft",
                   help="which models' SRHs: target, draft or both (e.g. the draft's again at longer contexts)")
    t = p.add_argument_group("trace")
    t.add_argument("--trace-contexts", default="8192,16384,30720", help="tokens per validation text")
    t.add_argument("--trace-kinds", default="essays,squad,hotpotqa,code")
    t.add_argument("--texts", type=int, default=1, help="texts per (kind, length) and split")
    t.add_argument("--steps", type=int, default=16, help="sampled decode steps per text")
    t.add_argument("--stride", type=int, default=8, help="tokens between sampled steps")
    t.add_argument("--draft-kv", choices=["full", "streaming"], default="streaming")
    add_speculation_args(p)
    a = p.add_argument_group("search")
    a.add_argument("--budget", type=int, default=512, help="verify budget k the config is tuned for")
    a.add_argument("--search-m", default="128,192,256", help="draft budgets m scored in phase 2")
    a.add_argument("--optuna-trials", type=int, default=40)
    a.add_argument("--min-gain", type=float, default=None,
                   help="phase 2 stops when a draft layer adds less ARR than this (default 1e-4)")


def _validate(args) -> None:
    for flag in ("depths", "needles", "srh_max_new_tokens", "texts", "steps", "stride", "gamma", "optuna_trials"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.min_gain is not None and args.min_gain < 0:
        raise InputError(f"--min-gain must be >= 0, got {args.min_gain}")
    if args.budget < 21:
        raise InputError(f"--budget must be >= 21 (4 sinks + 16 recent + 1), got {args.budget}")
    if args.contexts:
        int_list("--contexts", args.contexts)
    roles = args.roles.split(",")
    if not roles or any(r not in ("target", "draft") for r in roles) or len(set(roles)) != len(roles):
        raise InputError(f"--roles must name target and/or draft once each, got {args.roles!r}")
    int_list("--trace-contexts", args.trace_contexts)
    int_list("--search-m", args.search_m)
    bad = [k for k in args.trace_kinds.split(",") if k not in KINDS]
    if bad:
        raise InputError(f"--trace-kinds: unknown {bad}; choose from {', '.join(KINDS)}")


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dustin.engine.engine import Engine

    _validate(args)
    console = Console(stderr=True)
    engine = Engine.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype,
                                    attention=args.attention,
                                    rope_scaling=args.rope_scaling)
    if engine.pair.draft is None:
        raise InputError("profiling needs a draft model (--draft)")
    if engine.pair.tokenizer is None:
        raise InputError("profiling needs the target's tokenizer (the model folder has none)")
    out = args.out or Path("profile") / f"{Path(str(args.target)).name}+{Path(str(args.draft)).name}"
    out.mkdir(parents=True, exist_ok=True)
    with (out / "runs.jsonl").open("a") as f:  # provenance: every command that wrote into this folder
        f.write(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "argv": ["dustin", *sys.argv[1:]],
                            "device": str(engine.pair.device)}) + "\n")
    costs = _load_json(out / "costs.json")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        if args.stage in ("srh", "all"):
            costs["srh_s"] = costs.get("srh_s", 0) + _timed(lambda: _srh(engine, args, out, progress))
        if args.stage in ("trace", "all"):
            costs["trace_s"] = costs.get("trace_s", 0) + _timed(lambda: _trace(engine, args, out, progress))
        (out / "costs.json").write_text(json.dumps(costs, indent=1))
        if args.stage in ("search", "all"):
            from dustin.profiling.report import run_search
            run_search(engine, args, out, costs, progress, console)
    console.print(f"profile written to {out}")
    return 0


def _srh(engine, args, out: Path, progress) -> None:
    from dustin.profiling.srh import default_contexts, run_srh, shuffled_haystacks

    if args.needles > len(PROFILE_NEEDLES):
        raise InputError(f"--needles {args.needles}: only {len(PROFILE_NEEDLES)} profiling needles exist")
    needles = PROFILE_NEEDLES[:args.needles]
    limit = engine.pair.max_context()
    limit = min(limit - args.srh_max_new_tokens - 64, args.max_context or limit)
    contexts = int_list("--contexts", args.contexts) if args.contexts else default_contexts(limit)
    haystacks = shuffled_haystacks(essays("profile"), len(needles), args.seed)
    for role in args.roles.split(","):
        res = run_srh(engine, role, out, contexts, args.depths, needles, haystacks,
                      max_new_tokens=args.srh_max_new_tokens, batch_tokens=args.batch_tokens, progress=progress)
        srh_heatmap(res, out / f"srh_{role}.png", title=f"SRH scores, {role} ({res['counted']}/{res['trials']} "
                                                          f"trials retrieved the needle)")


def _trace(engine, args, out: Path, progress) -> None:
    from dustin.profiling.srh import load_srh
    from dustin.profiling.trace import run_trace

    srh_t, srh_d = load_srh(out / "srh_target.json"), load_srh(out / "srh_draft.json")
    for split, seed in (("profile", args.seed), ("heldout", args.seed + 1)):
        texts = []
        for kind in args.trace_kinds.split(","):
            for n in int_list("--trace-contexts", args.trace_contexts):
                for i, text in enumerate(long_texts(kind, split, n, engine.pair.tokenizer, args.texts, seed)):
                    texts.append((f"{kind}-{n}-{i}", text))
        run_trace(engine, out, split, texts, srh_t, srh_d, gamma=args.gamma, steps=args.steps, stride=args.stride,
                  draft_kv=args.draft_kv, draft_window=args.draft_window, progress=progress)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 1)


def _load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
