"""Plain PyTorch references for the verify-step attention variants.

Conventions shared by every backend and kernel:
- q: [B, Hq, T, D], the T new tokens' queries (T = gamma + 1 while verifying, 1 while decoding).
- k_cache, v_cache: [B, Hkv, S_cap, D]; the T new tokens are already written at positions
  lengths[b] .. lengths[b] + T - 1.
- lengths: int [B], the number of cached positions of sequence b *before* the new tokens.
- Query t of sequence b sits at position p = lengths[b] + t and sees keys j <= p (causal among new tokens).
- Streaming (sinks > 0 or window > 0): query at p sees only j < sinks or p - window < j <= p.
- Sparse: query at p sees the cached positions indices[b, :counts[b]] (all < lengths[b]) plus the new
  tokens lengths[b] .. p; with per-KV-head lists, head h sees indices[b, h // G, :counts[b, h // G]].
- Query head h uses KV head h // (Hq // Hkv) (grouped-query attention).
These references compute in float32 and are slow on purpose: they define the expected results.
"""
from __future__ import annotations

import math

import torch


def _expand_kv(x: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    return x.repeat_interleave(n_q_heads // x.shape[1], dim=1)


def verify_mask(lengths: torch.Tensor, T: int, S: int, sinks: int = 0, window: int = 0) -> torch.Tensor:
    """Boolean mask [B, 1, T, S]: True where query t of sequence b may attend to key j."""
    pos = lengths.to(torch.long)[:, None] + torch.arange(T, device=lengths.device)[None, :]  # [B, T]
    j = torch.arange(S, device=lengths.device)[None, None, :]
    mask = j <= pos[:, :, None]
    if window > 0 or sinks > 0:
        mask = mask & ((j < sinks) | (j > pos[:, :, None] - window))
    return mask[:, None]


def verify_attention_reference(q, k_cache, v_cache, lengths, *, sinks: int = 0, window: int = 0,
                               scale: float | None = None) -> torch.Tensor:
    B, Hq, T, D = q.shape
    S = int(lengths.max().item()) + T
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    k = _expand_kv(k_cache[:, :, :S].float(), Hq)
    v = _expand_kv(v_cache[:, :, :S].float(), Hq)
    scores = torch.einsum("bhtd,bhsd->bhts", q.float(), k) * scale
    scores = scores.masked_fill(~verify_mask(lengths, T, S, sinks, window), float("-inf"))
    return torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), v).to(q.dtype)


def sparse_verify_attention_reference(q, k_cache, v_cache, lengths, indices, counts, *,
                                      scale: float | None = None, log_weights=None) -> torch.Tensor:
    """Attention over the selected cached positions plus the new tokens (see module docstring).
    indices/counts are [B, K]/[B] (one list per sequence) or [B, Hkv, K]/[B, Hkv] (one per KV head: query
    head h then sees indices[b, h // G, :counts[b, h // G]], G = Hq // Hkv). log_weights (shaped like indices):
    selected position i enters the softmax with weight exp(log_weights[i]), i.e. its score plus that log-weight
    (`SparsePlan.bias`); the new tokens keep weight 1."""
    B, Hq, T, D = q.shape
    S = int(lengths.max().item()) + T
    if indices.dim() == 2:  # a per-sequence list is the per-head case with one list shared by all heads
        indices, counts = indices[:, None], counts[:, None]
        log_weights = None if log_weights is None else log_weights[:, None]
    pos = lengths.to(torch.long)[:, None] + torch.arange(T, device=q.device)[None, :]
    j = torch.arange(S, device=q.device)
    selected = torch.zeros(B, indices.shape[1], S, dtype=torch.bool, device=q.device)  # [B, Hkv or 1, S]
    weight = torch.zeros(B, indices.shape[1], S, dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(indices.shape[1]):
            picks = indices[b, h, : int(counts[b, h])].long()
            selected[b, h, picks] = True
            if log_weights is not None:
                weight[b, h, picks] = log_weights[b, h, : int(counts[b, h])].float()
    old = selected & (j[None, None, :] < lengths.long()[:, None, None])  # out-of-range picks are ignored
    new_tok = (j[None, None, :] >= lengths.long()[:, None, None]) & (j[None, None, :] <= pos[:, :, None])
    mask = old[:, :, None, :] | new_tok[:, None]  # [B, Hkv or 1, T, S]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    k = _expand_kv(k_cache[:, :, :S].float(), Hq)
    v = _expand_kv(v_cache[:, :, :S].float(), Hq)
    scores = torch.einsum("bhtd,bhsd->bhts", q.float(), k) * scale
    scores = scores + _expand_kv(weight * old, Hq)[:, :, None, :]
    scores = scores.masked_fill(~_expand_kv(mask, Hq), float("-inf"))
    return torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), v).to(q.dtype)


def attention_scores_reference(q_sel, k_cache, kv_heads, key_lengths, query_positions, out, *, scale=None,
                               ctx_lengths=None, accumulate=True):
    """Plain float32 PyTorch version of `attention_scores` (slow on purpose; defines the semantics)."""
    B, Hs, Tq, D = q_sel.shape
    S_cap = k_cache.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    kv_heads = kv_heads[:Hs]
    j = torch.arange(S_cap, device=q_sel.device)
    key_lengths = torch.full((B,), S_cap, device=q_sel.device) if key_lengths is None else key_lengths
    ctx_lengths = key_lengths if ctx_lengths is None else ctx_lengths
    if query_positions is None:
        query_positions = (key_lengths.long() - 1)[:, None]
    heads_ok = kv_heads.long() >= 0
    k = k_cache[:, kv_heads.long().clamp_min(0)].float()  # [B, Hs, S_cap, D]
    logits = torch.einsum("bhtd,bhsd->bhts", q_sel.float(), k) * scale
    visible = (j[None, None, :] <= query_positions.long().expand(B, Tq)[:, :, None]) & \
              (j[None, None, :] < key_lengths.long()[:, None, None])  # [B, Tq, S_cap]
    probs = logits.masked_fill(~visible[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    mass = (probs * heads_ok[None, :, None, None]).sum(dim=(1, 2)) * (j[None, :] < ctx_lengths.long()[:, None])
    if not accumulate:
        out.zero_()
    out[:, :S_cap] += mass
    return out


def attention_scores_multi_reference(q, k_all, layers, kv_heads, key_lengths, query_positions, out, *,
                                     scale=None, ctx_lengths=None, accumulate=True):
    """Plain PyTorch version of `attention_scores_multi`: one reference call per layer."""
    if not accumulate:
        out.zero_()
    for i in range(q.shape[1]):
        lyr = int(layers[i]) if layers is not None else i
        attention_scores_reference(q[:, i], k_all[lyr], kv_heads[i], key_lengths, query_positions, out,
                                   scale=scale, ctx_lengths=ctx_lengths)
    return out
