"""PNG figures of the profile: SRH heatmaps and the paper's Figs. 2-4 drawn on our pair."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def srh_heatmap(result: dict, path: Path, title: str) -> None:
    """Layer x head heatmap of the SRH scores, the kept heads outlined."""
    plt = _plt()
    scores = result["scores"]
    n_layers, n_heads = len(scores), len(scores[0])
    fig, ax = plt.subplots(figsize=(0.45 * n_heads + 2.5, 0.28 * n_layers + 1.5))
    im = ax.imshow(scores, aspect="auto", cmap="viridis", origin="lower")
    for layer, heads in result["top_heads"].items():
        for h in heads:
            ax.add_patch(plt.Rectangle((h - 0.5, int(layer) - 0.5), 1, 1, fill=False, edgecolor="red", lw=1))
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads))
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="mean attention mass on the needle")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fig_target_history(obj, deltas, budgets, path: Path) -> None:
    """Fig. 2: ARR of the top-k of the target's SRH attention δ steps back vs Eq. 3's oracle, over k."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, [obj.arr_topk(obj.oracle, k) for k in budgets], "k--", label="oracle (Eq. 3)")
    for i, d in enumerate(deltas):
        ax.plot(budgets, [obj.arr_topk(obj.t["hist_delta"][:, i].float(), k) for k in budgets], marker="o",
                ms=3, label=f"target history, δ = {d}")
    _finish(fig, ax, path, "Target historical attention vs oracle (SRH ARR, w = 4)")


def fig_draft_lookahead(obj, budgets, path: Path) -> None:
    """Fig. 3: ARR of the top-k of the draft's lookahead attention (all its SRHs) vs the oracle, over k."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, [obj.arr_topk(obj.oracle, k) for k in budgets], "k--", label="oracle (Eq. 3)")
    draft = obj.rows("draft", range(obj.n_draft))
    hist = obj.t["hist_delta"][:, 0].float()
    ax.plot(budgets, [obj.arr_topk(draft, k) for k in budgets], marker="o", ms=3, label="draft lookahead (Γ queries)")
    ax.plot(budgets, [obj.arr_topk(hist, k) for k in budgets], marker="s", ms=3, label="target history (δ = 1)")
    _finish(fig, ax, path, "Draft lookahead attention vs oracle (SRH ARR, w = 4)")


def fig_layerwise(obj, share: float, path: Path, budget: int = 256) -> dict:
    """Fig. 4: per target layer l, ARR against layer l's own Ā of its history, of the draft layer at the same
    relative depth (lookahead), and of both (Eq. 6 with the tuned m share), at one budget."""
    plt = _plt()
    free = budget - obj.sinks - obj.window
    m = round(share * free)
    rows = {"target": [], "draft": [], "hybrid": []}
    for layer in range(obj.n_target):
        d = round(layer * (obj.n_draft - 1) / max(obj.n_target - 1, 1))
        oracle = obj.t["oracle"][:, layer].float()
        rows["target"].append(obj.arr([layer], [], budget, 0, oracle))
        rows["draft"].append(obj.arr([], [d], budget, free, oracle))
        rows["hybrid"].append(obj.arr([layer], [d], budget, m, oracle))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, vals in rows.items():
        ax.plot(range(obj.n_target), vals, marker="o", ms=3, label=name)
    ax.set_xlabel("target layer (draft layer at the same relative depth)")
    ax.set_ylabel(f"ARR vs the layer's own oracle, k = {budget}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Layer-wise: target history vs draft lookahead vs hybrid (m share {share:.2f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"budget": budget, "m": m, **rows}


def _finish(fig, ax, path: Path, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget k")
    ax.set_ylabel("ARR over the SRHs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
