"""Exact attention probabilities of chosen queries, for offline analysis (never on the decode hot path).

The engine's attention kernels never materialize probabilities. Profiling needs them for every head (SRH
scores) or for a few query positions over the whole context (traces), so these observers recompute them in
fp32 (`dustin.scoring.causal_probs`) from the post-RoPE queries a forward hands its `QueryObserver`s and the
layer's K cache.
"""
from __future__ import annotations

import torch

from dustin.attention.context import ForwardContext
from dustin.scoring import causal_probs


class SpanMass:
    """Per layer: each query head's attention mass on a token span, for the LAST query of every forward
    (the query whose logits pick the next token). spans: int [B, 2] = [start, end) per sequence.
    After a forward, `mass` is [B, L, H] (a prompt forward fills its pieces' rows only: the query of each piece's
    last token)."""

    def __init__(self, n_layers: int, n_heads: int, spans: torch.Tensor) -> None:
        self.layers = frozenset(range(n_layers))
        self.spans = spans
        self.mass = torch.zeros(spans.shape[0], n_layers, n_heads, dtype=torch.float32, device=spans.device)

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> None:
        if ctx.prompt:
            for b, q_b, k_b, pos0 in ctx.prompt_pieces(q, k_cache):
                n = pos0 + q_b.shape[2]
                last = torch.full((1, 1), n - 1, device=q.device)
                self.mass[b, layer] = self._mass(q_b[:, :, -1:], k_b, last, self.spans[b:b + 1], n)[0]
            return
        rows = ctx.rows if ctx.rows is not None else slice(None)
        self.mass[rows, layer] = self._mass(q[:, :, -1:], k_cache, ctx.positions[:, -1:], self.spans[rows],
                                            int(ctx.max_len))

    @staticmethod
    def _mass(q: torch.Tensor, k_cache: torch.Tensor, pos: torch.Tensor, spans: torch.Tensor, S: int) -> torch.Tensor:
        """[b, H]: the attention mass of queries q [b, H, 1, D] at positions pos [b, 1] on spans [b, 2]; S (host):
        a bound on the keys they see."""
        probs = causal_probs(q, k_cache[:, :, :S], pos)[:, :, 0]  # [b, H, S]
        j = torch.arange(S, device=q.device)[None, :]
        inside = (j >= spans[:, :1]) & (j < spans[:, 1:])  # [b, S]
        return (probs * inside[:, None, :]).sum(-1)


class RowRecorder:
    """Attention rows of chosen query positions of ONE sequence, reduced per layer while the forward runs
    (a prefill over the whole text hands every position's query at once).

    groups: name -> (positions int [N, P], heads per layer {layer: int tensor of query heads} or None for
    all heads, ctx_len int [N]); for each name and layer it stores rows[name][n, layer] = the sum over the
    chosen heads and the P queries of step n of their probabilities on keys j < ctx_len[n] (fp32 [N, S])."""

    def __init__(self, n_layers: int, groups: dict, S: int) -> None:
        self.layers = frozenset(range(n_layers))
        self.groups = groups
        self.rows = {name: torch.zeros(pos.shape[0], n_layers, S, dtype=torch.float32, device=pos.device)
                     for name, (pos, _, _) in groups.items()}

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> None:
        S = self.rows[next(iter(self.rows))].shape[-1]
        first = ctx.positions[0, 0]
        for name, (pos, heads, ctx_len) in self.groups.items():
            h = heads.get(layer) if heads is not None else None
            if heads is not None and h is None:
                continue
            # a head subset reads its own KV heads (h // group), passed one per query head
            qs, ks = (q[0], k_cache[:1, :, :S]) if h is None else \
                (q[0, h], k_cache[:1, h // (q.shape[1] // k_cache.shape[1]), :S])  # [H, T, D], [1, H or Hkv, S, D]
            N, P = pos.shape
            local = (pos - first).reshape(-1)  # query indices inside this forward's tokens
            probs = causal_probs(qs[:, local][None], ks, pos.reshape(1, -1))[0]  # [H, N*P, S]
            probs = probs.view(-1, N, P, S).sum(dim=(0, 2))  # [N, S]
            keep = torch.arange(S, device=q.device)[None, :] < ctx_len[:, None]
            self.rows[name][:, layer] = probs * keep
