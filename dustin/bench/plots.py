"""PNG plots of the benchmarks (matplotlib, imported lazily: it is an optional dependency)."""
from __future__ import annotations


def ctx_label(n: int) -> str:
    """8192 -> '8k'."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def attention_breakdown(res, path) -> bool:
    """`dustin bench attention`: per model, latency bars per setting (full vs sparse + estimation) and the
    estimation latency normalized by full attention. False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (redraw later with --plot-from the JSON)")
        return False
    models = list(dict.fromkeys(r["model"] for r in res["rows"]))
    fig, axes = plt.subplots(len(models), 2, figsize=(15, 4.5 * len(models)), squeeze=False)
    for ax_lat, ax_est, model in ((a[0], a[1], m) for a, m in zip(axes, models, strict=True)):
        rows = [r for r in res["rows"] if r["model"] == model]
        x = list(range(len(rows)))
        labels = [f"{ctx_label(r['context'])} x B{r['batch']}" for r in rows]
        w = 0.27
        ax_lat.bar([i - w for i in x], [r["full_us"] for r in rows], w, color="0.55", label="full cache")
        for off, kind, dark, light in ((0, "dustin", "#1f4e9c", "#8fb8ee"), (w, "quest", "#9c4e1f", "#eeb88f")):
            sparse = [r[f"{kind}_sparse_us"] for r in rows]
            est = [r["dustin_est_layer_us" if kind == "dustin" else "quest_est_us"] for r in rows]
            ax_lat.bar([i + off for i in x], sparse, w, color=dark, label=f"{kind}: sparse attention")
            ax_lat.bar([i + off for i in x], est, w, bottom=sparse, color=light, label=f"{kind}: estimation")
        for i, r in enumerate(rows):
            ax_lat.annotate(f"{r['speedup_dustin']:.1f}x", (i, r["dustin_layer_us"]), ha="center", va="bottom",
                            fontsize=8)
        ax_lat.set_yscale("log")  # bars start at 0: pin the bottom so the shortest bar still shows
        ax_lat.set_ylim(bottom=0.5 * min(min(r["full_us"], r["dustin_sparse_us"], r["quest_sparse_us"]) for r in rows))
        ax_lat.set_xticks(x, labels)
        ax_lat.set_ylabel("us per layer")
        ax_lat.set_title(f"{model}: verify self-attention, k {res['k']}, T {res['gamma'] + 1}")
        ax_lat.legend(fontsize=7)
        for j, (key, label) in enumerate((("dustin_est_layer", "Dustin-H (SRH, amortized)"),
                                          ("quest_est", "Quest-16"), ("naive_est_layer", "Naive (all heads)"))):
            ax_est.bar([i + (j - 1) * w for i in x], [r[f"{key}_pct_of_full"] / 100 for r in rows], w, label=label)
        ax_est.axhline(1.0, color="k", lw=0.8, ls="--", label="full attention (our split-K kernel)")
        ax_est.axhline(0.01, color="g", lw=0.8, ls=":", label="1% goal")
        ax_est.set_yscale("log")
        ax_est.set_xticks(x, labels)
        ax_est.set_ylabel("estimation latency / full attention")
        ax_est.set_title(f"{model}: normalized estimation latency")
        ax_est.legend(fontsize=7)
    fig.suptitle(f"{res['device']}{' (smoke: not real timings)' if res['smoke'] else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def e2e_throughput(out: dict, path: str) -> None:
    """tokens/s against context, one panel per (pair, batch), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    rows = [r for r in out["results"] if "skipped" not in r]
    panels = sorted({(r["target"], r["draft"], r["batch"]) for r in rows})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (t, d, B) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if (r["target"], r["draft"], r["batch"]) == (t, d, B)]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = sorted((r["context"], r["tokens_per_s"]) for r in mine if r["method"] == method)
            ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_title(f"{t} + {d}, batch {B}", fontsize=9)
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"decoding throughput, acceptance-controlled (TP {rows[0]['tp']}, {out.get('device', 'cpu')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def e2e_real(out: dict, path: str) -> None:
    """`dustin bench e2e --real`: tokens/s (top row) and % of the byte roofline (bottom row, when measured) against
    context, one panel per batch; a colour per method, a line style per prompt kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in out["results"] if "skipped" not in r]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return
    panels = [("tokens_per_s", "tokens/s")]
    if any("pct_of_byte_roofline" in r for r in rows):
        panels.append(("pct_of_byte_roofline", "% of byte roofline"))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    kinds = list(dict.fromkeys(r["prompts"] for r in rows))
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(panels), len(batches), figsize=(4.6 * len(batches), 3.6 * len(panels)),
                             squeeze=False)
    for ax_row, (key, label) in zip(axes, panels, strict=True):
        for ax, B in zip(ax_row, batches, strict=True):
            for i, method in enumerate(methods):
                for j, kind in enumerate(kinds):
                    pts = sorted((r["context"], r[key]) for r in rows
                                 if (r["batch"], r["method"], r["prompts"]) == (B, method, kind) and key in r)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                                ls=("-", "--", ":", "-.")[j % 4], label=f"{method}, {kind}")
            if key == "pct_of_byte_roofline":
                ax.axhline(100, color="k", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [ctx_label(c) for c in contexts])
            ax.minorticks_off()
            ax.set_title(f"batch {B}", fontsize=9)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    models = out.get("models", {})
    fig.suptitle(f"decoding throughput, real weights, greedy verification\n{models.get('target')} + "
                 f"{models.get('draft')} ({out.get('device', 'cpu')}, {out.get('date', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
