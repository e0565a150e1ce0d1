"""The selection tests' own `cpu_paths`: per test, as these modules mix end-to-end runs on the CPU's PyTorch paths
with tests of the interpreted kernels (tests/conftest.py's is per module); and the tiny pair's engine, per module."""
from __future__ import annotations

import pytest

from dustin.engine.engine import Engine
from dustin.models.loader import load_model
from tests.conftest import on_cpu_paths


@pytest.fixture
def cpu_paths():
    """The test runs `on_cpu_paths()`."""
    with on_cpu_paths():
        yield


@pytest.fixture(scope="module")
def engine(tiny_pair):
    """An engine over the tiny pair, shared by a module's end-to-end tests."""
    return Engine.from_models(load_model(tiny_pair[0]), load_model(tiny_pair[1]))
