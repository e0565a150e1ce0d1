"""`dustin eval tasks`: long-context task accuracy per decoding method and budget (paper Tables 1, 3 and 14).

Every method answers the same samples (same prompts, same seed) greedily; the lossless methods once, the sparse
ones at each budget k. Per sample the JSON keeps the prediction, the references, the task's score and extra
metrics, and the generated ids; speculative rows also keep τ and the agreement with full verification (the
share of the lossless output a sparse method reproduces before its first differing token). Results are
appended per batch of samples and a rerun with the same --json-out skips what is there (resumable).
The summary is a markdown table in the shape of the paper's Table 1 / 14 (rows: method@k, columns: tasks and
their average, one table per context; "oracle-best" is the per-task best of dustin-t / dustin-d / dustin, the
paper's "Oracle (Best)") and a PNG of the average score against k per method.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dustin.engine.config import METHODS
from dustin.errors import InputError
from dustin.eval.inputs import common_prefix
from dustin.eval.results import load_results, save_results
from dustin.eval.stats import average_interval, mean_interval, paired_difference_interval
from dustin.eval.sweep import (
    HYBRID_FAMILY,
    LOSSLESS,
    add_rows_arg,
    budget_order,
    row_config,
    row_name,
    row_params,
    sweep_rows,
)
from dustin.flags import (
    add_model_args,
    add_sparse_args,
    add_speculation_args,
    auto_p,
    budget_list,
    int_list,
    method_list,
)
from dustin.tasks.catalog import build_samples, get_tasks

if TYPE_CHECKING:
    from dustin.engine.offline.prefill import PrefillCache

_SETTINGS = ("target", "draft", "dtype", "gamma", "draft_window", "seed", "config")


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--tasks", default="ruler", help="task names, or ruler / code / longbench / all")
    p.add_argument("--contexts", default="4096", help="prompt lengths in tokens (capped by the model)")
    p.add_argument("--samples", type=int, default=3, help="samples per task and context")
    p.add_argument("--batch-size", type=int, default=16,
                   help="sequences per generation (samples of all tasks at one context are batched together)")
    p.add_argument("--methods", default="vanilla,dustin")
    p.add_argument("--seed", type=int, default=0, help="sample generation")
    add_speculation_args(p)
    add_sparse_args(p, sweep="128,256,512")
    p.add_argument("--longbench-dir", default=None, help="folder of LongBench's <task>.jsonl files")
    add_rows_arg(p)
    p.add_argument("--json-out", default=None, help="results file; rerunning with it resumes")
    p.add_argument("--report-only", action="store_true",
                   help="only write the table and plot of what --json-out holds (runs nothing)")


def plan(args) -> dict:
    """Every flag checked before any model loads."""
    import os

    if args.longbench_dir:
        os.environ["DUSTIN_LONGBENCH_DIR"] = str(args.longbench_dir)
    tasks = get_tasks(args.tasks)
    if not args.report_only:
        for task in tasks:  # a missing LongBench file: one line now, not after the model loads
            task.check_data()
    contexts, budgets = int_list("--contexts", args.contexts, 1), budget_list("--budgets", args.budgets)
    methods = method_list(args.methods)
    if args.samples < 1:
        raise InputError(f"--samples must be >= 1, got {args.samples}")
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    rows, extra = sweep_rows(methods, budgets, args)
    return {"tasks": tasks, "contexts": contexts, "rows": rows,
            "settings": {**{k: getattr(args, k) for k in _SETTINGS}, **extra}}


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dustin.engine.engine import Engine
    from dustin.parallel.tp import is_main_process

    p = plan(args)
    results = load_results(args.json_out, p["settings"], "tasks")
    done = {_key(r) for r in results["rows"]}
    by_name = {t.name: t for t in p["tasks"]}
    def missing(name, ctx, i):
        return any((name, ctx, m, k, i) not in done for m, k in p["rows"])
    pending = {c: [t for t in p["tasks"] if any(missing(t.name, c, i) for i in range(args.samples))]
               for c in p["contexts"]}
    if args.report_only and not args.json_out:
        raise InputError("--report-only needs --json-out")
    if any(pending.values()) and not args.report_only:
        methods = {m for m, _ in p["rows"]}
        speculative = any(METHODS[m].speculative for m in methods)
        engine = Engine.from_pretrained(args.target, args.draft if speculative else None, device=args.device,
                                        dtype=args.dtype, attention=args.attention,
                                    rope_scaling=args.rope_scaling)
        if engine.pair.tokenizer is None:
            raise InputError("the target model folder has no tokenizer: tasks are text")
        limit = engine.pair.max_context(speculative)
        main = is_main_process()
        console = Console(stderr=True, quiet=not main)
        console.print(f"dustin eval tasks: {engine.pair.device}, {engine.pair.dtype_name}")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        from dustin.engine.kv_manager import cache_capacity, positions_needed
        from dustin.engine.offline.prefill import PrefillCache

        shared = PrefillCache()  # each batch of samples is prefilled once for every method
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("tasks", total=None)
            for ctx, tasks in pending.items():
                if not tasks:
                    continue
                length = min(ctx, limit - positions_needed(0, 0, args.gamma))  # a sample's prompt and answer
                # a batch holds its session's KV caches and the shared prefill's copy: refuse now what would run
                # out of memory only at the first speculative row, after the samples and a whole prefill
                gamma = args.gamma if speculative else 0
                capacity = cache_capacity([length], [max(t.max_new_tokens for t in tasks)], gamma)
                engine.pair.kv_fit(speculative).require(min(args.batch_size, len(tasks) * args.samples), capacity,
                                                        copies=2, advice="lower --batch-size")
                progress.update(bar, description=f"building {len(tasks)} task(s) at {ctx}")
                samples = [s for s in build_samples(tasks, engine.pair.tokenizer, length, args.samples, args.seed)
                           if missing(s.task, ctx, s.index)]
                # every task's samples of one context share a batch: one prefill serves every method (the
                # prompt caches are reused) and a GPU decodes the whole batch in the time of one sequence
                chunks = [samples[i:i + args.batch_size] for i in range(0, len(samples), args.batch_size)]
                work = [(chunk, m, k) for chunk in chunks for m, k in p["rows"]]
                work = [(w, m, k) for chunk, m, k in work
                        if (w := [s for s in chunk if (s.task, ctx, m, k, s.index) not in done])]
                progress.update(bar, total=(progress.tasks[0].total or 0) + len(work))
                for batch, method, budget in work:
                    progress.update(bar, description=f"{ctx} {row_name(method, budget)} x {len(batch)}")
                    results["rows"] += _evaluate(engine, by_name, batch, ctx, method, budget, args,
                                                 results["rows"], shared)
                    if main:
                        save_results(args.json_out, results)
                    progress.advance(bar)
                    if not console.is_terminal:  # a log file gets one line per batch instead of a live bar
                        t = progress.tasks[0]
                        console.print(f"[{t.completed:.0f}/{t.total:.0f}] {ctx} {row_name(method, budget)} x "
                                      f"{len(batch)} ({t.elapsed:.0f} s)", highlight=False)
    summary = summarize(results["rows"], p)
    if is_main_process():
        md = markdown(summary, p)
        print(md)  # plain markdown (no terminal wrapping): paste-able
        if args.json_out:
            Path(args.json_out).with_suffix(".md").write_text(md)
            Path(args.json_out).with_suffix(".summary.json").write_text(json.dumps(summary_records(summary, p),
                                                                                    indent=1))
            plot(summary, p, Path(args.json_out).with_suffix(".png"))
    return 0


def _key(r: dict) -> tuple:
    return r["task"], r["context"], r["method"], r["budget"], r["index"]


def _evaluate(engine, tasks: dict, samples, ctx: int, method, budget, args, rows,
              shared: PrefillCache) -> list[dict]:
    """One greedy generation over a batch of samples of any tasks, each sequence stopping at its own task's
    answer length. Rows are keyed by the requested context `ctx` (a sample
    may be shorter: the model's own limit caps it)."""
    cfg = row_config(method, budget, args)
    t0 = time.perf_counter()
    r = engine.generate([s.prompt_ids for s in samples], cfg, row_params(1), prefill_cache=shared,
                        limits=[s.max_new_tokens for s in samples])
    seconds = time.perf_counter() - t0
    tau = r.tau if cfg.spec.speculative else None
    reference = {(x["task"], x["context"], x["index"]): x["token_ids"] for x in rows if x["method"] in LOSSLESS}
    out = []
    for s, seq in zip(samples, r.sequences, strict=False):
        task = tasks[s.task]
        ids = seq.token_ids
        text = seq.text or ""
        extra = task.metrics(text, s.references) if hasattr(task, "metrics") else {}
        # a classification task scores against its sample's label set (LongBench's trec)
        kw = {"all_classes": s.meta["all_classes"]} if s.meta.get("all_classes") is not None else {}
        ref = reference.get((s.task, ctx, s.index))
        agree = None if ref is None or method in LOSSLESS else common_prefix(ids, ref) / max(len(ref), 1)
        out.append({"task": s.task, "context": ctx, "method": method, "budget": budget, "index": s.index,
                    "score": task.score(text, s.references, **kw), "metrics": extra, "prediction": text,
                    "references": s.references, "token_ids": ids, "prompt_tokens": len(s.prompt_ids),
                    "tau": tau, "agreement": agree, "seconds": seconds / len(samples), "meta": s.meta,
                    "sparse_config": r.sparse_config and r.sparse_config.get("source"),
                    # the batch's k per (sequence, step) under auto:P: mean, p50, p90, p99 and the step count
                    "budget_k": r.budget_k})
    return out


def _budgets(rows) -> list:
    return sorted({k for _, k in rows if k is not None}, key=budget_order)


def summarize(rows: list[dict], p: dict) -> dict:
    """(task, context, method, budget) -> {score, n, ci, tau, agreement, k, by_index}: means over the samples,
    with the sample count, a 95% interval of the score (dustin/eval/stats.py: Wilson for 0/1 scores, else
    bootstrap) and the mean k verified against: what the policy measured where it reports it (auto:P: over the
    (sequence, step) pairs of the batches that ran the samples; the sampled-tail rows: the positions read per
    (sequence, step, layer, KV head)), else the budget."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["task"], r["context"], r["method"], r["budget"]), []).append(r)

    def mean(xs):
        return None if not xs else sum(xs) / len(xs)

    def mean_k(g, budget):
        ks = [(x["budget_k"]["mean"], x["budget_k"]["samples"]) for x in g
              if x.get("budget_k") and x["budget_k"]["samples"]]
        if ks:
            return sum(k * n for k, n in ks) / sum(n for _, n in ks)
        return budget if budget is None or auto_p(budget) is None else None

    out = {key: {"score": mean([x["score"] for x in g]), "n": len(g),
                 "ci": list(mean_interval([x["score"] for x in g])),
                 "scores": [x["score"] for x in g], "by_index": {x["index"]: x["score"] for x in g},
                 "tau": mean([x["tau"] for x in g if x["tau"] is not None]),
                 "agreement": mean([x["agreement"] for x in g if x["agreement"] is not None]),
                 "k": mean_k(g, key[3])}
           for key, g in groups.items()}
    for t in p["tasks"]:  # the paper's Oracle (Best): per task, the best of the three Dustin variants
        for c in p["contexts"]:
            for k in _budgets(p["rows"]):
                cand = [out[(t.name, c, m, k)]["score"] for m in HYBRID_FAMILY if (t.name, c, m, k) in out]
                if len(cand) == len(HYBRID_FAMILY):
                    out[(t.name, c, "oracle-best", k)] = {"score": max(cand), "n": None, "ci": None,
                                                          "scores": None, "by_index": None, "tau": None,
                                                          "agreement": None, "k": None}
    return out


def row_average(summary: dict, names: list[str], c: int, m: str, k) -> dict | None:
    """One row of a context's table over every task: the average score with its 95% interval, the mean k, and
    the paired difference to the lossless reference on the same samples with its interval (None where a task
    is missing)."""
    cells = [summary.get((n, c, m, k)) for n in names]
    if any(x is None for x in cells):
        return None
    out = {"score": sum(x["score"] for x in cells) / len(cells), "ci": None, "k": None, "delta": None,
           "delta_ci": None}
    if all(x["scores"] for x in cells):
        out["ci"] = list(average_interval([x["scores"] for x in cells]))
    ks = [x["k"] for x in cells]
    if all(x is not None for x in ks):
        out["k"] = sum(ks) / len(ks)
    ref = next((r for r in LOSSLESS if all((n, c, r, None) in summary for n in names)), None)
    if ref is not None and m not in LOSSLESS and all(x["by_index"] for x in cells):
        pairs = []
        for n, x in zip(names, cells, strict=True):
            base = summary[(n, c, ref, None)]["by_index"]
            common = sorted(set(x["by_index"]) & set(base))
            pairs.append(([x["by_index"][i] for i in common], [base[i] for i in common]))
        if all(a for a, _ in pairs):
            out["delta"] = sum(sum(a) / len(a) - sum(b) / len(b) for a, b in pairs) / len(pairs)
            out["delta_ci"] = list(paired_difference_interval(pairs))
    return out


def _table_rows(summary: dict, p: dict) -> list[tuple[str, int | str | None]]:
    rows = list(p["rows"])
    rows += [("oracle-best", k) for k in _budgets(rows)
             if any(key[2] == "oracle-best" and key[3] == k for key in summary)]
    return rows


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def markdown(summary: dict, p: dict) -> str:
    names = [t.name for t in p["tasks"]]
    lines = []
    for c in p["contexts"]:
        ns = sorted({x["n"] for key, x in summary.items() if key[1] == c and x["n"]})
        n_text = "/".join(map(str, ns)) or "-"
        lines += [f"\n### context {c} (score x 100 with its 95% interval, n = {n_text} samples per task; Δ: the "
                  "paired difference to the lossless row on the same samples; mean k verified against; τ and "
                  "agreement with full verification for speculative rows)\n",
                  "| method | " + " | ".join(names) + " | avg [95% CI] | Δ [95% CI] | mean k | τ | agreement |",
                  "|---" * (len(names) + 6) + "|"]
        for m, k in _table_rows(summary, p):
            cells = [summary.get((n, c, m, k)) for n in names]
            if all(x is None for x in cells):  # not run (e.g. a partial run's report)
                continue
            row = row_average(summary, names, c, m, k)
            avg = delta = mean_k = "-"
            if row is not None:
                avg = _pct(row["score"]) + ("" if not row["ci"] else f" [{_pct(row['ci'][0])}, {_pct(row['ci'][1])}]")
                if row["delta"] is not None:
                    lo, hi = row["delta_ci"]
                    delta = f"{100 * row['delta']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
                mean_k = "-" if row["k"] is None else f"{row['k']:.0f}"
            taus = [x["tau"] for x in cells if x is not None and x["tau"] is not None]
            agree = [x["agreement"] for x in cells if x is not None and x["agreement"] is not None]
            tau = f"{sum(taus) / len(taus):.2f}" if taus else "-"
            agreement = f"{100 * sum(agree) / len(agree):.0f}%" if agree else "-"
            score_cells = ["-" if x is None else _pct(x["score"]) + (
                "" if not x["ci"] else f" [{_pct(x['ci'][0], 0)}, {_pct(x['ci'][1], 0)}]") for x in cells]
            lines.append(f"| {row_name(m, k)} | " + " | ".join(score_cells)
                         + f" | {avg} | {delta} | {mean_k} | {tau} | {agreement} |")
        lines += _task_deltas(summary, p, c, names)
    return "\n".join(lines) + "\n"


def _task_deltas(summary: dict, p: dict, c: int, names: list[str]) -> list[str]:
    """Each task's own paired difference to the lossless row with its interval: which tasks carry a loss."""
    rows = [(m, k) for m, k in _table_rows(summary, p) if m not in LOSSLESS]
    cells = {(m, k): [row_average(summary, [n], c, m, k) for n in names] for m, k in rows}
    rows = [r for r in rows if any(x is not None and x["delta"] is not None for x in cells[r])]
    if not rows:
        return []
    out = [f"\nPer task at {c}: Δ vs the lossless row on the same samples [95% CI]\n",
           "| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for m, k in rows:
        out.append(f"| {row_name(m, k)} | " + " | ".join(
            "-" if x is None or x["delta"] is None else
            f"{100 * x['delta']:+.1f} [{100 * x['delta_ci'][0]:+.1f}, {100 * x['delta_ci'][1]:+.1f}]"
            for x in cells[(m, k)]) + " |")
    return out


def summary_records(summary: dict, p: dict) -> list[dict]:
    """The `.summary.json` beside --json-out: one record per task and row, then one "avg" record per row."""
    out = [{"task": t, "context": c, "method": m, "budget": k, "score": x["score"], "n": x["n"], "ci95": x["ci"],
            "mean_k": x["k"], "tau": x["tau"], "agreement": x["agreement"]}
           for (t, c, m, k), x in summary.items()]
    names = [t.name for t in p["tasks"]]
    for c in p["contexts"]:
        for m, k in _table_rows(summary, p):
            row = row_average(summary, names, c, m, k)
            if row is not None:
                out.append({"task": "avg", "context": c, "method": m, "budget": k, "score": row["score"],
                            "ci95": row["ci"], "mean_k": row["k"], "delta": row["delta"],
                            "delta_ci95": row["delta_ci"]})
    return out


def plot(summary: dict, p: dict, path: Path) -> None:
    """Average score over the tasks against the mean k verified against, one panel per context: a line per
    sparse method over its fixed budgets, the auto:P rows of each Dustin method as their own line (one point
    per P, at the mean k it used), the lossless rows as flat lines with their 95% band. Points up and to the
    left are better: the upper-left envelope is the accuracy-vs-bytes Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [t.name for t in p["tasks"]]
    rows = _table_rows(summary, p)
    if not _budgets(rows):  # lossless methods only: no budget axis to draw
        return
    fig, axes = plt.subplots(1, len(p["contexts"]), figsize=(5.5 * len(p["contexts"]), 4.2), squeeze=False)
    for ax, c in zip(axes[0], p["contexts"], strict=False):
        for m in dict.fromkeys(m for m, _ in rows):
            if m in LOSSLESS:
                row = row_average(summary, names, c, m, None)
                if row is not None:
                    line = ax.axhline(100 * row["score"], ls="--", lw=1, label=m)
                    if row["ci"]:
                        ax.axhspan(100 * row["ci"][0], 100 * row["ci"][1], color=line.get_color(), alpha=0.08)
                continue
            for auto in (False, True):
                pts = sorted((r["k"], 100 * r["score"], k) for k in _budgets(rows) if (auto_p(k) is not None) == auto
                             and (r := row_average(summary, names, c, m, k)) is not None and r["k"] is not None)
                if pts:
                    ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], ":" if auto else "-",
                            marker="s" if auto else "o", ms=4, label=f"{m} auto:P" if auto else m)
                    for x, y, k in pts if auto else ():
                        ax.annotate(f"P={auto_p(k):g}", (x, y), textcoords="offset points", xytext=(4, -10),
                                    fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("mean KV budget k (positions verified against)")
        ax.set_ylabel("average score")
        ax.set_title(f"context {c}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
