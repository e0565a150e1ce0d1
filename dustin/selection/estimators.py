"""Online importance estimation (paper Sec. 4.2.3, Eq. 5) on a few configured heads only.

- `DraftLookaheadScores` observes the draft's forwards: each of the Γ draft forwards contributes the query of
  the token it reads last (pending, d1, ..., d_{Γ-1}), whose attention over the draft's full context is summed
  into S_draft for the configured (layer, heads). With a streaming draft the draft's own attention reads only
  sinks + window, but these score heads still read the whole draft cache.
- `TargetHistoricalScores` observes the target's verify forward (and prefill) and keeps, per configured layer,
  the query of the last token that ends up in the cache; at the next step it scores that query against the
  full target cache (S_target).
Scores are fp32 rows [B, S_cap]; only the configured heads' probabilities are ever materialized.
"""
from __future__ import annotations

import os

import torch

from dustin.attention.context import ForwardContext
from dustin.selection.config import ScoreHeads


def accumulate_scores(q_sel, k_cache, kv_heads, key_lengths, query_positions, out, ctx_lengths) -> None:
    """out[b, j] += softmax mass of q_sel on position j < ctx_lengths[b] (Triton on GPU, PyTorch on CPU)."""
    from dustin.kernels import score_estimation as se

    D = q_sel.shape[-1]
    kernel_ok = D >= 16 and D & (D - 1) == 0
    if kernel_ok and (q_sel.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        se.attention_scores(q_sel.contiguous(), k_cache, kv_heads, key_lengths, query_positions, out,
                            ctx_lengths=ctx_lengths)
    else:
        se.attention_scores_reference(q_sel, k_cache, kv_heads, key_lengths, query_positions, out,
                                      ctx_lengths=ctx_lengths)


def _kv_heads(heads: tuple[int, ...], group: int, device) -> torch.Tensor:
    return torch.tensor([h // group for h in heads], dtype=torch.int32, device=device)


class DraftLookaheadScores:
    """Collects, per configured draft layer, the lookahead query of each draft forward; `compute` then scores
    all Γ of them in one pass over the draft cache (causal: the query at position p sees keys j <= p)."""

    def __init__(self, heads: tuple[ScoreHeads, ...], group: int, batch: int, capacity: int, device) -> None:
        self.by_layer = {sh.layer: torch.tensor(sh.heads, device=device) for sh in heads}
        self.kv_heads = {sh.layer: _kv_heads(sh.heads, group, device) for sh in heads}
        self.layers = frozenset(self.by_layer)
        self.scores = torch.zeros(batch, capacity, dtype=torch.float32, device=device)
        self._queries: dict[int, list[torch.Tensor]] = {}
        self._positions: dict[int, list[torch.Tensor]] = {}

    def reset(self) -> None:
        self._queries.clear()
        self._positions.clear()

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> None:
        if ctx.fresh:
            return  # prefill: no lookahead yet
        # the query of the token this forward reads last (pending, d1, ..., d_{Γ-1})
        self._queries.setdefault(layer, []).append(q[:, self.by_layer[layer], -1:])
        self._positions.setdefault(layer, []).append(ctx.positions[:, -1:])

    @torch.inference_mode()
    def compute(self, k_caches: dict[int, torch.Tensor], context: torch.Tensor, per_layer: bool = False):
        """S_draft over the committed context j < context[b] (Eq. 5: summed over heads, layers, Γ queries);
        with per_layer, a dict layer -> its own score row instead (SpecAttn selects per layer)."""
        self.scores.zero_()
        rows = {}
        for layer, qs in self._queries.items():
            q = torch.cat(qs, dim=2)  # [B, H_sel, Γ, D]
            pos = torch.cat(self._positions[layer], dim=1)  # [B, Γ]
            out = torch.zeros_like(self.scores) if per_layer else self.scores
            accumulate_scores(q, k_caches[layer], self.kv_heads[layer], (pos[:, -1] + 1).to(torch.int32), pos,
                              out, context)
            rows[layer] = out
        return rows if per_layer else self.scores


class TargetHistoricalScores:
    def __init__(self, heads: tuple[ScoreHeads, ...], group: int, batch: int, capacity: int, device) -> None:
        self.by_layer = {sh.layer: torch.tensor(sh.heads, device=device) for sh in heads}
        self.kv_heads = {sh.layer: _kv_heads(sh.heads, group, device) for sh in heads}
        self.layers = frozenset(self.by_layer)
        self.scores = torch.zeros(batch, capacity, dtype=torch.float32, device=device)
        self._window_q: dict[int, torch.Tensor] = {}  # layer -> [B, H_sel, T, D] of the last verify
        self._last_q: dict[int, torch.Tensor] = {}  # layer -> [B, H_sel, 1, D] of the last cached token

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> None:
        sel = q[:, self.by_layer[layer]]
        if ctx.fresh:  # prefill of one sequence: its last prompt token is the last cached token
            B = self.scores.shape[0]
            if layer not in self._last_q:
                self._last_q[layer] = torch.zeros(B, sel.shape[1], 1, sel.shape[3], dtype=q.dtype, device=q.device)
            self._last_q[layer][ctx.rows] = sel[:, :, -1:]
        else:
            self._window_q[layer] = sel

    def after_verify(self, n_accepted: torch.Tensor) -> None:
        """The last token cached by this step is the verify row n_accepted (pending or the last accepted draft)."""
        for layer, wq in self._window_q.items():
            idx = n_accepted.long()[:, None, None, None].expand(-1, wq.shape[1], 1, wq.shape[3])
            self._last_q[layer] = wq.gather(2, idx)

    @torch.inference_mode()
    def compute(self, k_caches: dict[int, torch.Tensor], lengths: torch.Tensor) -> torch.Tensor:
        """S_target over the cached positions j < lengths[b] (the query sits at lengths[b] - 1)."""
        self.scores.zero_()
        pos = (lengths.long() - 1)[:, None]
        for layer, q_last in self._last_q.items():
            accumulate_scores(q_last, k_caches[layer], self.kv_heads[layer], lengths, pos, self.scores, lengths)
        return self.scores
