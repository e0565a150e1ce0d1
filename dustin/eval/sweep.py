"""The rows of an accuracy sweep (`dustin eval tasks`, `dustin eval needles`): which (method, budget) pairs run
and the generation settings of each, declared once for both commands.

A sweep runs the lossless methods once (their greedy output does not depend on k) and every sparse method at each
fixed k of --budgets; an `auto:P` budget sizes k per sequence and step from Dustin's own score estimate
(dustin/selection/adaptive.py), so only the Dustin methods get those rows."""
from __future__ import annotations

from types import SimpleNamespace

from dustin.engine.config import DUSTIN_METHODS, FULL_METHODS, GenerationConfig
from dustin.engine.request import SamplingParams
from dustin.errors import InputError
from dustin.flags import auto_p, budget_list, check_sparse_config, method_list

LOSSLESS = FULL_METHODS  # same output as vanilla (greedy): run once, not per budget
HYBRID_FAMILY = DUSTIN_METHODS  # the methods that can size k themselves (auto:P)


def add_rows_arg(p) -> None:
    p.add_argument("--rows", default=None,
                   help="explicit rows instead of --methods x --budgets, e.g. vanilla,dustin@512,dustin@auto:0.9,"
                        "quest@512 (each sparse method at its own budgets)")


def parse_rows(text: str) -> list[tuple[str, int | str | None]]:
    """--rows: `method` for a lossless method, `method@k` or `method@auto:P` for a sparse one."""
    rows: list[tuple[str, int | str | None]] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        method, _, budget = item.partition("@")
        method_list(method)  # a known method, or one error line
        if (method in LOSSLESS) != (budget == ""):
            raise InputError(f"--rows: {item!r}: a lossless method takes no @budget, a sparse one needs one "
                             f"(e.g. dustin@512 or dustin@auto:0.9)")
        row = (method, budget_list("--rows", budget)[0] if budget else None)
        if row not in rows:
            rows.append(row)
    if not rows:
        raise InputError("--rows is empty")
    return rows


def sweep_rows(methods: list[str], budgets: list[int | str], args, max_new_tokens: int = 128
               ) -> tuple[list[tuple[str, int | str | None]], dict]:
    """(rows, settings to resume by): --rows as given, else each method once if lossless and at every budget
    if sparse; the lossless rows first (agreement is measured against them). Every row's settings are validated
    before any model loads. The settings hold the auto rows' k range only when there are auto rows, so that
    older result files still resume."""
    if getattr(args, "rows", None):
        rows = parse_rows(args.rows)
    else:
        autos = [k for k in budgets if auto_p(k) is not None]
        if autos and not any(m in HYBRID_FAMILY for m in methods):
            raise InputError(f"--budgets {autos[0]} sizes Dustin's selection: add dustin, dustin-t or dustin-d to "
                             f"--methods")
        rows = [(m, None) for m in methods if m in LOSSLESS] + [
            (m, k) for k in budgets for m in methods if m not in LOSSLESS and (auto_p(k) is None or m in HYBRID_FAMILY)]
    rows.sort(key=lambda r: r[1] is not None)  # stable: the lossless rows first
    autos = [k for m, k in rows if auto_p(k) is not None]
    check_sparse_config(args.config, [k for _, k in rows if k is not None and auto_p(k) is None]
                        + ([args.budget_max] if autos else []))
    row_params(max_new_tokens)
    for m, k in rows:
        row_config(m, k, args)
    return rows, ({"budget_range": [args.budget_min, args.budget_max], "budget_dense": args.budget_dense}
                  if autos else {})


def row_params(max_new_tokens: int):
    """Every row's sampling: greedy (rows compare token for token), `max_new_tokens` each (a bad count's message
    names --max-new-tokens)."""
    return SamplingParams.from_flags(SimpleNamespace(max_new_tokens=max_new_tokens), temperature=0)


def row_config(method: str, budget: int | str | None, args) -> GenerationConfig:
    """One row's generation settings: a fixed k, or auto:P within --budget-min / --budget-max (--budget-dense: rows
    too spread out for --budget-max verify against the whole cache)."""
    p = auto_p(budget)
    extra = {} if p is None else {"budget": "auto", "budget_p": p, "budget_min": args.budget_min,
                                  "budget_max": args.budget_max, "budget_dense": args.budget_dense}
    return GenerationConfig(**{"method": method, "gamma": args.gamma, "draft_window": args.draft_window,
                               "budget": budget, "sparse_config": args.config,
                               "seed": args.seed, **extra})


def row_name(method: str, budget: int | str | None) -> str:
    return method if budget is None else f"{method}@{budget}"


def budget_order(k: int | str | None) -> tuple:
    """Fixed k ascending, then auto:P by P (a sweep's budgets mix both)."""
    return (0, 0.0) if k is None else (1, float(k)) if auto_p(k) is None else (2, auto_p(k))
