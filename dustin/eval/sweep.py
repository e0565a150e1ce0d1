"""The rows of an accuracy sweep (`dustin eval tasks`, `dustin eval needles`): which (method, budget) pairs run
and the generation settings of each, declared once for both commands.

A sweep runs the lossless methods once (their greedy output does not depend on k) and every sparse method at each
fixed k of --budgets; an `auto:P` budget sizes k per sequence and step from Dustin's own score estimate
(dustin/selection/adaptive.py), so only the Dustin methods get those rows."""
from __future__ import annotations

from dustin.engine.config import GenerationConfig
from dustin.errors import InputError
from dustin.flags import auto_p, check_sparse_config

LOSSLESS = ("vanilla", "classic", "magicdec")  # same output as vanilla (greedy): run once, not per budget
HYBRID_FAMILY = ("dustin-t", "dustin-d", "dustin")  # the methods that can size k themselves (auto:P)


def sweep_rows(methods: list[str], budgets: list[int | str], args, max_new_tokens: int = 128
               ) -> tuple[list[tuple[str, int | str | None]], dict]:
    """(rows, settings to resume by): the lossless rows first (agreement is measured against them), then each
    budget's sparse rows; every row's settings validated before any model loads. The settings hold the auto
    rows' k range only when there are auto rows, so that older result files still resume."""
    autos = [k for k in budgets if auto_p(k) is not None]
    if autos and not any(m in HYBRID_FAMILY for m in methods):
        raise InputError(f"--budgets {autos[0]} sizes Dustin's selection: add dustin, dustin-t or dustin-d to "
                         f"--methods")
    check_sparse_config(args.config, [k for k in budgets if auto_p(k) is None] + ([args.budget_max] if autos else []))
    ordered = sorted(methods, key=lambda m: m not in LOSSLESS)
    rows = [(m, None) for m in ordered if m in LOSSLESS] + [
        (m, k) for k in budgets for m in ordered if m not in LOSSLESS and (auto_p(k) is None or m in HYBRID_FAMILY)]
    for m, k in rows + [(m, budgets[0]) for m in ordered if m in LOSSLESS]:
        row_config(m, k, args, max_new_tokens)
    return rows, ({"budget_range": [args.budget_min, args.budget_max]} if autos else {})


def row_config(method: str, budget: int | str | None, args, max_new_tokens: int = 128) -> GenerationConfig:
    """One row's generation settings: a fixed k, or auto:P within --budget-min / --budget-max."""
    p = auto_p(budget)
    extra = {} if p is None else {"budget": "auto", "budget_p": p, "budget_min": args.budget_min,
                                  "budget_max": args.budget_max}
    return GenerationConfig(**{"method": method, "gamma": args.gamma, "draft_window": args.draft_window,
                               "max_new_tokens": max_new_tokens, "budget": budget, "sparse_config": args.config,
                               "seed": args.seed, **extra})


def row_name(method: str, budget: int | str | None) -> str:
    return method if budget is None else f"{method}@{budget}"


def budget_order(k: int | str | None) -> tuple:
    """Fixed k ascending, then auto:P by P (a sweep's budgets mix both)."""
    return (0, 0.0) if k is None else (1, float(k)) if auto_p(k) is None else (2, auto_p(k))
