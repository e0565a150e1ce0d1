"""What each S_draft layer buys and costs: ARR against the number of draft score layers, from stored traces.

For a profile folder made by `dustin profile trace` (trace/profile = validation, trace/heldout = held-out steps),
a target score layer and phase 2's order of draft layers, row n is the config with the first n draft layers and
m tuned by phase 3 on the validation steps (`dustin.profiling.search.draft_layer_curve`: the config a search
stopped after n layers would write). Each row gets its phase-2 objective and ARR over the SRHs at each k, on
both splits, and the keys its draft score layers read per decode step (`dustin.bench.roofline.score_key_bytes`,
at --batch x --context, bf16). Configs given with --config are also evaluated whole (every policy, both head
sets, as `dustin profile search` reports them) on the same steps. No model is loaded: the shapes come from the
configs' "models" block. CPU, a minute or two:

    PYTHONPATH=. python3 scripts/sdraft_layers.py --prof PROFILE_DIR --target-layer 20 \\
        --order 7,6,11,20,1,13,4,3,2,5,15 --config shipped=dustin/configs/X.json --config candidate=Y.json \\
        --json-out layers.json --plot-out layers.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace


def _args(block: dict) -> SimpleNamespace:
    return SimpleNamespace(n_layers=block["n_layers"], n_heads=block["n_heads"], n_kv_heads=block["n_kv_heads"],
                           head_dim=block["head_dim"])


def _config_heads(path: Path, srh_t: dict, srh_d: dict) -> dict:
    """A config's layers, heads and m; its heads must be the traced SRHs (the traces hold no other rows)."""
    cfg = json.loads(path.read_text())
    for role, srh in (("target", srh_t), ("draft", srh_d)):
        for e in cfg[role]:
            if sorted(e["heads"]) != sorted(srh[e["layer"]]):
                raise SystemExit(f"{path}: {role} layer {e['layer']} heads {e['heads']} are not the traced SRHs "
                                 f"{srh[e['layer']]}")
    return cfg


def main() -> None:
    from dustin.bench.roofline import score_key_bytes
    from dustin.profiling.search import ARRObjective, draft_layer_curve, evaluate
    from dustin.profiling.srh import load_srh
    from dustin.profiling.trace import load_traces
    from dustin.selection.config import ScoreHeads

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prof", type=Path, required=True, help="profile folder: trace/{profile,heldout}, srh_*.json")
    p.add_argument("--target-layer", type=int, required=True)
    p.add_argument("--order", required=True, help="draft layers in phase 2's order of addition")
    p.add_argument("--config", action="append", default=[], help="NAME=PATH of a config to evaluate whole")
    p.add_argument("--shapes", type=Path, default=None, help="a config JSON whose 'models' block gives the shapes "
                                                             "(default: the first --config)")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--budgets", default="128,256,512", help="k of the curve")
    p.add_argument("--config-budgets", default="128,256,512,576", help="k of the whole-config tables")
    p.add_argument("--optuna-trials", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--json-out", type=Path, required=True)
    p.add_argument("--plot-out", type=Path, default=None)
    a = p.parse_args()

    order = [int(x) for x in a.order.split(",")]
    budgets = tuple(int(x) for x in a.budgets.split(","))
    config_budgets = tuple(int(x) for x in a.config_budgets.split(","))
    configs = dict(c.split("=", 1) for c in a.config)
    srh_t, srh_d = load_srh(a.prof / "srh_target.json"), load_srh(a.prof / "srh_draft.json")
    shapes_path = a.shapes or (Path(next(iter(configs.values()))) if configs else None)
    if shapes_path is None:
        raise SystemExit("--shapes or a --config is needed for the models' shapes")
    models = json.loads(Path(shapes_path).read_text())["models"]
    t_args, d_args = _args(models["target"]), _args(models["draft"])

    def key_bytes(layers) -> int:  # the draft score layers' keys read per step, bf16
        return score_key_bytes([ScoreHeads(d, tuple(srh_d[d])) for d in layers], d_args, a.batch, a.context, 2)

    # a verify position read per sequence and step: K and V of every target layer, bf16
    position_bytes = 2 * t_args.n_layers * t_args.n_kv_heads * t_args.head_dim * 2 * a.batch
    val = ARRObjective(load_traces(sorted((a.prof / "trace" / "profile").glob("*.safetensors"))))
    held_paths = sorted((a.prof / "trace" / "heldout").glob("*.safetensors"))
    held = ARRObjective(load_traces(held_paths)) if held_paths else None
    curve = draft_layer_curve(val, held, a.target_layer, order, a.budget, optuna_trials=a.optuna_trials,
                              seed=a.seed, budgets=budgets)
    group = d_args.n_heads // d_args.n_kv_heads
    for row in curve:  # the added layer's KV heads: the unit of key reads (heads on one KV head share its read)
        row["layer_kv_heads"] = len({h // group for h in srh_d[row["draft_layers"][-1]]}) if row["n"] else 0
        row["draft_key_bytes_per_step"] = key_bytes(row["draft_layers"])
    report = {"prof": str(a.prof), "target_layer": a.target_layer, "order": order, "budget": a.budget,
              "optuna_trials": a.optuna_trials, "seed": a.seed,
              "validation_steps": int(val.L.numel()), "heldout_steps": int(held.L.numel()) if held else 0,
              "bytes_at": {"batch": a.batch, "context": a.context, "dtype": "bf16",
                           "per_draft_layer_kv_head": a.batch * a.context * d_args.head_dim * 2,
                           "per_verify_position": position_bytes},
              "curve": curve, "configs": {}}
    for name, path in configs.items():
        cfg = _config_heads(Path(path), srh_t, srh_d)
        t_layers, d_layers = [e["layer"] for e in cfg["target"]], [e["layer"] for e in cfg["draft"]]
        share = cfg["draft_topm"] / (cfg["budget"] - cfg["sinks"] - cfg["window"])
        report["configs"][name] = {
            "path": path, "target_layers": t_layers, "draft_layers": d_layers, "draft_topm": cfg["draft_topm"],
            "draft_key_bytes_per_step": key_bytes(d_layers),
            "validation": evaluate(val, t_layers, d_layers, share, config_budgets),
            "heldout": evaluate(held, t_layers, d_layers, share, config_budgets) if held else None}
    a.json_out.write_text(json.dumps(report, indent=1))
    _table(report)
    if a.plot_out:
        _plot(report, a.plot_out)


def _table(report: dict) -> None:
    ks = list(report["curve"][0]["validation"]["arr"])
    print(f"{'n':>2} {'layer':>5} {'kv':>2} {'m':>4} {'GB/step':>7} | validation ARR k={','.join(ks)} | "
          f"held-out ARR | objective val / held")
    for r in report["curve"]:
        held = r.get("heldout")
        print(f"{r['n']:>2} {r['draft_layers'][-1] if r['n'] else '-':>5} {r['layer_kv_heads']:>2} "
              f"{r['draft_topm']:>4} {r['draft_key_bytes_per_step'] / 1e9:7.3f} | "
              + " ".join(f"{v:.4f}" for v in r["validation"]["arr"].values()) + " | "
              + (" ".join(f"{v:.4f}" for v in held["arr"].values()) if held else "-") + " | "
              + f"{r['validation']['objective']:.4f} / " + (f"{held['objective']:.4f}" if held else "-"))


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = report["curve"]
    n = [r["n"] for r in curve]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    for i, k in enumerate(curve[0]["validation"]["arr"]):
        color = f"C{i}"
        ax.plot(n, [r["validation"]["arr"][k] for r in curve], "--", color=color, marker="o", ms=3,
                label=f"k = {k}, validation")
        if "heldout" in curve[0]:
            ax.plot(n, [r["heldout"]["arr"][k] for r in curve], "-", color=color, marker="s", ms=3,
                    label=f"k = {k}, held-out")
    ax.set_xticks(n)
    ax.set_xticklabels(["0"] + [f"{r['n']}\n({r['draft_layers'][-1]})" for r in curve[1:]], fontsize=7)
    ax.set_xlabel("draft score layers (layer added)", fontsize=8)
    ax.set_ylabel("ARR over the SRHs", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(f"target layer {report['target_layer']}, m from phase 3", fontsize=9)
    at = report["bytes_at"]
    bx.bar(n, [r["draft_key_bytes_per_step"] / 1e9 for r in curve], color="gray")
    bx.set_xticks(n)
    bx.set_xlabel("draft score layers", fontsize=8)
    bx.set_ylabel(f"S_draft keys read per step, GB ({at['batch']} x {at['context'] // 1024}k)", fontsize=8)
    bx.grid(alpha=0.3, axis="y")
    bx.set_title("bytes (roofline model)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
