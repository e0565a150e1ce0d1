"""Batched KV cache with per-sequence lengths.

Layout: one K and one V buffer of shape [n_layers, B, H_kv, S_cap, D] (gpt-fast style, preallocated).
Why this layout: the verify step streams each sequence's K/V for one KV head from HBM; with [.., H_kv, S, D]
a (sequence, head) slice is one contiguous run of S*D elements, so a split-K kernel reads long coalesced
tiles, and PyTorch SDPA takes [B, H, S, D] without a copy. Sequences of different lengths share the buffer;
`lengths[b]` says how many positions of sequence b are valid. Appending writes T new positions per sequence
at lengths[b]..lengths[b]+T-1 with one scatter (no host sync); rollback of rejected tokens only lowers
`lengths` (stale rows are masked out by attention and overwritten by the next append).
"""
from __future__ import annotations

import torch

from dustin.errors import InputError, OutOfMemoryError


class KVCache(torch.nn.Module):
    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (n_layers, batch_size, n_kv_heads, capacity, head_dim)
        nbytes = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        try:
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros(shape, dtype=dtype, device=device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "alloc" not in str(e).lower():
                raise
            raise OutOfMemoryError(
                f"KV cache for batch {batch_size} x {capacity} positions needs {nbytes / 2**30:.1f} GiB on {device}, "
                f"which does not fit: lower the batch size, the prompt length or --max-new-tokens") from None
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.int32, device=device), persistent=False)
        self.capacity = capacity
        self.batch_size = batch_size

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    def reset(self) -> None:
        self.lengths.zero_()

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor,
              rows: torch.Tensor | slice | None = None) -> None:
        """Store k_new/v_new ([B, H_kv, T, D]) at `positions` ([B, T]) of layer `layer` (no host sync).

        `rows` selects the batch rows being written (prefill writes one sequence at a time)."""
        kc, vc = self.k[layer], self.v[layer]
        if rows is not None:
            kc, vc = kc[rows], vc[rows]
        idx = positions[:, None, :, None].expand(-1, k_new.shape[1], -1, k_new.shape[3])
        kc.scatter_(2, idx, k_new.to(kc.dtype))
        vc.scatter_(2, idx, v_new.to(vc.dtype))

    def check_room(self, needed: int) -> None:
        """Host-side guard used before a step: raise if some sequence would run past the capacity."""
        if needed > self.capacity:
            raise InputError(f"KV cache capacity {self.capacity} exceeded (needs {needed} positions)")
