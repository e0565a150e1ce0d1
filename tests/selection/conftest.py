"""The selection tests' own `cpu_paths`: per test, as these modules mix end-to-end runs on the CPU's PyTorch paths
with tests of the interpreted kernels (tests/conftest.py's is per module)."""
from __future__ import annotations

import pytest

from tests.conftest import on_cpu_paths


@pytest.fixture
def cpu_paths():
    """The test runs `on_cpu_paths()`."""
    with on_cpu_paths():
        yield
