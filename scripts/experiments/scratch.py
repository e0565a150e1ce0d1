"""(Used by the experiment here only: select_radix.py; moved out of dustin/kernels/ with it; the engine's
kernels use dustin/kernels/arrival.py.)
Zero-initialised int32 device buffers that kernels leave at zero when they finish (split counters,
histograms), so a launch needs no memset of its own.

One buffer per (purpose, device), grown on demand. A buffer that is outgrown is kept alive, not freed:
a CUDA graph captured earlier may still point at it. While a graph is being captured a too-small buffer is
not grown (that memory would belong to the graph's pool); the graph gets its own zeroed buffer instead, a
memset node that is replayed with it."""
from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def zeroed_int32(purpose: str, device: torch.device, n: int, minimum: int = 1024) -> torch.Tensor:
    """An int32 buffer of at least n zeros for `purpose`; the caller's kernels must leave it zeroed."""
    device = torch.device(device)
    key = (purpose, device)
    buf = _BUFFERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    if buf is not None:
        _OUTGROWN.append(buf)
    _BUFFERS[key] = torch.zeros(max(n, minimum), dtype=torch.int32, device=device)
    return _BUFFERS[key]
