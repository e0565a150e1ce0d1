"""Which implementation runs: our Triton kernel or its PyTorch reference. This module imports no Triton, so the
layers above the kernels (attention, selection, the engine's warm-up) can ask it on machines without Triton."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton kernels run on its CPU interpreter (TRITON_INTERPRET=1: the tests, on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_ok(x: torch.Tensor) -> bool:
    """Whether our head-dimension kernels take x [..., D]: Triton runs where x lives (a GPU, or the interpreter on
    the CPU) and D is a power of two >= 16. Otherwise callers take the kernel's PyTorch reference."""
    D = x.shape[-1]
    return D >= 16 and D & (D - 1) == 0 and (x.is_cuda or interpreting())


def is_fake(t) -> bool:
    """Whether t is a fake tensor (metadata, no storage): what the engine warm-up's dry run passes
    (dustin/engine/warmup.py). Code that keeps tensors beyond a call (per-device buffers, plans) keeps only real ones,
    and nothing launches on a fake one."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(t, torch.Tensor) and _is_fake(t)
