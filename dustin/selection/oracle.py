"""The true attention of the verify window over the cached context (paper Eq. 1-3), for the oracle policy and
for measuring the attention recovery rate (ARR) of any selected set. Analysis only: it runs a full-cache target
forward and materializes every head's attention."""
from __future__ import annotations

import torch

from dustin.attention.context import ForwardContext
from dustin.attention.reference import verify_mask
from dustin.cache.kv_cache import KVCache
from dustin.models.transformer import Transformer

ARR_WINDOW = 4  # w in Eq. 2-3, as in the paper


class WindowAttention:
    """QueryObserver collecting, per layer, the mean over heads and the first `window` queries of the
    attention on each cached position j < lengths[b] (normalized over all keys the query sees)."""

    def __init__(self, n_layers: int, window: int = ARR_WINDOW) -> None:
        self.layers = frozenset(range(n_layers))
        self.window = window
        self.per_layer: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> None:
        B, Hq, T, D = q.shape
        w = min(self.window, T)
        S = ctx.max_len
        k = k_cache[:, :, :S].float().repeat_interleave(Hq // k_cache.shape[1], dim=1)
        logits = torch.einsum("bhtd,bhsd->bhts", q[:, :, :w].float(), k) / D ** 0.5
        mask = verify_mask(ctx.lengths, T, S)[:, :, :w]
        probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)  # [B, H, w, S]
        ctx_only = torch.arange(S, device=q.device)[None, :] < ctx.lengths.long()[:, None]
        self.per_layer[layer] = probs.mean(dim=(1, 2)) * ctx_only  # Ā over the window, heads averaged


@torch.inference_mode()
def window_attention(target: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                     per_layer: bool = False):
    """Mean attention Ā[b, j] of the verify window over heads and layers ([B, S_cap]); with per_layer, the
    dict layer -> [B, S] instead. Writes the window's K/V into the cache (the verify rewrites the same)."""
    obs = WindowAttention(target.args.n_layers)
    L = cache.lengths
    max_len = int(L.max()) + tokens.shape[1]
    target(tokens, ForwardContext(cache, positions, L, max_len, observers=[obs]))
    if per_layer:
        return obs.per_layer
    mean = torch.stack(list(obs.per_layer.values())).mean(0)
    out = torch.zeros(L.shape[0], cache.capacity, dtype=torch.float32, device=mean.device)
    out[:, :max_len] = mean
    return out
