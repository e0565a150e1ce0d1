"""The selection tests' own fixture: end-to-end runs on the CPU's PyTorch paths."""
from __future__ import annotations

import contextlib

import pytest

from tests.conftest import without_interpreter


@contextlib.contextmanager
def on_cpu_paths():
    """TRITON_INTERPRET unset inside (`without_interpreter`): the engine estimates and selects with the CPU's
    PyTorch code, as `eval tasks` and a user's CPU run it. For the end-to-end tests of what a policy selects, reads
    and reports, whose subject is not a kernel: under the interpreter every decode step's selection ran Triton's
    interpreted tl.sort (select_dustin's `_assemble_kernel`), ~1.7 s a row and layer on this 2-core machine and
    99% of those tests' time (profiled: test_tail.py's budget test, 190 of 197 s). The Triton path keeps its own
    tests: tests/kernels holds each kernel to its PyTorch code (select_dustin both ways, on odd shapes),
    test_selection.py's test_triton_kernels_give_the_same_sparse_decoding runs dustin on the Triton kernels in the
    engine against these PyTorch paths, and tests/engine runs dustin, quest and specattn under the interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        without_interpreter(mp)
        yield


@pytest.fixture
def cpu_paths():
    """The test runs `on_cpu_paths()`."""
    with on_cpu_paths():
        yield
