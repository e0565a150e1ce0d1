"""How dustin launches its Triton kernels: through one seam it can watch, and with Programmatic Dependent Launch.

The seam: every Triton kernel dustin launches is decorated `@watched` (above `@triton.jit`) and launched as usual,
`kernel[grid](*args, **kwargs)`. Outside a `watch_launches` block that is Triton's own launch, the same call. Inside
one, this thread's launches are shown to a callback and run only if asked. The engine's warm-up
(dustin/engine/warmup.py) plans its compiles from exactly the launches a dry run of the first step makes, and
Triton has no public way to see them without running them; this seam gives that view from our side, so nothing of
Triton's is replaced (tests/kernels/test_launch.py checks that every kernel launched under dustin/ is watched).

PDL, for the kernels of a decode / verify step:

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

import contextlib
import functools
import os
import threading
from collections.abc import Callable

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


# ------------------------------------------------------------------------------------------------ the launch seam
_watch = threading.local()  # .on: (on_launch, execute) while a watch_launches block of this thread is open


class Watched:
    """A Triton kernel (`jit`: Triton's JITFunction, or the interpreter's function) launched through dustin's seam:
    `kernel[grid](*args, **kwargs)` is Triton's launch unless this thread is in a `watch_launches` block."""

    __slots__ = ("jit",)

    def __init__(self, jit) -> None:
        self.jit = jit

    @property
    def __name__(self) -> str:
        return self.jit.fn.__name__

    def __getitem__(self, grid):
        on = getattr(_watch, "on", None)
        if on is None:  # the hot path: Triton's own launcher, one thread-local read added
            return self.jit[grid]
        return functools.partial(_watched_launch, self.jit, grid, on)

    def __repr__(self) -> str:
        return f"watched({self.__name__})"


def _watched_launch(jit, grid, on, *args, **kwargs):
    on_launch, execute = on
    on_launch(jit, args, kwargs)
    return jit[grid](*args, **kwargs) if execute else None


def watched(jit) -> Watched:
    """Decorator, above `@triton.jit`: the kernel's launches pass through the seam (module docstring)."""
    return Watched(jit)


@contextlib.contextmanager
def watch_launches(on_launch: Callable, execute: bool):
    """Within the block, each launch of a `watched` kernel on this thread first calls `on_launch(jit, args,
    kwargs)` (jit: Triton's kernel object; args and kwargs as given to the launch), then runs only if `execute`.
    Other threads' launches are untouched; blocks nest (the inner one applies until it closes)."""
    outer = getattr(_watch, "on", None)
    _watch.on = (on_launch, execute)
    try:
        yield
    finally:
        _watch.on = outer
