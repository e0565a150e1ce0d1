"""Arrival counters: the program of a group that finishes last finishes the group's work, in the same launch.

Why: a split-K GEMM or a flash-decoding attention cuts one output tile's reduction over several programs (more
SMs busy on a skinny problem). Their partials used to be reduced by a second, small kernel; in a CUDA-graph step
of ~1,000 kernels each such launch costs a few us of launch and ramp, more than the reduction itself. Here every
program writes its partial, then bumps the tile's counter; the one that arrives last sees every partial, reduces
them in a fixed order (split 0, 1, ...: the result does not depend on which program came last) and writes the
output.

Memory order: `last_to_arrive` puts a CTA barrier between the partial stores of all the program's threads and the
counter's release-acquire atomic (gpu scope), so a program's partial is visible before its arrival counts; the
last program then reads the partials through L2 (loads with `cache_modifier=".cg"`: another SM's writes are not in
this SM's L1). The last program also resets the counter, so the buffer is all zeros between launches and a CUDA
graph replays without a memset.

One int32 buffer per device (`arrival_counters`), shared by every kernel that counts arrivals: kernels of one
stream run one after the other, and each leaves its slots at zero. Under Programmatic Dependent Launch a kernel
touches memory only after its predecessor completed (dustin/kernels/launch.py), which keeps that true.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dustin.kernels.dispatch import is_fake

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
MIN_SLOTS = 4096


def zeroed_int32(purpose: str, device: torch.device | str, n: int, minimum: int = MIN_SLOTS) -> torch.Tensor:
    """An int32 buffer of at least n zeros for `purpose` on `device`; the kernels given it must leave it zeroed.

    One buffer per (purpose, device), grown on demand. An outgrown buffer is kept alive, not freed: a CUDA graph
    captured earlier may still point at it. During a capture a too-small buffer is not grown (that memory would
    belong to the graph's pool); the graph gets its own zeroed buffer instead (a memset node replayed with it). A buffer
    made under a fake tensor mode (the engine warm-up's dry run) is returned, not kept."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (purpose, device)
    buf = _BUFFERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    made = torch.zeros(max(n, minimum), dtype=torch.int32, device=device)
    if is_fake(made):  # the warm-up's dry run: a fake buffer is never kept (a real launch would read address 0)
        return made
    if buf is not None:
        _OUTGROWN.append(buf)
    _BUFFERS[key] = made
    return made


def arrival_counters(device: torch.device | str, n: int) -> torch.Tensor:
    """The arrival counters of `device` (at least n, all zero between launches): one buffer shared by every
    kernel that counts arrivals (module docstring)."""
    return zeroed_int32("arrivals", device, n)


@triton.jit
def last_to_arrive(cnt_ptr, slot, n_arrivals):
    """Call after this program stored its partial for group `slot` (of `n_arrivals` programs): True in exactly one
    program, the last to arrive, which may then read every partial of the group (with `.cg` loads). That program
    has already reset the counter for the next launch."""
    tl.debug_barrier()  # every thread's partial is stored before the release below
    arrived = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel")
    last = arrived == n_arrivals - 1
    if last:
        tl.atomic_xchg(cnt_ptr + slot, 0)
    return last


@triton.jit
def merge_partial(m_all, l_all, acc, m_s, l_s, acc_s):
    """Fold one split's attention partial into running totals, by log-sum-exp: m is the rows' running max logit
    (log2 units), l the sum of exp2(logit - m), acc the [rows, D] sum of those weights times V. Returns the new
    (m, l, acc). Both split-attention merges (dense and sparse verify) take their partials in split order through
    this one step. A row no split has seen yet keeps m = -inf: `m_safe` keeps -inf - -inf from making NaNs."""
    m_new = tl.maximum(m_all, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_all - m_safe)
    beta = tl.exp2(m_s - m_safe)
    return m_new, l_all * alpha + l_s * beta, acc * alpha[:, None] + acc_s * beta[:, None]

