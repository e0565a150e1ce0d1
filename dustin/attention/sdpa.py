"""PyTorch SDPA attention for the verify step: the CPU path and the GPU fallback.

GQA without repeating K/V: each KV group's G query heads are folded into the query-length axis
(q -> [B, Hkv, G*T, D], row g*T + t) and the [T, S] mask is tiled G times along that axis (per KV head
when the mask has one slice per KV head, as with Quest's per-head page lists). Semantics are those of
`dustin.attention.reference` (see its docstring).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dustin.attention.reference import verify_mask


def verify_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, *,
                          sinks: int = 0, window: int = 0, scale: float | None = None,
                          max_len: int | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """max_len bounds max(lengths) + T (default: the capacity); `mask` [B, 1, T, S] or [B, Hkv, T, S] (one
    per KV head) overrides the causal / streaming mask (sparse verification uses it): boolean, or additive in
    q's dtype (-inf where unseen; a sampled tail's log-weights)."""
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    G = Hq // Hkv
    S = min(max_len, k_cache.shape[2]) if max_len is not None else k_cache.shape[2]
    if mask is None:
        mask = verify_mask(lengths, T, S, sinks, window)  # [B, 1, T, S]
    # Tile each KV head's [T, S] rows G times: folded row g*T + t is query head g of the group, token t.
    H_mask = mask.shape[1]
    folded_mask = mask[:, :, None].expand(B, H_mask, G, T, S).reshape(B, H_mask, G * T, S)
    folded_q = q.reshape(B, Hkv, G * T, D)
    out = F.scaled_dot_product_attention(folded_q, k_cache[:, :, :S], v_cache[:, :, :S],
                                         attn_mask=folded_mask, scale=scale)
    return out.reshape(B, Hq, T, D)
