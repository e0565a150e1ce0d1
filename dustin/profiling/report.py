"""`dustin profile search`: Algorithm 1 on the profile split, the tuned config, and the ARR report on the
held-out split (never seen by the search), with the paper's Figs. 2-4 drawn on this pair."""
from __future__ import annotations

import json
import time
from pathlib import Path

from dustin.models.fetch import resolve_model_path
from dustin.profiling.plots import fig_draft_lookahead, fig_layerwise, fig_target_history
from dustin.profiling.search import ARRObjective, evaluate, search
from dustin.profiling.srh import load_srh
from dustin.profiling.trace import DELTAS, load_traces
from dustin.selection.config import ScoreHeads, SparseConfig

FIG_BUDGETS = (64, 128, 256, 384, 512, 768, 1024)


def run_search(engine, args, out: Path, costs: dict, progress, console) -> dict:
    device = engine.pair.device
    t0 = time.perf_counter()
    val = ARRObjective(load_traces(sorted((out / "trace" / "profile").glob("*.safetensors")), device))
    held_paths = sorted((out / "trace" / "heldout").glob("*.safetensors"))
    held = ARRObjective(load_traces(held_paths, device)) if held_paths else None
    load_s = time.perf_counter() - t0
    ms = [int(x) for x in args.search_m.split(",")]
    kw = {} if args.min_gain is None else {"min_gain": args.min_gain}
    log = search(val, args.budget, ms, args.optuna_trials, args.seed, progress, **kw)
    srh_t, srh_d = load_srh(out / "srh_target.json"), load_srh(out / "srh_draft.json")
    t_layer, d_layers, m = log["target_layer"], log["draft_layers"], log["draft_topm"]
    cfg = SparseConfig(target=(ScoreHeads(t_layer, tuple(srh_t[t_layer])),),
                       draft=tuple(ScoreHeads(d, tuple(srh_d[d])) for d in d_layers),
                       budget=args.budget, draft_topm=m)
    free = cfg.free_budget
    share = m / free
    t_id, d_id = engine.pair.identities()
    costs["search_s"] = round(load_s + sum(p["seconds"] for p in log["phases"].values()), 1)
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()] \
        if (out / "runs.jsonl").is_file() else []
    # the model folders' names ("default" names the fetched default pair's folders, which is what the file must say)
    t_name, d_name = (resolve_model_path(str(spec), role).name
                      for spec, role in ((args.target, "target"), (args.draft, "draft")))
    config = {**cfg.to_json(), "models": {"target": {"name": t_name, **t_id}, "draft": {"name": d_name, **d_id}},
              "profile": {"arr_srh_validation": log["phases"]["3"]["arr"], "validation_steps": int(val.L.numel()),
                          "date": time.strftime("%Y-%m-%d"), "device": str(device), "costs_s": costs,
                          "runs": runs}}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    report = {"search": log, "config": config, "costs_s": costs,
              "validation": evaluate(val, [t_layer], d_layers, share),
              "heldout": evaluate(held, [t_layer], d_layers, share) if held else None}
    # Figs. 2-4 on the held-out steps when there are any (else the validation ones)
    obj = held or val
    fig_target_history(obj, DELTAS, FIG_BUDGETS, out / "fig2_target_history.png")
    fig_draft_lookahead(obj, FIG_BUDGETS, out / "fig3_draft_lookahead.png")
    report["layerwise"] = fig_layerwise(obj, share, out / "fig4_layerwise.png", budget=256)
    (out / "search.json").write_text(json.dumps(report, indent=1))
    (out / "costs.json").write_text(json.dumps(costs, indent=1))
    _print(console, report)
    return report


def _print(console, report) -> None:
    from rich.table import Table

    log = report["search"]
    console.print(f"phase 1: target layer {log['phases']['1']['target_layer']} (ARR {log['phases']['1']['arr']:.4f}); "
                  f"phase 2: draft layers {log['phases']['2']['draft_layers']} (ARR {log['phases']['2']['arr']:.4f}); "
                  f"phase 3: m = {log['phases']['3']['draft_topm']} (ARR {log['phases']['3']['arr']:.4f}) at "
                  f"k = {log['budget']}")
    for split in ("validation", "heldout"):
        if not report.get(split):
            continue
        t = Table(title=f"ARR over the SRHs, {split} steps")
        names = list(next(iter(report[split].values()))["srh"])
        t.add_column("k")
        for n in names:
            t.add_column(n, justify="right")
        for k, row in report[split].items():
            t.add_row(k, *["-" if row["srh"][n] is None else f"{row['srh'][n]:.4f}" for n in names])
        console.print(t)

