"""Programmatic Dependent Launch (PDL) for the Triton kernels of a decode / verify step.

Why: a speculative step replays ~1,200 small kernels in one CUDA graph (5-7 us each), most of them ours back to
back (per draft layer: q/k/v + RoPE, the attention, o_proj, gate/up + SiLU, down_proj). Between two of them the
GPU drains the first grid, then launches and ramps up the second. On Hopper (sm_90+) a grid launched with PDL
may be scheduled while its predecessor in the stream still runs, hiding that gap.

Measured (one H200, 2026-12-02, `scripts/gpu_step_anatomy.py`, random weights of the default pair's shapes,
16 x 32k, tau 3.7 acceptance-controlled, run with DUSTIN_PDL=1 and without): dustin 7.78 -> 7.54 ms/step (-3%),
but vanilla 5.04 -> 5.57 ms (+10%), same 203 / 1,212 kernels per step. Vanilla's step is a few long attention
grids of several waves between skinny GEMMs; a successor scheduled early takes SM slots from the last wave (the
likely cause, not profiled). So PDL is OPT-IN (`DUSTIN_PDL=1`) until the trigger is placed per kernel (early only
in single-wave kernels such as the decode-layer GEMMs).

How: every kernel launched in the step takes a `PDL: tl.constexpr` and calls `pdl_start(PDL)` as its FIRST
statement, before any load, store or atomic (of scalars, of pointers read from memory, of counters too), and is
launched with `launch_pdl=pdl`:
- `gdc_wait()` blocks until the predecessor grid has completed and its writes are visible. Nothing of the kernel
  touches memory before it (tests/kernels/test_kernels_compile.py checks the PTX), so correctness never depends on PDL:
  the kernel reads and writes exactly what plain stream order would give it, only its launch is earlier.
- `gdc_launch_dependents()` then lets the successor be scheduled. Its programs may take SM slots while this
  kernel still runs; that is safe because every successor waits first, and it cannot starve this kernel: the
  successor launches only once every program of this kernel has issued the trigger (is running) or exited.
  Transitivity: kernel n + 2 waits for n + 1 to complete, and n + 1 completed only after its own wait for n
  returned; so at most two of our grids are in flight, and state reused across launches (the split-K arrival
  counters of decode_linear, reset by the last program of each tile) is seen as any later launch in the stream
  would see it.
- Neighbours that are not ours (cuBLAS, PyTorch ops, NCCL) never trigger early and are launched without PDL, so
  they keep plain stream order on both sides.

The CPU interpreter (TRITON_INTERPRET=1) does not implement these ops: with PDL False the constexpr `if` drops them.
`DUSTIN_PDL=1` turns PDL on (off by default, see above); like the capability, it is read once per device in a
process.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dustin.kernels.dispatch import interpreting


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: wait for the predecessor grid, then let the successor launch (module docstring).
    Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _cuda_pdl(index: int) -> bool:
    if interpreting() or os.environ.get("DUSTIN_PDL") != "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: DUSTIN_PDL=1, a CUDA device of compute capability 9.0 or newer,
    and the Triton interpreter off. Cached per device index (`clear_cache()` forgets it)."""
    if device.type != "cuda":
        return False
    return _cuda_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_options(device: torch.device) -> dict:
    """The launch keywords of a kernel on `device`: its `PDL` constexpr and Triton's `launch_pdl`, always equal."""
    pdl = use_pdl(device)
    return {"PDL": pdl, "launch_pdl": pdl}


def clear_cache() -> None:
    _cuda_pdl.cache_clear()


H200_NUM_SMS = 132  # the SM count that shape rules assume where a launch's shape must not depend on the device


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device, cpu: int) -> int:
    """The SM count of a CUDA device, by which the kernels size their grids and splits; `cpu`: the count a launch
    on CPU tensors (the interpreter) assumes, which the kernel's tests pin their split counts to."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu
