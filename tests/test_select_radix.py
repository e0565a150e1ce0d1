"""The three-launch radix selection (an experiment the engine does not run: scripts/experiments/select_radix.py)
against the per-sequence Python reference and the engine's select_dustin, under the Triton interpreter: ties
(many equal scores: the boundary bin then holds more candidates than one register tile, which takes the
streamed path), negative and infinite scores, -0.0, several chunks per row, short rows, and the self-cleaning
histogram between calls."""
from __future__ import annotations

import pytest
import torch

from dustin.kernels.arrival import zeroed_int32
from dustin.kernels.selection import select_dustin, select_dustin_reference
from scripts.experiments.select_radix import CAND_BLOCK, CHUNK, select_dustin_radix


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path


def _check(s_target, s_draft, lengths, k, m):
    got = select_dustin_radix(s_target, s_draft, lengths, k=k, m=m)
    want = select_dustin_reference(s_target, s_draft, lengths, k=k, m=m)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("k,m", [(64, 0), (64, 30), (96, 76)])
def test_radix_matches_reference_across_chunks(k, m):
    """Rows longer than one CHUNK: the per-row histogram is summed over programs with atomics."""
    gen = torch.Generator().manual_seed(k + m)
    B, S = 3, CHUNK + 905
    lengths = torch.tensor([S, 2 * CHUNK // 3, 60], dtype=torch.int32)  # one short row (L <= k)
    s_target = torch.rand(B, S, generator=gen) * 4 - 2  # negative and positive
    s_draft = torch.rand(B, S, generator=gen).pow(8)  # skewed, like softmax mass
    _check(s_target, s_draft, lengths, k, m)
    assert int(zeroed_int32("radix_hist", "cpu", 1).abs().sum()) == 0  # left clean for the next call
    assert int(zeroed_int32("radix_done", "cpu", 1).abs().sum()) == 0
    _check(s_target.flip(1).contiguous(), s_draft, lengths, k, m)  # a second call on the same buffers


@pytest.mark.parametrize("m", [0, 20])
def test_radix_ties_resolved_by_position(m):
    """Most scores equal (0.0, -0.0 and a few levels): the reference keeps the lowest positions among
    equal scores, and so must the bisection over positions; more tied candidates than one tile."""
    gen = torch.Generator().manual_seed(5 + m)
    B, S = 2, 3 * CAND_BLOCK + 77
    lengths = torch.tensor([S, S - 500], dtype=torch.int32)
    s_target = torch.zeros(B, S)
    s_target[0, ::7] = -0.0
    s_target[:, 100:130] = 3.0
    s_target[1, 2000:2010] = float("inf")
    s_target[1, 5:50] = float("-inf")
    s_draft = torch.randint(0, 3, (B, S), generator=gen).float()  # three levels, heavy ties
    _check(s_target, s_draft, lengths, k=128, m=m)


def test_radix_distinct_scores_small_rows():
    gen = torch.Generator().manual_seed(3)
    B, S = 5, 700
    lengths = torch.tensor([700, 21, 433, 101, 100], dtype=torch.int32)
    s_target = torch.randperm(B * S, generator=gen).float().view(B, S)
    s_draft = torch.randn(B, S, generator=gen).to(torch.bfloat16)  # another dtype: converted, same order
    _check(s_target, s_draft.float(), lengths, k=100, m=37)
    got = select_dustin_radix(s_target, s_draft, lengths, k=100, m=37)
    want = select_dustin_reference(s_target, s_draft.float(), lengths, k=100, m=37)
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("k,m", [(64, 0), (64, 20), (20, 0), (2000, 100)])
def test_radix_equals_default_selection(k, m):
    """Distinct scores: the experiment and the engine's select_dustin give the same sets (the cases the
    default answers without kernels, k = sinks + window and S <= k, are handed to it)."""
    gen = torch.Generator().manual_seed(k * 7 + m)
    B, S = 6, 1100
    lengths = torch.tensor([17, 1000, 333, 64, 65, 100], dtype=torch.int32)
    s_target = torch.randperm(B * S, generator=gen).float().view(B, S) - 2000.0
    s_draft = torch.randperm(B * S, generator=gen).float().view(B, S)
    got = select_dustin_radix(s_target, s_draft, lengths, k=k, m=m)
    want = select_dustin(s_target, s_draft, lengths, k=k, m=m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
