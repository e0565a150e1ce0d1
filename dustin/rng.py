"""A counter-based random number generator on torch int64 tensors (splitmix64), for draws that must depend only
on what belongs to a row: the engine's per-row sampling (dustin/engine/sampling.py, `RowSampling`) and the
sampled tail of sparse verification (dustin/selection/tail.py). Its state is a seed and an offset per row, two
device tensors a CUDA graph replays by reading them; a row's numbers never depend on the batch or on other rows.
It sits below both packages (docs/architecture.md's layers)."""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def i64(x: int) -> int:
    """A 64-bit constant as the signed value torch's int64 arithmetic wraps around to."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = i64(0x9E3779B97F4A7C15), i64(0xBF58476D1CE4E5B9), i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors: a bijection of the 64-bit values that spreads every input bit over
    the output (distinct inputs give distinct outputs)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def counter_bits(seeds: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Random int64 [B, n] from a counter-based generator: draw j of row b is splitmix64(seed[b] + golden *
    (offset[b] + j)). A row's numbers depend only on its own seed and how many it drew before, never on the batch
    or on other rows' draws, and the state is two device tensors: a CUDA graph replays it by reading them (callers
    advance `offsets` in place). Within a row, fewer than 2^64 draws are all distinct (golden is odd and the
    finalizer a bijection): sorting by them is a uniform random order without ties."""
    j = offsets[:, None] + torch.arange(n, device=seeds.device)[None, :]
    return mix64(seeds[:, None] + j * _GOLDEN)


def counter_uniform(seeds: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """U[0, 1) noise [B, n]: the top 24 bits of `counter_bits` as a float."""
    return _shr(counter_bits(seeds, offsets, n), 40).float() * (1.0 / (1 << 24))


def below(bits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """A uniform integer in [0, n) from random int64 `bits` (any shape, `n` broadcast, 1 <= n < 2^31): the top 31
    bits scaled by n, (u * n) >> 31, in integers, so that the same bits give the same number on every device. Its
    bias, at most n / 2^31 in probability, is far below what any sample of a cache could resolve."""
    return (_shr(bits, 33) * n) >> 31
