"""The TMA skinny GEMM (an experiment the engine does not run: scripts/experiments/tma_skinny.py) against PyTorch
under the Triton interpreter: ragged rows, N not a multiple of the tile, K split into parts that end mid-tile, and
the engine's decode_linear variants the script times beside it."""
from __future__ import annotations

import pytest
import torch

from scripts.experiments.tma_skinny import tma_linear, variants_of


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("M, N, K, bn, bk, split", [(16, 200, 384, 64, 128, 1), (3, 130, 520, 64, 128, 3),
                                                    (7, 96, 256, 32, 128, 2), (1, 64, 136, 64, 64, 1)])
def test_tma_linear_equals_torch(M, N, K, bn, bk, split):
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    y = tma_linear(x, w, bn=bn, bk=bk, split=split)
    assert y.shape == (M, N) and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-3)


def test_every_timed_variant_computes_the_same_product():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 16, 256, generator=g), torch.randn(192, 256, generator=g)
    variants = variants_of(x, 192, 256)
    assert len(variants) >= 6
    for name, fn in variants.items():
        torch.testing.assert_close(fn(w).float().reshape(16, 192), x[0] @ w.T, rtol=1e-4, atol=1e-3, msg=name)
