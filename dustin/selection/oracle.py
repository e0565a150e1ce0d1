"""The true attention of the verify window over the cached context (paper Eq. 1-3), for the oracle policy and
for measuring the attention recovery rate (ARR) of any selected set. Analysis only: it runs a full-cache target
forward and materializes every head's attention.

Two oracle sets, both built from the window's mean attention Ā (Eq. 3), and named apart everywhere:
- `oracle-topk` (`topk_set`): the plain top-k of Ā, Eq. 3 itself: the largest ARR any k positions can reach
  (the ARR upper bound).
- `oracle` (`oracle_set`, the `--method oracle` policy): Eq. 6's layout with Ā in place of the estimates:
  sinks and the recent window protected, the rest of k filled by the top of Ā; the same protected positions
  as dustin's sets, so it isolates how well dustin's estimate ranks the unprotected positions."""
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
        self.per_layer[layer] = window_probs(q, k_cache, ctx.lengths, ctx.max_len, self.window).mean(1)


def window_probs(q: torch.Tensor, k_cache: torch.Tensor, lengths: torch.Tensor, max_len: int,
                 window: int = ARR_WINDOW) -> torch.Tensor:
    """Each query head's attention on the cached positions, averaged over the first `window` verify queries:
    [B, Hq, S] with S = max_len, zero at j >= lengths[b]. q [B, Hq, T, D] (after RoPE), k_cache [B, Hkv, S_cap, D]
    holding the T new tokens already; each query is normalized over every key it sees (the cached context and
    the new tokens up to itself), as the verify attention is. Averaging over heads gives Eq. 3's Ā of one layer."""
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    w = min(window, T)
    S = max_len
    # each KV head's G query heads x w queries as the rows of one fp32 matmul: K is read once, never repeated
    qg = q[:, :, :w].float().reshape(B, Hkv, (Hq // Hkv) * w, D)
    logits = (qg @ k_cache[:, :, :S].float().transpose(-1, -2)).view(B, Hq, w, S) / D ** 0.5
    mask = verify_mask(lengths, T, S)[:, :, :w]
    probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)  # [B, H, w, S]
    ctx_only = torch.arange(S, device=q.device)[None, :] < lengths.long()[:, None]
    return probs.mean(2) * ctx_only[:, None]


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


def _sorted_valid_first(top: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sort the first counts[b] picks of each row ascending and pad the rest with 0 (the kernels' format)."""
    k = top.shape[1]
    valid = torch.arange(k, device=top.device)[None] < counts[:, None]
    big = torch.iinfo(torch.int64).max
    ordered = torch.where(valid, top, torch.full_like(top, big)).sort(dim=1).values
    return torch.where(valid, ordered, torch.zeros_like(ordered)).to(torch.int32)


def topk_set(scores: torch.Tensor, lengths: torch.Tensor, k: int):
    """`oracle-topk` when scores = Ā: the k highest-scoring cached positions j < lengths[b] (all of them when
    lengths[b] <= k). Returns (indices int32 [B, min(k, S)] sorted, padded with 0; counts int32 [B])."""
    L = lengths.long().to(scores.device)
    j = torch.arange(scores.shape[1], device=scores.device)[None]
    k = min(k, scores.shape[1])
    top = scores.float().masked_fill(j >= L[:, None], float("-inf")).topk(k, dim=1).indices
    counts = torch.clamp(L, max=k).to(torch.int32)
    return _sorted_valid_first(top, counts), counts


def oracle_set(scores: torch.Tensor, lengths: torch.Tensor, k: int, sinks: int, window: int):
    """`oracle`: positions [0, sinks) and [L - window, L) always, the rest of k by the top of scores (Ā)."""
    L = lengths.long().to(scores.device)
    j = torch.arange(scores.shape[1], device=scores.device)[None]
    protected = (j < sinks) | ((j >= L[:, None] - window) & (j < L[:, None]))
    return topk_set(scores.float().masked_fill(protected, float("inf")), lengths, k)
