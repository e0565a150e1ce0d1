"""Attention traces for the configuration search (paper Sec. 4.2.2: teacher-forced trajectories, ARR objective).

A text of n tokens is read as a classic-SD trajectory that accepted every draft token (teacher forcing):
at a step whose cache holds L tokens, the pending token sits at L, the Γ draft forwards read positions
L .. L+Γ-1 (their queries are the draft's lookahead), the target verifies L .. L+Γ, and the last query the
target computed before the step is the one at L-1 (its history). Steps are sampled near the end of the text,
`stride` tokens apart. Per step and per layer we store rows over the context j < L:

    oracle      [N, Lt, S]  Σ over the target layer's SRHs and the first w = 4 verify queries (Eq. 3's Ā, unnormalized)
    oracle_all  [N, S]      the same over every head of every target layer
    hist        [N, Lt, S]  S_target of each target layer: its SRHs' attention at query L-1 (δ = 1)
    hist_delta  [N, nδ, S]  Σ over layers of the SRH attention at query L-δ, δ in DELTAS (Fig. 2)
    draft       [N, Ld, S]  S_draft of each draft layer: its SRHs' attention summed over the Γ lookahead queries

Rows are additive over layers and heads, so Algorithm 1 combines them without re-running a model. One
prefill of the target and one of the draft (full draft KV) produce every row; with a streaming draft
(MagicDec, the engine's default for dustin) each step re-runs the draft's Γ tokens with streaming attention,
as the engine computes those queries, and restores the cache rows it overwrote.
Rows are stored as fp16 safetensors, one file per text, so a stopped run resumes at the next text.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.errors import InputError
from dustin.profiling.observe import RowRecorder
from dustin.selection.oracle import ARR_WINDOW

DELTAS = (1, 2, 4, 8, 16)  # look-back distances of Fig. 2


def step_positions(n_tokens: int, steps: int, stride: int, lookahead: int) -> list[int]:
    """Cache lengths L of the sampled steps: the last `steps` steps `stride` apart that fit in the text."""
    last = n_tokens - lookahead
    first = last - (steps - 1) * stride
    if first <= max(DELTAS) + 32:
        raise InputError(f"a text of {n_tokens} tokens is too short for {steps} steps {stride} apart")
    return [first + i * stride for i in range(steps)]


def _heads(srh: dict[int, list[int]], device) -> dict[int, torch.Tensor]:
    return {layer: torch.tensor(h, device=device) for layer, h in srh.items()}


@torch.inference_mode()
def _prefill(model, ids: torch.Tensor, observers) -> KVCache:
    a, n = model.args, ids.shape[0]
    dev, dtype = ids.device, model.embed_tokens.weight.dtype
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, a.head_dim, n, dtype, dev)
    ctx = ForwardContext(cache, torch.arange(n, device=dev)[None], torch.zeros(1, dtype=torch.int32, device=dev), n,
                         rows=slice(0, 1), fresh=True, observers=observers)
    model(ids[None], ctx, logits_at=torch.tensor([n - 1], device=dev))
    return cache


@torch.inference_mode()
def trace_text(target, draft, ids: list[int], srh_target: dict[int, list[int]], srh_draft: dict[int, list[int]],
               *, gamma: int, steps: int, stride: int, draft_kv: str = "streaming", draft_sinks: int = 4,
               draft_recent: int = 508) -> dict[str, torch.Tensor]:
    dev = target.embed_tokens.weight.device
    n = len(ids)
    w = ARR_WINDOW
    Ls = step_positions(n, steps, stride, max(w, gamma + 1))
    L = torch.tensor(Ls, device=dev)
    toks = torch.tensor(ids, device=dev)

    def ahead(t: int) -> torch.Tensor:  # [steps, t]: the t positions from each step's length on
        return L[:, None] + torch.arange(t, device=dev)[None]

    h_t = _heads(srh_target, dev)
    groups = {"oracle": (ahead(w), h_t, L), "oracle_all": (ahead(w), None, L)}
    groups.update({f"hist{d}": ((L - d)[:, None], h_t, L) for d in DELTAS})
    rec = RowRecorder(target.args.n_layers, groups, n)
    _prefill(target, toks, [rec])
    r = rec.rows
    out = {"lengths": L.to(torch.int32), "oracle": r["oracle"], "oracle_all": r["oracle_all"].sum(1),
           "hist": r["hist1"], "hist_delta": torch.stack([r[f"hist{d}"].sum(1) for d in DELTAS], 1)}
    del rec, r
    h_d = _heads(srh_draft, dev)
    if draft_kv == "full":
        drec = RowRecorder(draft.args.n_layers, {"draft": (ahead(gamma), h_d, L)}, n)
        _prefill(draft, toks, [drec])
        out["draft"] = drec.rows["draft"]
    else:
        cache = _prefill(draft, toks, [])
        rows = []
        for i, Li in enumerate(Ls):  # the engine's lookahead queries come from streaming attention
            span = slice(Li, Li + gamma)
            saved = cache.k[:, :, :, span].clone(), cache.v[:, :, :, span].clone()
            pos = torch.arange(Li, Li + gamma, device=dev)[None]
            drec = RowRecorder(draft.args.n_layers, {"draft": (pos, h_d, L[i:i + 1])}, n)
            ctx = ForwardContext(cache, pos, torch.tensor([Li], dtype=torch.int32, device=dev), Li + gamma,
                                 sinks=draft_sinks, window=draft_recent, observers=[drec])
            draft(toks[span][None], ctx)
            cache.k[:, :, :, span], cache.v[:, :, :, span] = saved  # later steps read the prefill's K/V
            rows.append(drec.rows["draft"][0])
        out["draft"] = torch.stack(rows)
    return {k: (v.to(torch.float16) if v.is_floating_point() else v).cpu().contiguous() for k, v in out.items()}


def run_trace(engine, out_dir: Path, split: str, texts: list[tuple[str, str]], srh_target, srh_draft, *,
              gamma: int, steps: int, stride: int, draft_kv: str, draft_window: int, progress=None) -> list[Path]:
    """Trace every (name, text) not traced yet into out_dir/trace/<split>/<name>.safetensors."""
    from safetensors.torch import save_file

    folder = out_dir / "trace" / split
    folder.mkdir(parents=True, exist_ok=True)
    task = progress.add_task(f"traces ({split})", total=len(texts)) if progress else None
    paths = []
    for name, text in texts:
        path = folder / f"{name}.safetensors"
        if not path.is_file():
            ids = engine.pair.encode(text)
            rows = trace_text(engine.pair.target, engine.pair.draft, ids, srh_target, srh_draft, gamma=gamma,
                              steps=steps, stride=stride, draft_kv=draft_kv, draft_recent=draft_window - 4)
            tmp = path.with_suffix(".tmp")
            save_file(rows, str(tmp), metadata={"name": name, "tokens": str(len(ids)), "gamma": str(gamma),
                                                "draft_kv": draft_kv, "deltas": json.dumps(DELTAS)})
            tmp.rename(path)
        paths.append(path)
        if progress:
            progress.advance(task)
    return paths


def load_traces(paths: list[Path], device="cpu") -> dict[str, torch.Tensor]:
    """Concatenate per-text traces over steps, padding every row to the longest text (zeros past L)."""
    from safetensors.torch import load_file

    if not paths:
        raise InputError("no traces found: run `dustin profile trace` first")
    parts = [load_file(str(p), device=str(device)) for p in paths]
    S = max(p["oracle"].shape[-1] for p in parts)

    def pad(t: torch.Tensor) -> torch.Tensor:  # right-pad the key axis to the longest trace's S
        return torch.nn.functional.pad(t, (0, S - t.shape[-1]))

    out = {k: torch.cat([pad(p[k]) if k != "lengths" else p[k] for p in parts]) for k in parts[0]}
    out["text"] = torch.cat([torch.full_like(p["lengths"], i) for i, p in enumerate(parts)])
    return out
