"""`dustin-anchor`: head-aware sparse verification with anchor layers (Kascade, arXiv 2512.16391).

A few anchor layers score every cached position with their own verify queries and pick k of them; the layers after
an anchor reuse its set. Per verify forward (a `LayerPlanner`, settings in `SparseConfig.anchor`):

- an anchor layer a takes each query head's softmax attention over the whole cache, averaged over the first
  w = 4 verify queries (the ARR window of Eq. 2-3; each query normalized over every key it sees, the new tokens up
  to itself included), and sums it per KV head over the head's query group (`granularity` "kv": k positions per
  KV head, [B, Hkv, K]) or over all heads (`"layer"`: one set, [B, K]);
- the set keeps the sinks and the recent window, optionally S_draft's top-m (Eq. 6's draft share, `draft_topm`:
  Dustin's lookahead signal, estimated once per step as `dustin` does), and fills the rest of k by that score;
  at an anchor it is the ladder's `oracle-kv` / `oracle-layer` set of that layer (selection/ladder.py);
- layers below `dense_layers` verify densely (an anchor among them still scores, for the layers above); every
  other layer uses the set of the nearest anchor at or below it.

Cost per step: each anchor reads its layer's K over the whole cache once; the GPU path is `attention_scores_multi`
(kernels/score_estimation.py), each KV head's G query heads x w queries folded into the rows of one tl.dot from
the cache's bf16 with fp32 accumulation (fp32 logits and softmax: the ranking sees the scores the model computes,
up to the bf16 inputs it computes them from), one estimate per KV head for "kv", one for "layer"; then Eq. 6's
selection kernel (`select_dustin`, m = 0, on [B * Hkv, S] rows). Graph-safe: shapes come from the cache capacity
(the kernels stop at each row's length), state lives in buffers made at the first step, and nothing syncs.
"""
from __future__ import annotations

import torch

from dustin.attention.context import SparsePlan
from dustin.errors import InputError
from dustin.kernels.dispatch import triton_ok
from dustin.selection.base import SelectionPolicy, StepState, draft_query_shape
from dustin.selection.config import SparseConfig
from dustin.selection.estimators import DraftLookahead, DraftLookaheadScores
from dustin.selection.oracle import ARR_WINDOW, window_probs

_MAX_ROWS = 64  # query rows (heads x queries) per launch entry of the score kernel (its _MAX_GROUP_ROWS)


def anchor_scores(q: torch.Tensor, k_cache: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
                  max_len: int, granularity: str, window: int = ARR_WINDOW,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """An anchor layer's score of each cached position: the softmax attention of its query heads, summed over the
    first `window` verify queries and over the query heads of each KV head ("kv": [B, Hkv, S]) or of the layer
    ("layer": [B, 1, S]); zero at j >= lengths[b]. q [B, Hq, T, D] (after RoPE) at `positions` [B, T]
    (lengths[b] + t), k_cache [B, Hkv, S_cap, D] holding the T new tokens already.

    Triton (GPU, interpreter; D a power of two >= 16): S = S_cap, written into `out` [B, R, S_cap] fp32 if given.
    Else PyTorch in fp32 (`window_probs`): S = max_len."""
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    G, w = Hq // Hkv, min(window, T)
    if not triton_ok(q):
        probs = window_probs(q, k_cache, lengths, max_len, w)  # [B, Hq, S], the mean over the w queries
        grouped = probs.unflatten(1, (Hkv, G)) if granularity == "kv" else probs[:, None]
        return grouped.sum(2) * w
    from dustin.kernels.score_estimation import attention_scores_multi

    rows = Hkv if granularity == "kv" else 1
    S_cap = k_cache.shape[2]
    if out is None:
        out = torch.empty(B, rows, S_cap, dtype=torch.float32, device=q.device)
    qg = q.unflatten(1, (Hkv, G))[:, :, :, :w]  # [B, Hkv, G, w, D]: each KV head's rows, no copy
    # the KV heads as the "layers" of the multi-layer kernel: entry h reads KV head h through one K slot
    by_head = k_cache.transpose(0, 1).unsqueeze(2)  # [Hkv, B, 1, S_cap, D]
    heads = torch.zeros(Hkv, G, dtype=torch.int32, device=q.device)
    qpos = positions[:, :w]
    group = max(1, min(G, _MAX_ROWS // w))  # a KV head's whole group in one launch entry: K read once
    if granularity == "layer":
        attention_scores_multi(qg, by_head, None, heads, None, qpos, out[:, 0], ctx_lengths=lengths,
                               accumulate=False, group_heads=group)
        return out
    for h in range(Hkv):
        attention_scores_multi(qg[:, h:h + 1], by_head[h:h + 1], None, heads[h:h + 1], None, qpos, out[:, h],
                               ctx_lengths=lengths, accumulate=False, group_heads=group)
    return out


def anchor_set(scores: torch.Tensor, lengths: torch.Tensor, k: int, sinks: int, window: int,
               draft_picks: torch.Tensor | None = None) -> SparsePlan:
    """The verification set(s) from an anchor's scores [B, R, S] (R = Hkv: one per KV head, [B, Hkv, K]; R = 1:
    one per sequence, [B, K]): sinks + recent window, the `draft_picks` [B, m] (S_draft's top, pickable positions
    only), then the top of the scores; every position when lengths[b] <= k. Eq. 6 with m = 0 on each row, the
    draft's picks raised above every score. Overwrites `scores` at the draft picks."""
    from dustin.kernels.selection import select_dustin

    B, R, S = scores.shape
    if draft_picks is not None:
        scores.scatter_(2, draft_picks[:, None].expand(B, R, -1), float("inf"))
    flat = scores.view(B * R, S)
    # each row's length per KV head; contiguous: with B = 1 the reshape is a stride-0 view of `lengths`
    rows_len = lengths[:, None].expand(B, R).reshape(B * R).contiguous()
    idx, counts = select_dustin(flat, flat, rows_len, k=k, m=0, sinks=sinks, window=window)
    if R == 1:
        return SparsePlan(idx, counts)
    return SparsePlan(idx.view(B, R, -1), counts.view(B, R))


def layer_anchors(anchors: tuple[int, ...], dense_layers: int, n_layers: int) -> list[int | None]:
    """Per layer, the anchor whose set it verifies with; None for the dense layers below `dense_layers`."""
    out: list[int | None] = []
    for layer in range(n_layers):
        below = [a for a in anchors if a <= layer]
        out.append(None if layer < dense_layers or not below else below[-1])
    return out


class AnchorSelection(DraftLookahead, SelectionPolicy):
    """Anchor layers pick each sparse layer's set from their own verify queries (module docstring)."""

    name = "dustin-anchor"
    # the anchors' scoring and selection run inside the verify forward on fixed shapes without host syncs, the
    # S_draft estimator writes fixed buffers: the whole step replays as one CUDA graph
    graph_safe = True
    # every piece of state is per sequence: the sets are rebuilt every step from the step's own queries, S_draft's
    # rows are each sequence's own lookahead (as dustin's); so a sequence can join a running batch (serving)
    row_local = True

    def __init__(self, cfg: SparseConfig) -> None:
        self.cfg = cfg
        a = cfg.anchor
        self.granularity, self.dense_layers, self.m = a.granularity, a.dense_layers, a.draft_topm
        if self.m > 0 and not cfg.draft:
            raise InputError(f"{cfg.source or 'the sparse config'} has no draft score heads, which dustin-anchor's "
                             f"anchor draft_topm ({self.m}) needs")
        self.anchors: tuple[int, ...] | None = None
        self._anchor_of: list[int | None] = []
        self.plans: dict[int, SparsePlan] = {}  # each anchor layer's set of this step, by layer (`plan_layer`)
        self._draft_scores: DraftLookaheadScores | None = None
        self._draft_picks: torch.Tensor | None = None
        self._scores: torch.Tensor | None = None

    @property
    def draft_picks(self) -> torch.Tensor | None:
        """S_draft's top-m pickable positions of the last step ([B, m]), which every anchor's set holds; None
        without an anchor draft_topm or before the first step."""
        return self._draft_picks

    def resolve_layers(self, n_layers: int) -> None:
        """The anchor layers of an `n_layers`-layer target (`anchors`) and the anchor each layer verifies with
        (`layer_anchors`): what the first step sets up from its target, callable without one."""
        self.anchors = self.cfg.anchor.resolved(n_layers)
        self._anchor_of = layer_anchors(self.anchors, self.dense_layers, n_layers)

    def _setup(self, state: StepState) -> None:
        if self.anchors is not None:
            return
        self.resolve_layers(state.target.args.n_layers)
        if self.m > 0:
            self._draft_scores = DraftLookaheadScores(self.cfg.draft, state.draft.args.gqa_group, state.B,
                                                      state.target_cache.capacity, state.device, state.gamma,
                                                      *draft_query_shape(state))
            self._pos = torch.arange(state.target_cache.capacity, device=state.device)[None]

    def plan(self, state: StepState):
        self._setup(state)
        if self._draft_scores is not None:  # S_draft's top-m pickable positions, kept in every anchor's set
            L = state.target_cache.lengths
            state.timer.start("estimate")
            s_draft = self._estimate_draft(state, L)
            state.timer.stop("estimate")
            state.timer.start("select")
            c = self.cfg
            pickable = (self._pos >= c.sinks) & (self._pos < L.long()[:, None] - c.window)
            m = min(self.m, s_draft.shape[1])  # a cache smaller than m: every row fits in k anyway
            self._draft_picks = s_draft.masked_fill(~pickable, float("-inf")).topk(m, dim=1).indices
            state.timer.stop("select")
        return self

    def plan_layer(self, layer: int, q: torch.Tensor, ctx) -> SparsePlan | None:
        if layer in self.anchors:
            self.plans[layer] = self._anchor_plan(q, ctx.cache.k[layer], ctx)
        anchor = self._anchor_of[layer]
        return None if anchor is None else self.plans[anchor]

    def _anchor_plan(self, q: torch.Tensor, k_cache: torch.Tensor, ctx) -> SparsePlan:
        c = self.cfg
        rows = k_cache.shape[1] if self.granularity == "kv" else 1
        if self._scores is None or self._scores.shape[:2] != (q.shape[0], rows):
            self._scores = torch.empty(q.shape[0], rows, k_cache.shape[2], dtype=torch.float32, device=q.device)
        scores = anchor_scores(q, k_cache, ctx.lengths, ctx.positions, ctx.max_len, self.granularity,
                               out=self._scores)
        return anchor_set(scores, ctx.lengths, c.budget, c.sinks, c.window, self._draft_picks)
