"""The KV-cache manager: it owns the memory of a batch's caches and every operation that depends on their layout.

What it owns, each rule written once here:
- the capacity rule: how many model positions a sequence may take (`positions_needed`, held against the model
  context), how many cache positions a slot allocates for it (`cache_capacity`: those and the junk rows a stopped
  row still writes), and the largest `max_tokens` a prompt may ask of a context (`max_tokens_room`, the server's
  headroom);
- bytes per cached token and whether a batch's caches fit in the device's free memory (`bytes_per_token`,
  `kv_bytes`, `MemoryFit`);
- which slot each sequence holds (`SlotTable`: the lowest free slot first), and the blocks of each slot's row (a
  block table per row, today one block: the whole row), the seam a paged allocator replaces.

Today's layout is one contiguous row of `capacity` positions per slot, for each model of the pair (the target, and
the draft when it drafts), allocated once. The runner (dustin/engine/worker/, `ModelRunner`) only reads and writes
the caches it is given, by row and position; what copies or fills whole prompt regions (a prompt cache shared by n
sequences of one prompt, a snapshot of a batch's prompt caches for comparing methods, noise for benchmarks) lives
here, so a paged cache with prefix sharing can replace this class without touching the runner.
"""
from __future__ import annotations

import gc

import torch

from dustin.cache.kv_cache import KVCache
from dustin.errors import OutOfMemoryError
from dustin.models.args import ModelArgs
from dustin.models.transformer import Transformer

KVSnapshot = tuple[torch.Tensor, torch.Tensor]  # K and V of every layer, row and KV head, positions [0, n)


def positions_needed(prompt_len: int, max_tokens: int, gamma: int) -> int:
    """Model positions a sequence of a `prompt_len`-token prompt and up to `max_tokens` new tokens may write its
    tokens at: the prompt, the new tokens, and the Γ + 1 of the step that reaches its limit (drafts accepted past
    it are dropped from the output, not from the cache). Held against the model context: RoPE is only defined up to
    it."""
    return prompt_len + max_tokens + gamma + 1


def max_tokens_room(context: int, prompt_len: int, gamma: int) -> int:
    """The largest max_tokens a prompt of `prompt_len` tokens may ask within `context` positions (`positions_needed`
    solved for it; < 1: none)."""
    return context - prompt_len - gamma - 1


def cache_capacity(prompt_lens: list[int], limits: list[int], gamma: int) -> int:
    """KV positions per slot a generation allocates: `positions_needed` of its longest sequence and 2Γ + 3 more,
    n + m + 3Γ + 4 for a prompt of n tokens and a limit of m. Why: a sequence still running has at most n + m - 2
    cached positions (its newest token, `pending`, is not cached yet); its last step adds up to Γ + 1; in the engine
    loop the device learns of the stop one step late, so one more step adds up to Γ + 1 again: the length freezes at
    <= n + m + 2Γ. A frozen row still runs every step's forwards, which write Γ + 1 junk rows from its length on: up
    to position n + m + 3Γ, so n + m + 3Γ + 1 positions; + 3 spare. (The CUDA-graph warm-up scratch of
    `GraphedForward`, Γ + 1 rows at the tail, is only written at capture, when no row is anywhere near the tail;
    junk of frozen rows may land there later, which is harmless.)"""
    return max(positions_needed(n, m, gamma) for n, m in zip(prompt_lens, limits, strict=False)) + 2 * gamma + 3


def bytes_per_token(args: list[ModelArgs], element_size: int) -> int:
    """Bytes one cached position takes in the caches of models of these shapes (K and V of every layer)."""
    return sum(a.kv_bytes_per_token(element_size) for a in args)


def kv_bytes(args: list[ModelArgs], element_size: int, slots: int, capacity: int) -> int:
    """Bytes the caches of `slots` rows x `capacity` positions take for models of these shapes (K and V)."""
    return bytes_per_token(args, element_size) * capacity * slots


def free_memory(device: torch.device) -> int | None:
    """Free bytes of the device (a CPU's: MemAvailable), None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class MemoryFit:
    """Whether caches of models of these shapes fit on `device`: in 90% of its free memory (the rest is work
    space: activations, logits, graph pools)."""

    SHARE = 0.9

    def __init__(self, args: list[ModelArgs], element_size: int, device: torch.device) -> None:
        self.args, self.element_size, self.device = args, element_size, device

    def bytes(self, batch: int, capacity: int) -> int:
        return kv_bytes(self.args, self.element_size, batch, capacity)

    def fits(self, batch: int, capacity: int, copies: int = 1) -> bool:
        """Whether caches for `batch` x `capacity` positions, held `copies` times, fit. True where free memory is
        unknown."""
        free = free_memory(self.device)
        return free is None or copies * self.bytes(batch, capacity) <= self.SHARE * free

    def require(self, batch: int, capacity: int, copies: int = 1,
                advice: str = "lower the batch size, the prompt length or --max-new-tokens") -> None:
        """Refuse, with one line, caches for `batch` x `capacity` positions held `copies` times (a comparison over
        one shared prefill holds a batch's caches and the prefill's copy of them) that would not fit; the line says
        how many sequences would."""
        if batch < 1 or capacity < 1 or copies < 1:
            raise ValueError(f"a batch needs >= 1 sequence, position and copy, got {batch}, {capacity}, {copies}")
        need = copies * self.bytes(batch, capacity)
        if not self.fits(batch, capacity, copies) and self.device.type == "cuda":
            # memory of finished batches may still sit in PyTorch's cache or in unreachable graph pools: give it
            # back before refusing (an `Engine` drops its kept engine core itself, `Engine.release_cached`)
            gc.collect()
            torch.cuda.empty_cache()
        if not self.fits(batch, capacity, copies):
            free = free_memory(self.device)
            held = "" if copies == 1 else f", held {copies} times,"
            fits = int(self.SHARE * free // max(need // batch, 1))
            raise OutOfMemoryError(f"the KV caches for {batch} sequences x {capacity} positions{held} need "
                                   f"{need / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB of {self.device} "
                                   f"memory is free ({fits} sequences would fit): {advice}")


class SlotTable:
    """Which slot (cache row) each sequence holds, and the blocks of each held row. The scheduler takes a slot per
    admitted sequence (the lowest free one, so which row a request gets does not depend on the order rows were
    freed) and gives it back when the sequence leaves. Host-only bookkeeping: the scheduler decides with it and
    never touches the caches.

    The block table per row is the seam of a paged cache: today a row is one block, the whole row of `capacity`
    positions (block id = row). A paged allocator would hand out fixed-size blocks as a row grows; the runner and
    the kernels would then read `block_table(row)` instead of assuming the row."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a slot table needs >= 1 slot, got {slots}")
        self.slots = slots
        self._free = list(range(slots))
        self._tables: dict[int, list[int]] = {}

    @property
    def n_free(self) -> int:
        return len(self._free)

    def free_rows(self) -> list[int]:
        """The free slots, lowest first."""
        return list(self._free)

    def allocate(self) -> int:
        """The lowest free slot, now held (its block table: the whole row)."""
        if not self._free:
            raise RuntimeError("no free KV-cache slot: the scheduler admits only while n_free > 0")
        row = self._free.pop(0)
        self._tables[row] = [row]
        return row

    def release(self, row: int) -> None:
        """A held slot becomes free again."""
        if row not in self._tables:
            raise RuntimeError(f"slot {row} is not held")
        del self._tables[row]
        self._free.append(row)
        self._free.sort()

    def block_table(self, row: int) -> list[int]:
        """The blocks of a held row, in position order (today one: the row itself)."""
        return list(self._tables[row])


class KVManager:
    """The caches of one batch: `caches[name]` per model ("target", "draft"), `slots` rows of `capacity`
    positions each, and `table`, which slot each sequence holds (`SlotTable`)."""

    def __init__(self, models: dict[str, Transformer], slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.table = SlotTable(slots)
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
