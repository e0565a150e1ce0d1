"""`dustin eval needles`: does sparse verification keep long-context retrieval? A held-out needle check.

Sparse verification reads k of the cache's positions; a method that drops the positions holding a fact the
answer needs makes the target accept a draft that never saw it (or reject the one that did), and the answer
changes. τ alone does not show this, so each method answers needle-in-a-haystack questions: held-out Paul
Graham essays (never used by SRH profiling) with held-out needles at evenly spaced depths, one needle per
prompt ("single") or four with one asked ("multikey", as in RULER). A prompt counts as retrieved when the
ROUGE-1 recall of the answer in the greedy output exceeds 0.5. Rows are written as they finish (atomically)
and a rerun with the same --json-out skips finished (kind, context, method, budget) rows.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dustin.data.corpora import long_texts
from dustin.engine.config import METHODS
from dustin.errors import InputError
from dustin.eval.needles import HELDOUT_NEEDLES, PROFILE_NEEDLES, make_needle_prompt, rouge1_recall
from dustin.eval.results import load_results, save_results
from dustin.eval.sweep import add_rows_arg, row_config, row_name, row_params, sweep_rows
from dustin.flags import add_model_args, add_sparse_args, add_speculation_args, budget_list, int_list, method_list

if TYPE_CHECKING:
    from dustin.engine.offline.prefill import PrefillCache

KINDS = ("single", "multikey")
# settings that change the numbers: a --json-out written under other values cannot be resumed
_RESUME_KEYS = ("target", "draft", "dtype", "gamma", "draft_window", "max_new_tokens", "seed", "needles", "depths",
                "config")


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--contexts", default="8192,16384,32768", help="prompt lengths in tokens (capped by the model)")
    p.add_argument("--depths", type=int, default=5, help="prompts per (kind, context): depths evenly in [0, 1]")
    p.add_argument("--kinds", default="single,multikey", help="single and/or multikey (4 needles, one asked)")
    p.add_argument("--methods", default="vanilla,dustin,quest,streaming")
    p.add_argument("--needles", choices=["heldout", "profile"], default="heldout")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="haystack shuffling")
    add_speculation_args(p)
    add_sparse_args(p, sweep="512,256")
    add_rows_arg(p)
    p.add_argument("--json-out", default=None, help="results file; rerunning with it skips finished rows")


def plan(args) -> dict:
    """Every flag checked before any model loads; returns the run's settings."""
    contexts, budgets = int_list("--contexts", args.contexts, 1), budget_list("--budgets", args.budgets)
    methods = method_list(args.methods)
    kinds = list(dict.fromkeys(k for k in args.kinds.split(",") if k))
    if not kinds or any(k not in KINDS for k in kinds):
        raise InputError(f"--kinds must be a comma-separated subset of {', '.join(KINDS)}, got {args.kinds!r}")
    if args.depths < 1:
        raise InputError(f"--depths must be >= 1 (prompts per kind and context), got {args.depths}")
    rows, extra = sweep_rows(methods, budgets, args, args.max_new_tokens)
    settings = {**{k: getattr(args, k) for k in _RESUME_KEYS}, **extra}
    return {"contexts": contexts, "kinds": kinds, "rows": rows, "settings": settings}


def build_prompts(tokenizer, kind: str, n_tokens: int, depths: int, needles, seed: int) -> list:
    """`depths` prompts of one kind; the asked needles cycle over the set, and in multikey prompts the other
    three needles sit a quarter, half and three quarters of the document away (wrapping around)."""
    spots = [i / (depths - 1) for i in range(depths)] if depths > 1 else [0.5]
    # 10% more text than needed, so the haystack can end at a sentence boundary close to the length asked
    hays = long_texts("essays", "heldout", n_tokens * 11 // 10, tokenizer, depths, seed * 1_000_003 + n_tokens)
    prompts = []
    for i, (depth, hay) in enumerate(zip(spots, hays, strict=False)):
        if kind == "single":
            prompts.append(make_needle_prompt(tokenizer, hay, n_tokens, [needles[i % len(needles)]], [depth]))
            continue
        placed = sorted((((depth + j / 4) % 1.0 if j else depth, needles[(i + j) % len(needles)]) for j in range(4)),
                        key=lambda x: x[0])
        asked = [n for _, n in placed].index(needles[i % len(needles)])
        prompts.append(make_needle_prompt(tokenizer, hay, n_tokens, [n for _, n in placed], [d for d, _ in placed],
                                          asked=asked))
    return prompts


def run(args) -> int:
    from rich.console import Console

    from dustin.engine.engine import Engine
    from dustin.parallel.tp import is_main_process

    p = plan(args)
    results = load_results(args.json_out, p["settings"], "needles")
    done = {(r["kind"], r["context"], r["method"], r["budget"]) for r in results["rows"]}
    todo = {(kind, ctx): [(m, k) for m, k in p["rows"] if (kind, ctx, m, k) not in done]
            for kind in p["kinds"] for ctx in p["contexts"]}
    todo = {group: rows for group, rows in todo.items() if rows}
    if not todo:  # everything was measured by an earlier run: no model to load
        _print(results, p, Console())
        return 0
    speculative = any(METHODS[m].speculative for rows in todo.values() for m, _ in rows)
    engine = Engine.from_pretrained(args.target, args.draft if speculative else None, device=args.device,
                                    dtype=args.dtype, attention=args.attention,
                                    rope_scaling=args.rope_scaling)
    if engine.pair.tokenizer is None:
        raise InputError("the target model folder has no tokenizer: needle prompts are text")
    main = is_main_process()  # under torchrun only rank 0 reports and writes
    console = Console(stderr=True, quiet=not main)
    limit = engine.pair.max_context(speculative)
    from dustin.engine.kv_manager import cache_capacity, positions_needed

    room = limit - positions_needed(0, args.max_new_tokens, args.gamma)  # the longest prompt that fits
    needles = HELDOUT_NEEDLES if args.needles == "heldout" else PROFILE_NEEDLES
    from dustin.engine.offline.prefill import PrefillCache

    shared = PrefillCache()  # each (kind, context)'s prompts are prefilled once for every method
    for (kind, ctx), rows in todo.items():
        n = min(ctx, room)
        # the depths are one batch, holding its session's KV caches and the shared prefill's copy: refuse now
        # what would run out of memory only at the first speculative row, after a whole prefill
        capacity = cache_capacity([n], [args.max_new_tokens], args.gamma if speculative else 0)
        engine.pair.kv_fit(speculative).require(args.depths, capacity, copies=2, advice="lower --depths")
        if n < ctx:
            console.print(f"context {ctx}: prompts of {n} tokens (model limit {limit} minus generation room)")
        with console.status(f"{kind} {ctx}: building {args.depths} prompts..."):
            prompts = build_prompts(engine.pair.tokenizer, kind, n, args.depths, needles, args.seed)
        if max(q.n_tokens for q in prompts) > room:
            raise InputError(f"a needle prompt for context {ctx} has {max(q.n_tokens for q in prompts)} tokens, "
                             f"more than the model allows with the generated tokens ({room})")
        for method, budget in rows:
            results["rows"].append(_evaluate(engine, console, prompts, kind, ctx, method, budget, args, shared))
            if main:
                save_results(args.json_out, results)
    if main:
        _print(results, p, Console())
    return 0


def _evaluate(engine, console, prompts, kind, ctx, method, budget, args, shared: PrefillCache) -> dict:
    cfg = row_config(method, budget, args)
    name = row_name(method, budget)
    t0 = time.perf_counter()
    with console.status(f"{kind} {ctx}: {name} on {len(prompts)} prompts..."):
        r = engine.generate([q.ids for q in prompts], cfg, row_params(args.max_new_tokens),
                            prefill_cache=shared)
    samples = []
    for q, s in zip(prompts, r.sequences, strict=False):
        recall = rouge1_recall(s.text or "", q.answer)
        samples.append({"depth": q.depth, "question": q.question, "answer": q.answer, "prediction": s.text,
                        "rouge1_recall": recall, "retrieved": recall > 0.5, "prompt_tokens": q.n_tokens})
    score = sum(x["retrieved"] for x in samples) / len(samples)
    tau = r.tau if engine.pair.draft is not None and cfg.spec.speculative else None
    console.print(f"{kind} {ctx}: {name}: {sum(x['retrieved'] for x in samples)}/{len(samples)} retrieved"
                  + (f", τ {tau:.2f}" if tau is not None else "")
                  + (f", mean k {r.budget_k['mean']:.0f}" if r.budget_k else "")
                  + f" ({time.perf_counter() - t0:.0f}s)",
                  highlight=False)
    return {"kind": kind, "context": ctx, "method": method, "budget": budget, "score": score, "tau": tau,
            "tokens_per_s": r.tokens_per_s, "sparse_config": getattr(r, "sparse_config", None), "budget_k": r.budget_k,
            "samples": samples}


def _print(results: dict, p: dict, console) -> None:
    from rich.table import Table

    rows = {(r["kind"], r["context"], r["method"], r["budget"]): r for r in results["rows"]}
    for kind in p["kinds"]:
        t = Table(title=f"needles, {kind}: retrieved (τ)")
        t.add_column("method")
        for ctx in p["contexts"]:
            t.add_column(str(ctx), justify="right")
        for method, budget in p["rows"]:
            cells = []
            for ctx in p["contexts"]:
                r = rows.get((kind, ctx, method, budget))
                cells.append("-" if r is None else f"{100 * r['score']:.0f}%"
                             + (f" ({r['tau']:.2f})" if r["tau"] is not None else ""))
            t.add_row(row_name(method, budget), *cells)
        console.print(t)
