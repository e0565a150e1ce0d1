"""Exact softmax attention probabilities of chosen queries over a KV cache, recomputed in fp32.

The engine's attention kernels never materialize probabilities. Three consumers need them: SnapKV's prefill
scores (dustin/selection/snapkv.py), the offline profiling observers (dustin/profiling/observe.py) and the ARR/KL
evaluation (dustin/eval/arr_kl.py). The function lives here, below all three, so that none of them imports
another's package for it; it depends on torch alone.
"""
from __future__ import annotations

import math

import torch

_CHUNK_BYTES = 512 * 2**20  # bound on the fp32 copy of K made per chunk of sequences


def causal_probs(q: torch.Tensor, k_cache: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Softmax attention of queries q [B, Hq, Q, D] sitting at positions q_pos [B, Q] over the cached keys
    k_cache [B, Hkv, S, D] (query head h reads KV head h // (Hq / Hkv)); key j is visible to a query at p
    iff j <= p. Returns fp32 [B, Hq, Q, S]; S is what the caller sliced the cache to (>= max(q_pos) + 1)."""
    B, Hq, Q, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.empty(B, Hq, Q, S, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_BYTES // max(Hkv * S * D * 4, 1))
    j = torch.arange(S, device=q.device)
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        k = k_cache[b0:b1].float()  # [b, Hkv, S, D]
        qg = q[b0:b1].float().reshape(b1 - b0, Hkv, G * Q, D)  # query heads of one KV head side by side
        logits = torch.matmul(qg, k.transpose(-1, -2)).view(b1 - b0, Hq, Q, S) / math.sqrt(D)
        visible = j[None, None, None, :] <= q_pos[b0:b1, None, :, None]
        out[b0:b1] = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return out
