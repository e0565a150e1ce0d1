"""The KV-cache manager: it owns the caches of a batch and every operation that depends on their layout.

Today's layout is one contiguous row of `capacity` positions per slot, for each model of the pair (the target, and
the draft when it drafts), allocated once. The runner (dustin/engine/worker/, `ModelRunner`) only reads and writes
the caches it is given, by row and position; what copies or fills whole prompt regions (a prompt cache shared by n
sequences of one prompt, a snapshot of a batch's prompt caches for comparing methods, noise for benchmarks) lives
here, so a paged cache with prefix sharing can replace this class without touching the runner.
"""
from __future__ import annotations

import torch

from dustin.cache.kv_cache import KVCache
from dustin.models.args import ModelArgs
from dustin.models.transformer import Transformer

KVSnapshot = tuple[torch.Tensor, torch.Tensor]  # K and V of every layer, row and KV head, positions [0, n)


def cache_capacity(prompt_lens: list[int], limits: list[int], gamma: int) -> int:
    """KV positions per sequence a generation allocates: the longest prompt + its new tokens + 3Γ + 4. The one
    place this arithmetic lives. Why 3Γ + 4, for a prompt of n tokens and a limit of m: a sequence still running
    has at most n + m - 2 cached positions (its newest token, `pending`, is not cached yet); its last step adds
    up to Γ + 1 (drafts accepted past the limit are dropped from the output, not from the cache); in
    the engine loop the device learns of the stop one step late, so one more step adds up to Γ + 1 again: the
    length freezes at <= n + m + 2Γ. A frozen row still runs every step's forwards, which write Γ + 1 junk rows
    from its length on: up to position n + m + 3Γ, so n + m + 3Γ + 1 positions; + 3 spare. (The CUDA-graph
    warm-up scratch of `GraphedForward`, Γ + 1 rows at the tail, is only written at capture, when no row is
    anywhere near the tail; junk of frozen rows may land there later, which is harmless.)"""
    return max(n + m for n, m in zip(prompt_lens, limits, strict=False)) + 3 * gamma + 4


def kv_bytes(args: list[ModelArgs], element_size: int, slots: int, capacity: int) -> int:
    """Bytes the caches of `slots` rows x `capacity` positions take for models of these shapes (K and V)."""
    return sum(a.kv_bytes_per_token(element_size) for a in args) * capacity * slots


class KVManager:
    """The caches of one batch: `caches[name]` per model ("target", "draft"), `slots` rows of `capacity`
    positions each."""

    def __init__(self, models: dict[str, Transformer], slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.caches: dict[str, KVCache] = {}
        for name, model in models.items():
            a, w = model.args, model.embed_tokens.weight
            self.caches[name] = KVCache(a.n_layers, slots, a.n_kv_heads, a.head_dim, capacity, w.dtype, w.device)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row `dst` takes row `src`'s first n positions, in every model's cache (n sequences of one prompt)."""
        for c in self.caches.values():
            c.k[:, dst, :, :n].copy_(c.k[:, src, :, :n])
            c.v[:, dst, :, :n].copy_(c.v[:, src, :, :n])

    def snapshot(self, name: str, n: int) -> KVSnapshot:
        """A copy of the first n positions of every row of one model's cache."""
        c = self.caches[name]
        return c.k[..., :n, :].clone(), c.v[..., :n, :].clone()

    def restore(self, name: str, snap: KVSnapshot) -> None:
        """Write a `snapshot` back over the first positions of every row."""
        c, n = self.caches[name], snap[0].shape[-2]
        c.k[..., :n, :].copy_(snap[0])
        c.v[..., :n, :].copy_(snap[1])

    def fill_noise(self, n: int, generator: torch.Generator) -> None:
        """Standard-normal K and V at the first n positions of every row of every cache (benchmarks: a decode
        step's cost does not depend on the values). Layer by layer, so no temporary of a whole cache's size."""
        for c in self.caches.values():
            for layer in range(c.k.shape[0]):
                c.k[layer, ..., :n, :].normal_(generator=generator)
                c.v[layer, ..., :n, :].normal_(generator=generator)
