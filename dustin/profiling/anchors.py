"""Which target layers should anchor `dustin-anchor` (selection/anchors.py): a check on teacher-forced texts.

Kascade (arXiv 2512.16391) picks its anchor layers offline by how well one layer's top-k serves the layers after
it. Here, at the steps `dustin profile trace` samples from a text (trace.py: the verify window of step n sits at
L_n .. L_n + 3), one prefill records every target layer's per-head window attention on the context j < L_n, and

    R[a, l] = mean over steps and over layer l's query heads of the share of the head's context attention that
              falls in the set anchor layer a picks for the head's KV head (granularity "kv") or layer ("layer")

for a <= l: R[l, l] is the layer's own set (the ladder's oracle-kv / oracle-layer), R[a, l] its reuse. Eq. 2's
ARR, per head instead of over the layer's mean. `choose_anchors` then picks n anchors maximizing the sum over
the sparse layers (dynamic programming over the layers). For comparison on the same steps: the shared oracle set
(`oracle`), dustin's Eq. 6 set from the config's score heads, and the anchors' sets with S_draft's top-m kept.
Recovery is not accuracy (on RULER the oracle-kv rung recovers more than oracle-layer and scores lower,
docs/accuracy.md): this ranks anchor layouts, it does not predict a task score.

    python3 -m dustin.profiling.anchors --context 4096 --json-out anchors_4k.json     # the real pair, CPU: ~15 min
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from dustin.attention.context import ForwardContext, SparsePlan
from dustin.kernels.selection import select_dustin
from dustin.profiling.trace import _prefill, step_positions, trace_text
from dustin.scoring import causal_probs
from dustin.selection.anchors import anchor_set, layer_anchors
from dustin.selection.config import SparseConfig
from dustin.selection.oracle import ARR_WINDOW, oracle_set


class HeadWindows:
    """QueryObserver of one text's prefill: rows [N, n_layers, Hq, S] = each query head's attention on the
    context j < L_n, averaged over the w queries at L_n .. L_n + w - 1 (normalized over every key each sees)."""

    def __init__(self, n_layers: int, n_heads: int, lengths: torch.Tensor, S: int, w: int = ARR_WINDOW) -> None:
        self.layers = frozenset(range(n_layers))
        self.lengths, self.w = lengths, w
        self.rows = torch.zeros(len(lengths), n_layers, n_heads, S, dtype=torch.float32, device=lengths.device)

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> None:
        N, _, H, S = self.rows.shape
        pos = self.lengths[:, None] + torch.arange(self.w, device=q.device)[None]  # [N, w]
        local = (pos - ctx.positions[0, 0]).reshape(-1)
        keys = S + self.w  # the window's own tokens count in each query's softmax
        probs = causal_probs(q[:1, :, local], k_cache[:1, :, :keys], pos.reshape(1, -1))[0]  # [H, N*w, keys]
        probs = probs[..., :S].reshape(H, N, self.w, S).mean(2).transpose(0, 1)
        self.rows[:, layer] = probs * (torch.arange(S, device=q.device)[None] < self.lengths[:, None])[:, None]


def _head_recovery(share: torch.Tensor, plan, n_kv: int, per_head: bool = False) -> torch.Tensor:
    """share [N, Ll, Hq, S] (each head's context attention, summing to 1), a plan of N rows ([N, K] or
    [N, Hkv, K]) -> [N, Ll]: the mean over heads of the share each head's set holds ([N, Ll, Hq] per_head)."""
    N, Ll, Hq, S = share.shape
    idx = plan.indices if plan.indices.dim() == 3 else plan.indices[:, None]
    counts = plan.counts if plan.counts.dim() == 2 else plan.counts[:, None]
    group = torch.arange(Hq) // (Hq // n_kv) if idx.shape[1] > 1 else torch.zeros(Hq, dtype=torch.long)
    idx, counts = idx[:, group].long(), counts[:, group]  # [N, Hq, K], [N, Hq]
    valid = torch.arange(idx.shape[-1])[None, None] < counts[..., None]
    picked = (share.gather(-1, idx[:, None].expand(N, Ll, Hq, -1)) * valid[:, None]).sum(-1)
    return picked if per_head else picked.mean(-1)


def _scores(rows: torch.Tensor, n_kv: int, granularity: str) -> torch.Tensor:
    """Anchor scores [N, R, S] of one layer's rows [N, Hq, S] (the policy's `anchor_scores`, up to a factor)."""
    return rows.unflatten(1, (n_kv, -1)).sum(2) if granularity == "kv" else rows.sum(1, keepdim=True)


def reuse_matrix(rows: torch.Tensor, lengths: torch.Tensor, n_kv: int, granularity: str, k: int, sinks: int,
                 window: int) -> torch.Tensor:
    """Recovery summed over steps (divide by N for the mean), NaN where a > l: "layer" R [n, n]; "kv"
    R [n, n, Hkv, Hkv], R[a, l, s, d] = what anchor a's set of KV head s holds of the heads on layer l's KV head
    d (s = d: the plain reuse; the best s per d: a head mapping)."""
    share = rows / rows.sum(-1, keepdim=True).clamp_min(1e-30)
    n, Hq = rows.shape[1], rows.shape[2]
    out = torch.full((n, n) if granularity == "layer" else (n, n, n_kv, n_kv), float("nan"))
    for a in range(n):
        plan = anchor_set(_scores(rows[:, a], n_kv, granularity), lengths, k, sinks, window)
        if granularity == "layer":
            out[a, a:] = _head_recovery(share[:, a:], plan, n_kv).sum(0)
            continue
        for src in range(n_kv):  # KV head src's set read by every head of layer l
            one = SparsePlan(plan.indices[:, src], plan.counts[:, src])
            heads = _head_recovery(share[:, a:], one, n_kv, per_head=True).sum(0)  # [Ll, Hq]
            out[a, a:, src] = heads.view(-1, n_kv, Hq // n_kv).mean(-1)
    return out


def head_mapped(R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From "kv"'s R [n, n, Hkv, Hkv]: (identity R [n, n], best-mapping R [n, n]) as means over the KV heads."""
    return R.diagonal(dim1=-2, dim2=-1).mean(-1), R.max(dim=-2).values.mean(-1)


def choose_anchors(R: torch.Tensor, n_anchors: int, dense_layers: int = 1) -> tuple[tuple[int, ...], float]:
    """The n anchors (the first at or below layer `dense_layers`) maximizing the summed R[anchor(l), l] over the
    sparse layers l >= dense_layers; returns (anchors, that sum)."""
    n = R.shape[0]
    gain = torch.nan_to_num(R, nan=0.0).tolist()
    memo: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}

    def span(a: int, end: int) -> float:  # layers a .. end-1 verified with anchor a's set
        return sum(gain[a][lyr] for lyr in range(max(a, dense_layers), end))

    def best(a: int, left: int) -> tuple[float, tuple[int, ...]]:
        if (a, left) not in memo:
            options = [(span(a, n), (a,))] if left == 0 else []
            for b in range(a + 1, n) if left > 0 else ():
                tail, rest = best(b, left - 1)
                options.append((span(a, b) + tail, (a, *rest)))
            memo[a, left] = max(options) if options else (float("-inf"), (a,))
        return memo[a, left]

    value, anchors = max(best(a, n_anchors - 1) for a in range(min(dense_layers, n - 1) + 1))
    return anchors, value


def _texts(engine, context: int, tasks: str, seed: int) -> list[tuple[str, list[int], int]]:
    """(name, ids, stride): RULER samples with their reference answer appended (teacher-forced), steps 1 apart
    ending on the answer; a code and an essay text, steps 8 apart near their end."""
    from dustin.data.corpora import long_texts
    from dustin.tasks.catalog import build_samples, get_tasks

    tok = engine.tokenizer
    out = []
    for s in build_samples(get_tasks(tasks), tok, context, 1, seed):
        answer = tok.encode(", ".join(s.references), add_special_tokens=False)
        out.append((s.task, s.prompt_ids + answer, 1))
    for kind in ("code", "essays"):
        text = long_texts(kind, "heldout", context, tok, 1, seed)[0]
        out.append((kind, tok.encode(text, add_special_tokens=False), 8))
    return out


@torch.inference_mode()
def measure(engine, cfg: SparseConfig, texts, budgets, steps: int, anchors_max: int, dense_layers: int,
            draft_m: tuple[int, ...], fixed: tuple[int, ...]) -> dict:
    t, d = engine.target, engine.draft
    n, n_kv = t.args.n_layers, t.args.n_kv_heads
    sums: dict = {}
    n_steps = 0
    for name, ids, stride in texts:
        toks = torch.tensor(ids)
        L = torch.tensor(step_positions(len(ids), steps, stride, max(ARR_WINDOW, 5)))
        obs = HeadWindows(n, t.args.n_heads, L, int(L.max()))
        _prefill(t, toks, [obs])
        srh_t = {sh.layer: list(sh.heads) for sh in cfg.target}
        srh_d = {sh.layer: list(sh.heads) for sh in cfg.draft}
        tr = trace_text(t, d, ids, srh_t, srh_d, gamma=4, steps=steps, stride=stride)
        S = obs.rows.shape[-1]
        s_target = tr["hist"].float()[..., :S].sum(1)
        s_draft = tr["draft"].float()[..., :S].sum(1)
        rows = obs.rows
        share = rows / rows.sum(-1, keepdim=True).clamp_min(1e-30)
        n_steps += len(L)
        for k in budgets:
            c = cfg.with_budget(k)
            acc = sums.setdefault(k, {})

            def add(key, value, acc=acc):
                acc[key] = acc.get(key, 0) + value

            for g in ("kv", "layer"):
                add(f"reuse_{g}", reuse_matrix(rows, L, n_kv, g, k, c.sinks, c.window))
            plan = SparsePlan(*select_dustin(s_target, s_draft, L, k=k, m=c.draft_topm, sinks=c.sinks,
                                             window=c.window, impl="torch"))
            add("dustin", _head_recovery(share, plan, n_kv).sum(0))
            add("oracle", _head_recovery(share, SparsePlan(*oracle_set(rows.mean((1, 2)), L, k, c.sinks, c.window)),
                                         n_kv).sum(0))
            pickable = torch.arange(S)[None]
            pickable = (pickable >= c.sinks) & (pickable < L[:, None] - c.window)
            for m in draft_m:  # m as at k = 512, scaled with k as `with_budget` scales it
                mm = round(m * (k - c.sinks - c.window) / (512 - c.sinks - c.window))
                picks = s_draft.masked_fill(~pickable, float("-inf")).topk(mm, dim=1).indices if mm else None
                for g in ("kv", "layer"):
                    sets = {a: anchor_set(_scores(rows[:, a], n_kv, g), L, k, c.sinks, c.window, picks)
                            for a in fixed}
                    rec = torch.zeros(n)
                    for lyr, a in enumerate(layer_anchors(fixed, dense_layers, n)):
                        if a is not None:
                            rec[lyr] = _head_recovery(share[:, lyr:lyr + 1], sets[a], n_kv).sum()
                    add(f"fixed_{g}_m{m}", rec)
        print(f"{name}: {len(ids)} tokens, {len(L)} steps", flush=True)
    report: dict = {"steps": n_steps, "budgets": {}}
    for k, acc in sums.items():
        mean = {key: v / n_steps for key, v in acc.items()}
        ident, mapped = head_mapped(mean["reuse_kv"])
        row: dict = {"per_layer": {key: [round(x, 4) for x in mean[key].tolist()]
                                   for key in mean if not key.startswith("reuse")},
                     "reuse_kv_heads": [[None if x != x else round(x, 4) for x in r.flatten().tolist()]
                                        for r in mean["reuse_kv"]]}
        for g, R in (("kv", ident), ("kv_mapped", mapped), ("layer", mean["reuse_layer"])):
            row[f"reuse_{g}"] = [[None if x != x else round(x, 4) for x in r] for r in R.tolist()]
            row[f"own_{g}"] = round(float(R.diagonal()[dense_layers:].mean()), 4)
            row[f"anchors_{g}"] = {}
            for na in range(1, anchors_max + 1):
                chosen, value = choose_anchors(R, na, dense_layers)
                row[f"anchors_{g}"][na] = {"layers": chosen, "mean": round(value / (n - dense_layers), 4)}
            own = [R[a, lyr] for lyr, a in enumerate(layer_anchors(fixed, dense_layers, n)) if a is not None]
            row[f"fixed_{g}"] = round(float(torch.stack(own).mean()), 4)
        for key in ("dustin", "oracle", *[f"fixed_{g}_m{m}" for m in draft_m for g in ("kv", "layer")]):
            row[key] = round(float(mean[key][dense_layers:].mean()), 4)
        report["budgets"][k] = row
    return report


def main() -> None:
    from dustin.engine.engine import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--tasks", default="niah_multikey_2,niah_multikey_3,niah_multivalue,vt,fwe,qa_1")
    p.add_argument("--budgets", default="128,256,512")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--anchors-max", type=int, default=6)
    p.add_argument("--dense-layers", type=int, default=1)
    p.add_argument("--fixed", default="1,7,14,21", help="anchor layers also evaluated as given")
    p.add_argument("--draft-m", default="0,32,64,128", help="S_draft picks kept with the fixed anchors (at k 512)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    t0 = time.time()
    engine = Engine.from_pretrained("default", "default", device="cpu", dtype=a.dtype)
    cfg = engine.default_sparse_config()
    texts = _texts(engine, a.context, a.tasks, a.seed)
    budgets = [int(x) for x in a.budgets.split(",")]
    fixed = tuple(int(x) for x in a.fixed.split(","))
    report = measure(engine, cfg, texts, budgets, a.steps, a.anchors_max, a.dense_layers,
                     tuple(int(x) for x in a.draft_m.split(",")), fixed)
    report.update({"date": time.strftime("%Y-%m-%d"), "context": a.context, "texts": [x[0] for x in texts],
                   "fixed": fixed, "dense_layers": a.dense_layers, "config": cfg.source, "dtype": engine.dtype_name,
                   "seconds": round(time.time() - t0)})
    text = json.dumps(report, indent=1)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text)
    print(json.dumps({k: {x: v for x, v in row.items() if not x.startswith(("reuse", "per_layer"))}
                      for k, row in report["budgets"].items()}, indent=1))


if __name__ == "__main__":
    main()
