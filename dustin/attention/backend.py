"""Attention backends: how a forward attends, given the cache and the plan in `ForwardContext`.

- `sdpa`: PyTorch scaled_dot_product_attention with a boolean mask (a float one for a plan with log-weights,
  `SparsePlan.bias`), each KV group's query heads folded into the query-length dimension so K/V are never
  repeated. Runs everywhere; the CPU default.
- `triton`: our split-K (flash-decoding) GQA kernels for the verify / decode step and for sparse
  verification over an index list. The GPU default (see docs/benchmarks.md for the measurements).
Prefill of one fresh sequence uses SDPA's causal kernel over the prompt itself; a packed prefill (prompt chunks of
several rows in one forward, the engine loop's path) takes `prefill_packed`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dustin.attention.context import SparsePlan
from dustin.attention.reference import verify_mask
from dustin.attention.sdpa import verify_attention_sdpa
from dustin.kernels.dispatch import interpreting

BACKENDS = ("sdpa", "triton")
MAX_TRITON_QUERIES = 16  # verify kernels fold G*T rows into one tile; longer chunks go to SDPA


def sparse_mask(lengths: torch.Tensor, plan: SparsePlan, T: int, S: int) -> torch.Tensor:
    """[B, H, T, S] mask: the selected cached positions plus the new tokens, causally. H = 1 for a
    per-sequence plan (indices [B, K]), Hkv for per-KV-head lists (indices [B, Hkv, K], e.g. Quest). A `dense` row
    sees every cached position."""
    indices = plan.indices if plan.indices.dim() == 3 else plan.indices[:, None]
    counts = plan.counts if plan.counts.dim() == 2 else plan.counts[:, None]
    B, H, K = indices.shape
    valid = torch.arange(K, device=lengths.device)[None, None, :] < counts[:, :, None]
    # Add, don't assign: padding slots hold position 0, and a plain scatter_ of their False could land
    # after (and erase) the True of a real pick of position 0 (duplicate-index scatter order is undefined).
    hits = torch.zeros(B, H, S, dtype=torch.int32, device=lengths.device)
    selected = hits.scatter_add_(2, indices.long().clamp_max(S - 1), valid.to(torch.int32)) > 0
    j = torch.arange(S, device=lengths.device)
    old = j[None, None, :] < lengths.long()[:, None, None]  # [B, 1, S]; picks past lengths[b] are ignored
    if plan.dense is not None:
        selected = selected | plan.dense[:, None, None]
    causal_new = verify_mask(lengths, T, S)[:, 0] & ~old
    return (selected & old)[:, :, None, :] | causal_new[:, None]


def weighted_mask(lengths: torch.Tensor, plan: SparsePlan, T: int, S: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, T, S] additive mask of a plan with log-weights (`SparsePlan.bias`): a gathered position's bias where
    `sparse_mask` lets a query see it, 0 for the new tokens and for every position of a `dense` row, -inf where it
    does not. In `dtype`, the queries' (SDPA takes a float mask of their type)."""
    seen = sparse_mask(lengths, plan, T, S)
    indices = plan.indices if plan.indices.dim() == 3 else plan.indices[:, None]
    counts = plan.counts if plan.counts.dim() == 2 else plan.counts[:, None]
    bias = plan.bias if plan.bias.dim() == 3 else plan.bias[:, None]
    B, H, K = indices.shape
    valid = torch.arange(K, device=lengths.device)[None, None, :] < counts[:, :, None]
    # Add, as sparse_mask does: padding slots (position 0) add 0, so they cannot overwrite a real pick of position 0
    weights = torch.zeros(B, H, S, dtype=torch.float32, device=lengths.device).scatter_add_(
        2, indices.long().clamp_max(S - 1), torch.where(valid, bias.float(), 0.0))
    j = torch.arange(S, device=lengths.device)
    weights = weights * (j[None, None, :] < lengths.long()[:, None, None])  # picks past lengths[b] are ignored
    if plan.dense is not None:
        weights = torch.where(plan.dense[:, None, None], 0.0, weights)
    return torch.where(seen, weights[:, :, None, :], float("-inf")).to(dtype)


class AttentionBackend:
    def __init__(self, name: str = "sdpa") -> None:
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
        self.name = name

    @classmethod
    def for_device(cls, device: torch.device | str, name: str = "auto") -> "AttentionBackend":
        if name == "auto":
            name = "triton" if torch.device(device).type == "cuda" and _triton_available() else "sdpa"
        return cls(name)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        G = q.shape[1] // k.shape[1]
        if G > 1:  # once per prompt: repeating K/V keeps every SDPA kernel (flash included) available
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def prefill_packed(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan) -> torch.Tensor:
        """Prompt chunks of several rows (q [Hq, N, D], packed), each causal over its row's cached prefix: our
        Triton kernel (dustin/kernels/prefill_attention.py) on the GPU, SDPA per chunk elsewhere."""
        from dustin.kernels import prefill_attention as pa  # lazy: Triton

        if self.name == "triton" and (q.is_cuda or interpreting()):
            return pa.prefill_attention(q, k_cache, v_cache, plan)
        return pa.prefill_attention_sdpa(q, k_cache, v_cache, plan)

    def verify(self, q, k_cache, v_cache, lengths, *, sinks=0, window=0, max_len: int):
        """q [B, Hq, T, D] -> [B, Hq, T, D]; the Triton kernels write it token-major (see `token_major`)."""
        if self.name == "triton" and q.shape[2] <= MAX_TRITON_QUERIES:
            from dustin.kernels.verify_attention import verify_attention  # lazy: Triton
            return verify_attention(q, k_cache, v_cache, lengths, sinks=sinks, window=window, max_len=max_len,
                                    out=token_major(q))
        return verify_attention_sdpa(q, k_cache, v_cache, lengths, sinks=sinks, window=window, max_len=max_len)

    def sparse_verify(self, q, k_cache, v_cache, lengths, plan: SparsePlan, *, max_len: int):
        """The new tokens' attention over the plan's positions, each weighted by its log-weight where the plan has
        them (`SparsePlan.bias`: the Triton kernel reads them next to the indices; SDPA takes a float mask)."""
        if self.name == "triton" and q.shape[2] <= MAX_TRITON_QUERIES:
            from dustin.kernels.sparse_verify import sparse_verify_attention  # lazy: Triton
            if plan.dense is None:
                return sparse_verify_attention(q, k_cache, v_cache, lengths, plan.indices, plan.counts,
                                               log_weights=plan.bias, out=token_major(q))
            return self._dense_or_sparse(q, k_cache, v_cache, lengths, plan, max_len)
        S = min(max_len, k_cache.shape[2])
        T = q.shape[2]
        mask = sparse_mask(lengths, plan, T, S) if plan.bias is None else weighted_mask(lengths, plan, T, S, q.dtype)
        return verify_attention_sdpa(q, k_cache, v_cache, lengths, max_len=S, mask=mask)


    def _dense_or_sparse(self, q, k_cache, v_cache, lengths, plan: SparsePlan, max_len: int) -> torch.Tensor:
        """A plan with `dense` rows: both kernels over the whole batch, each reading only its own rows' keys (the
        sparse kernel a dense row's new tokens only, its count 0; the dense kernel a sparse row's first T positions
        only, its length 0: both return at once past a row's range), then each row's own output. Fixed shapes and no
        host sync, so a step with it is still one CUDA graph."""
        from dustin.kernels.sparse_verify import sparse_verify_attention  # lazy: Triton
        from dustin.kernels.verify_attention import verify_attention  # lazy: Triton

        dense = plan.dense.view(-1, *([1] * (plan.counts.dim() - 1)))
        sparse = sparse_verify_attention(q, k_cache, v_cache, lengths, plan.indices,
                                         torch.where(dense, 0, plan.counts), log_weights=plan.bias, out=token_major(q))
        full = verify_attention(q, k_cache, v_cache, torch.where(plan.dense, lengths, 0), max_len=max_len,
                                out=token_major(q))
        return torch.where(plan.dense[:, None, None, None], full, sparse)


def token_major(q: torch.Tensor) -> torch.Tensor:
    """An empty [B, Hq, T, D] attention output whose memory is [B, T, Hq, D]: the o_proj input
    `out.transpose(1, 2).reshape(B, T, Hq * D)` is then a view, not a copy kernel per layer (the target's verify
    forward of T = Γ + 1 tokens paid one per layer). For T = 1 both layouts are the same memory."""
    B, H, T, D = q.shape
    return torch.empty(B, T, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
