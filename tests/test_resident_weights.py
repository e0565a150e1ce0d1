"""The resident-weight GEMM (an experiment the engine does not run: scripts/experiments/resident_weights.py)
against PyTorch under the Triton interpreter: ragged rows, N not a multiple of the tile, K shorter than its block
and K split over programs merged by the last to arrive, weights loaded before or after the wait."""
from __future__ import annotations

import pytest
import torch

from scripts.experiments.resident_weights import Chain, resident_linear


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("M, N, K, bn, kc, ahead", [(16, 200, 384, 16, 512, True), (3, 130, 1100, 16, 256, False),
                                                    (7, 96, 700, 32, 256, True), (1, 40, 64, 16, 64, True)])
def test_resident_linear_equals_torch(M, N, K, bn, kc, ahead):
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K + 5, generator=g), torch.randn(N, K, generator=g)
    x = x[:, :K]  # a row stride longer than K, as the timed chain's views have
    out = torch.full((M, N + 3), float("nan"))[:, :N]
    resident_linear(x, w, out, bn=bn, kc=kc, ahead=ahead)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-4, atol=1e-3)


def test_the_timed_chain_equals_its_reference():
    chain = Chain(1, 5, torch.device("cpu"), dtype=torch.float32)
    torch.testing.assert_close(chain.forward(kc=512), chain.reference(), rtol=1e-4, atol=1e-4)
