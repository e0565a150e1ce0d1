"""Online importance estimation (paper Sec. 4.2.3, Eq. 5) on a few configured heads only.

- `DraftLookaheadScores` observes the draft's forwards: each of the Γ draft forwards contributes the query of
  the token it reads last (pending, d1, ..., d_{Γ-1}), whose attention over the draft's full context is summed
  into S_draft for the configured (layer, heads). With a streaming draft the draft's own attention reads only
  sinks + window, but these score heads still read the whole draft cache.
- `TargetHistoricalScores` observes the target's verify forward (and prefill) and keeps, per configured layer,
  the query of the last token that ends up in the cache; at the next step it scores that query against the
  full target cache (S_target).
Scores are fp32 rows [B, S_cap]; only the configured heads' probabilities are ever materialized.
`DraftLookahead` is S_draft's plumbing for the policies that use it (the dustin family).
On the GPU (and under the Triton interpreter) each `compute` is ONE `attention_scores_multi` estimate over
all configured layers: the per-layer cache views passed in are recognised, from their metadata alone, as
layers of one [L, B, Hkv, S, D] cache tensor (or the caller passes it as k_all). The estimate overwrites the
score row (no zero_() launch). Otherwise (CPU tensors, views of separate tensors, SpecAttn's per-layer rows)
it falls back to one estimate per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dustin.attention.context import ForwardContext, LookaheadCapture
from dustin.attention.reference import attention_scores_reference
from dustin.kernels.dispatch import triton_ok
from dustin.selection.config import ScoreHeads


def accumulate_scores(q_sel, k_cache, kv_heads, key_lengths, query_positions, out, ctx_lengths,
                      accumulate: bool = True) -> None:
    """out[b, j] (+)= softmax mass of q_sel on position j < ctx_lengths[b] (Triton on GPU, PyTorch on CPU)."""
    if triton_ok(q_sel):
        from dustin.kernels.score_estimation import attention_scores as fn  # lazy: Triton
    else:
        fn = attention_scores_reference
    fn(q_sel.contiguous(), k_cache, kv_heads, key_lengths, query_positions, out, ctx_lengths=ctx_lengths,
       accumulate=accumulate)


def stacked_cache(k_caches: dict[int, torch.Tensor], layers: list[int]) -> torch.Tensor | None:
    """The [L, B, Hkv, S, D] tensor whose layer l is k_caches[l] for every l in layers, rebuilt from the
    views' metadata (no copy, no sync); None when they are not layers of one contiguous cache tensor."""
    v0 = k_caches[layers[0]]
    n = v0.numel()
    base = v0.storage_offset() - layers[0] * n
    if not v0.is_contiguous() or base < 0:
        return None
    ptr = v0.untyped_storage().data_ptr()
    for layer in layers:
        v = k_caches[layer]
        if (v.shape != v0.shape or v.stride() != v0.stride() or v.dtype != v0.dtype
                or v.untyped_storage().data_ptr() != ptr or v.storage_offset() != base + layer * n):
            return None
    return v0.as_strided((max(layers) + 1, *v0.shape), (n, *v0.stride()), base)


class _HeadSets:
    """The configured (layer, heads) in a fixed layer order, as the multi-layer kernel wants them: layers
    int32 [NL], kv_heads int32 [NL, Hs_max] (-1 pads a layer with fewer heads). Each layer's heads are
    sorted by KV head (the sum over heads does not depend on their order): the kernel splits a layer of many
    heads into groups of consecutive heads, and heads on one KV head in one group share its K tile read."""

    def __init__(self, heads: tuple[ScoreHeads, ...], group: int, device) -> None:
        heads = tuple(ScoreHeads(sh.layer, tuple(sorted(sh.heads, key=lambda h: h // group))) for sh in heads)
        self.by_layer = {sh.layer: torch.tensor(sh.heads, device=device) for sh in heads}
        self.kv_heads = {sh.layer: torch.tensor([h // group for h in sh.heads], dtype=torch.int32, device=device)
                         for sh in heads}
        self.layers = frozenset(self.by_layer)
        self.order = sorted(self.by_layer)
        self.hs = max((len(sh.heads) for sh in heads), default=0)
        self.pad = {sh.layer: self.hs - len(sh.heads) for sh in heads}
        rows = [[h // group for h in sh.heads] + [-1] * (self.hs - len(sh.heads))
                for sh in sorted(heads, key=lambda sh: sh.layer)]
        self.layers_t = torch.tensor(self.order, dtype=torch.int32, device=device)
        self.kv_all = torch.tensor(rows, dtype=torch.int32, device=device).view(len(rows), self.hs)

    def padded(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, Hs_layer, T, D] padded with zero heads to Hs_max (rare: only when head counts differ)."""
        return F.pad(q, (0, 0, 0, 0, 0, self.pad[layer])) if self.pad[layer] else q

    def full_cache(self, k_caches, k_all, observed) -> torch.Tensor | None:
        """The whole-cache tensor for one multi-layer estimate, or None (then: one estimate per layer)."""
        if sorted(observed) != self.order:
            return None
        return k_all if k_all is not None else stacked_cache(k_caches, self.order)


class DraftLookaheadScores:
    """Asks the draft step, per configured draft layer, for the lookahead query of each draft forward (`capture`,
    a `LookaheadCapture`: data the draft step honours); `compute` then scores all Γ of them in one pass over the
    draft cache (causal: the query at position p sees keys j <= p).

    CUDA-graph safe: draft forward t (t = 0 .. G-1 within a step) reads the token at position base + t, where
    base is the sequence's cache length at the start of the step (`begin_step`), so each query lands in slot
    (position - base) of a fixed buffer [B, Hs, Γ, D]. A replayed graph repeats that write with the step's real
    positions; nothing is appended on the host. Warm-up and capture write junk slots (clamped into range) that the
    real forwards of the step overwrite before `compute` reads them.

    Γ per row: `begin_step` marks every slot unwritten (position -1: a query that sees no key adds nothing), and
    `compute` leaves out each row's slots at or past its own Γ (`row_gamma`), so a row's scores are those of a
    step of its own Γ whatever G the step runs."""

    def __init__(self, heads: tuple[ScoreHeads, ...], group: int, batch: int, capacity: int, device,
                 gamma: int, head_dim: int, dtype: torch.dtype) -> None:
        """head_dim, dtype: of the draft's queries."""
        self._sets = _HeadSets(heads, group, device)
        self.by_layer, self.kv_heads, self.layers = self._sets.by_layer, self._sets.kv_heads, self._sets.layers
        self.gamma = gamma
        self.scores = torch.zeros(batch, capacity, dtype=torch.float32, device=device)
        self._base = torch.zeros(batch, dtype=torch.long, device=device)
        self._pos_buf = torch.zeros(batch, gamma, dtype=torch.long, device=device)  # [B, Γ], same on every layer
        self._slot = torch.arange(gamma, device=device)[None, :]
        self._row_gamma: torch.Tensor | None = None  # each row's Γ (`begin_step`), None: every slot
        # [B, NL, Hs_max, Γ, D] (zero heads pad layers with fewer heads): the one multi-layer estimate reads it as
        # is; _q_buf[layer] is that layer's [B, Hs_layer, Γ, D] view
        sets = self._sets
        self._q_all = torch.zeros(batch, len(sets.order), sets.hs, gamma, head_dim, dtype=dtype, device=device)
        self._q_buf = {layer: self._q_all[:, i, :len(self.by_layer[layer])] for i, layer in enumerate(sets.order)}
        self.capture = LookaheadCapture(self.by_layer, self._q_buf, self._pos_buf, self._base)

    def begin_step(self, lengths: torch.Tensor, row_gamma: torch.Tensor | None = None) -> None:
        """Before the step's first draft forward: lengths [B] = the position of its first lookahead query;
        row_gamma [B]: each row's own Γ (a tensor the caller updates in place; None: all Γ slots count)."""
        self._base.copy_(lengths)
        self._pos_buf.fill_(-1)
        self._row_gamma = row_gamma

    @torch.inference_mode()
    def compute(self, k_caches: dict[int, torch.Tensor], context: torch.Tensor, per_layer: bool = False,
                k_all: torch.Tensor | None = None):
        """S_draft over the committed context j < context[b] (Eq. 5: summed over heads, layers, Γ queries);
        with per_layer, a dict layer -> its own score row instead (SpecAttn selects per layer).
        k_all: optionally the whole draft K cache [L, B, Hkv, S, D] (else recognised from k_caches)."""
        if not self._q_buf:
            self.scores.zero_()
            return {} if per_layer else self.scores
        pos = self._pos_buf
        if self._row_gamma is not None:
            pos = torch.where(self._slot < self._row_gamma[:, None], pos, -1)
        full = None if per_layer or not triton_ok(self._q_all) else \
            self._sets.full_cache(k_caches, k_all, self._q_buf)
        if full is not None:
            from dustin.kernels.score_estimation import attention_scores_multi  # lazy: Triton

            # key_lengths None: the last lookahead query bounds the keys (j <= its position)
            attention_scores_multi(self._q_all, full, self._sets.layers_t, self._sets.kv_all, None, pos,
                                   self.scores, ctx_lengths=context, accumulate=False)
            return self.scores
        rows = {}
        for i, (layer, q) in enumerate(self._q_buf.items()):
            out = torch.empty_like(self.scores) if per_layer else self.scores
            accumulate_scores(q, k_caches[layer], self.kv_heads[layer], (pos.amax(1) + 1).to(torch.int32), pos,
                              out, context, accumulate=not per_layer and i > 0)
            rows[layer] = out
        return rows if per_layer else self.scores


class TargetHistoricalScores:
    def __init__(self, heads: tuple[ScoreHeads, ...], group: int, batch: int, capacity: int, device) -> None:
        self._sets = _HeadSets(heads, group, device)
        self.by_layer, self.kv_heads, self.layers = self._sets.by_layer, self._sets.kv_heads, self._sets.layers
        self.scores = torch.zeros(batch, capacity, dtype=torch.float32, device=device)
        self._window_q: dict[int, torch.Tensor] = {}  # layer -> [B, H_sel, T, D] of the last verify
        self._last_q: dict[int, torch.Tensor] = {}  # layer -> [B, H_sel, 1, D] of the last cached token

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> None:
        sel = q[:, self.by_layer[layer]]
        if ctx.prompt:  # a prompt chunk's last token is its row's last cached one (a later chunk overwrites it)
            B = self.scores.shape[0]
            if layer not in self._last_q:
                self._last_q[layer] = torch.zeros(B, sel.shape[1], 1, sel.shape[3], dtype=q.dtype, device=q.device)
            rows, last = ctx.last_prompt_queries(sel)
            self._last_q[layer][rows] = last
            return
        # a fixed buffer (re)allocated on a new shape, so a CUDA graph's replay refreshes what after_verify reads
        wq = self._window_q.get(layer)
        if wq is None or wq.shape != sel.shape:
            self._window_q[layer] = sel.clone()
        else:
            wq.copy_(sel)

    @property
    def last_queries(self) -> dict[int, torch.Tensor]:
        """Per configured layer, the query [B, H_sel, 1, D] of each row's last cached token: what `compute` scores."""
        return self._last_q

    def after_verify(self, n_accepted: torch.Tensor) -> None:
        """The last token cached by this step is the verify row n_accepted (pending or the last accepted draft)."""
        for layer, wq in self._window_q.items():
            idx = n_accepted.long()[:, None, None, None].expand(-1, wq.shape[1], 1, wq.shape[3])
            if layer in self._last_q:  # in place: a captured step's next replay reads this same buffer
                self._last_q[layer].copy_(wq.gather(2, idx))
            else:
                self._last_q[layer] = wq.gather(2, idx)

    @torch.inference_mode()
    def compute(self, k_caches: dict[int, torch.Tensor], lengths: torch.Tensor,
                k_all: torch.Tensor | None = None) -> torch.Tensor:
        """S_target over the cached positions j < lengths[b] (the query sits at lengths[b] - 1).
        k_all: optionally the whole target K cache [L, B, Hkv, S, D] (else recognised from k_caches)."""
        if not self._last_q:
            self.scores.zero_()
            return self.scores
        first = next(iter(self._last_q.values()))
        full = self._sets.full_cache(k_caches, k_all, self._last_q) if triton_ok(first) else None
        if full is not None:
            from dustin.kernels.score_estimation import attention_scores_multi  # lazy: Triton

            qs = [self._sets.padded(layer, self._last_q[layer]) for layer in self._sets.order]
            q = qs[0][:, None] if len(qs) == 1 else torch.stack(qs, dim=1)  # [B, NL, Hs, 1, D]
            # query_positions None: each query sits at lengths[b] - 1 (saves two small launches)
            attention_scores_multi(q, full, self._sets.layers_t, self._sets.kv_all, lengths, None, self.scores,
                                   accumulate=False)
            return self.scores
        pos = (lengths.long() - 1)[:, None]
        for i, (layer, q_last) in enumerate(self._last_q.items()):
            accumulate_scores(q_last, k_caches[layer], self.kv_heads[layer], lengths, pos, self.scores, lengths,
                              accumulate=i > 0)
        return self.scores


class DraftLookahead:
    """S_draft's plumbing, for the policies that estimate it (Eq. 5): its observer on the draft's forwards, the
    step's base lengths, one estimate per step. The policy's `_setup` makes `_draft_scores` (None: no S_draft)."""

    _draft_scores: DraftLookaheadScores | None = None

    @property
    def draft_scores(self) -> DraftLookaheadScores | None:
        """S_draft's estimator (None before the first step, or without draft score heads)."""
        return self._draft_scores

    def draft_captures(self, state):
        self._setup(state)
        return [self._draft_scores.capture] if self._draft_scores is not None else []

    def begin_step(self, state) -> None:
        if self._draft_scores is not None:
            self._draft_scores.begin_step(state.target_cache.lengths, state.row_gamma)

    def _estimate_draft(self, state, lengths: torch.Tensor) -> torch.Tensor:
        caches = {layer: state.draft_cache.k[layer] for layer in self._draft_scores.layers}
        return self._draft_scores.compute(caches, lengths)
