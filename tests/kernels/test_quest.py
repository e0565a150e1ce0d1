"""Quest page metadata, scoring and selection against their PyTorch references (CPU, Triton interpreter)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the triton import below

import pytest
import torch

from dustin.attention.reference import sparse_verify_attention_reference
from dustin.kernels.quest import (
    QuestPages,
    page_minmax,
    page_minmax_reference,
    page_scores,
    page_scores_reference,
    quest_select,
    quest_select_reference,
    select_pages,
)
from dustin.kernels.sparse_verify import sparse_verify_attention

P = 16


def _keys(B, H, S_cap, D, dtype, gen):
    return (torch.randn(B, H, S_cap, D, generator=gen) * 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_build_matches_reference_odd_lengths(dtype):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 17, 100, 0, 64], dtype=torch.int32)  # partial pages, empty, exact multiple
    k = _keys(5, 3, 103, 32, dtype, gen)  # capacity not a multiple of the page size
    pages = QuestPages(2, 5, 3, 32, 103, dtype, "cpu")
    pages.kmin.fill_(7)  # stale values must be overwritten (empty pages become 0)
    pages.build(1, k, lengths)
    want_min, want_max = page_minmax_reference(k, lengths)
    assert pages.kmin.shape == (2, 5, 3, 7, 32) and pages.kmin.dtype == dtype
    assert torch.equal(pages.kmin[1], want_min) and torch.equal(pages.kmax[1], want_max)
    assert bool((pages.kmin[0] == 7).all())  # other layers untouched
    # Partial page: only the valid rows count, so the page min/max equals the rows' own min/max.
    assert torch.equal(pages.kmin[1, 2, :, 6], k[2, :, 96:100].amin(1))
    assert torch.equal(pages.kmax[1, 1, :, 1], k[1, :, 16:17].amax(1))


@pytest.mark.parametrize("max_new", [None, 5, 40])
def test_update_equals_build_after_appends(max_new):
    gen = torch.Generator().manual_seed(1)
    B, H, D, cap = 3, 2, 64, 130
    k = _keys(B, H, cap, D, torch.bfloat16, gen)
    before = torch.tensor([15, 0, 33], dtype=torch.int32)
    pages = QuestPages(1, B, H, D, cap, torch.bfloat16, "cpu")
    pages.build(0, k, before)
    steps = [[5, 1, 0], [1, 5, 5], [2, 5, 4]] if max_new == 5 else [[5, 1, 0], [1, 16, 5], [2, 5, 40]]
    for step in steps:  # each step appends at most max_new positions, across page boundaries
        after = before + torch.tensor(step, dtype=torch.int32)
        pages.update(0, k, before, after, max_new=max_new)
        fresh = QuestPages(1, B, H, D, cap, torch.bfloat16, "cpu")
        fresh.build(0, k, after)
        assert torch.equal(pages.kmin, fresh.kmin) and torch.equal(pages.kmax, fresh.kmax)
        before = after


def test_build_and_update_of_some_rows():
    gen = torch.Generator().manual_seed(2)
    k = _keys(3, 2, 50, 16, torch.float32, gen)
    pages = QuestPages(1, 3, 2, 16, 50, torch.float32, "cpu")
    pages.build(0, k[1:2], torch.tensor([33], dtype=torch.int32), rows=slice(1, 2))
    pages.update(0, k[1:2], torch.tensor([33]), torch.tensor([40]), rows=slice(1, 2), max_new=7)
    want_min, want_max = page_minmax_reference(k[1:2], torch.tensor([40]))
    assert torch.equal(pages.kmin[0, 1:2], want_min) and torch.equal(pages.kmax[0, 1:2], want_max)
    assert bool((pages.kmin[0, 0] == 0).all()) and bool((pages.kmin[0, 2] == 0).all())


def test_cpu_torch_path_matches_kernel(monkeypatch):
    """CPU tensors outside the interpreter take torch ops: same metadata and scores."""
    gen = torch.Generator().manual_seed(3)
    k = _keys(2, 2, 70, 32, torch.bfloat16, gen)
    q = torch.randn(2, 8, 3, 32, generator=gen).to(torch.bfloat16)
    before, after = torch.tensor([20, 3], dtype=torch.int32), torch.tensor([37, 60], dtype=torch.int32)
    results = []
    for interp in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        mn, mx = (torch.full((2, 2, 5, 32), 3.0, dtype=torch.bfloat16) for _ in range(2))
        page_minmax(k, before, mn, mx)
        page_minmax(k, after, mn, mx, lengths_before=before)
        results.append((mn, mx, page_scores(q, mn, mx, after)))
    (a_min, a_max, a_s), (b_min, b_max, b_s) = results
    assert torch.equal(a_min, b_min) and torch.equal(a_max, b_max)
    torch.testing.assert_close(a_s, b_s, atol=1e-3, rtol=1e-4)


# (Hq, Hkv, Tq, D, lengths): GQA 1 / 4 / 7, one or several queries, odd and tiny lengths
SCORE_CASES = [
    (4, 4, 1, 32, [100, 17, 1]),
    (8, 2, 5, 64, [333, 40]),
    (28, 4, 5, 128, [250, 64, 16]),
    (7, 1, 2, 16, [0, 50]),
]


@pytest.mark.parametrize("Hq,Hkv,Tq,D,lengths", SCORE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_scores_match_literal_bound(Hq, Hkv, Tq, D, lengths, dtype):
    gen = torch.Generator().manual_seed(Hq * 10 + Tq)
    L = torch.tensor(lengths, dtype=torch.int32)
    k = _keys(len(lengths), Hkv, max(lengths) + 20, D, dtype, gen)
    q = torch.randn(len(lengths), Hq, Tq, D, generator=gen).to(dtype)
    mn, mx = page_minmax_reference(k, L)
    got = page_scores(q, mn, mx, L)
    want = page_scores_reference(q, mn, mx, L)
    assert got.shape == (len(lengths), Hkv, mn.shape[2]) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=1e-3, rtol=1e-4)
    assert torch.equal(got[~fin], want[~fin])
    # The bound really bounds: each page's score >= the group's summed q.k of every key in it.
    B = len(lengths)
    kk = k.float().repeat_interleave(Hq // Hkv, 1)
    qk = torch.einsum("bhtd,bhsd->bhts", q.float(), kk).reshape(B, Hkv, -1, kk.shape[2]).sum(2)
    for b in range(B):
        for j in range(int(L[b])):
            assert bool((got[b, :, j // P] >= qk[b, :, j] - 1e-2 * (1 + qk[b, :, j].abs())).all())


@pytest.mark.parametrize("k_budget", [16, 48, 64, 500])
def test_select_pages_matches_reference(k_budget):
    gen = torch.Generator().manual_seed(k_budget)
    L = torch.tensor([100, 17, 1, 0, 64, 33], dtype=torch.int32)
    B, H, n_pages = 6, 3, 9
    scores = torch.randperm(B * H * n_pages, generator=gen).float().view(B, H, n_pages) - 50
    p = torch.arange(n_pages)
    scores = scores.masked_fill(p * P >= L.long()[:, None, None], float("-inf"))  # as page_scores marks them
    scores = scores.masked_fill((p == (L.long()[:, None, None] - 1) // P) & (L[:, None, None] > 0), float("inf"))
    idx, cnt = select_pages(scores, L, k_budget)
    want_idx, want_cnt = quest_select_reference(scores, L, k_budget)
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32 and idx.shape == (B, H, min(k_budget // P, 9) * P)
    assert torch.equal(idx, want_idx) and torch.equal(cnt, want_cnt)
    for b in range(B):
        for h in range(H):
            row = idx[b, h, : cnt[b, h]]
            assert bool((row[1:] > row[:-1]).all()) and bool((row < L[b]).all())
            if L[b] > 0:  # the newest position is always in
                assert int(L[b]) - 1 in row.tolist()


def test_quest_end_to_end_per_head_lists():
    """Pages -> per-head selection -> sparse kernel == the per-head sparse reference; heads differ."""
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, T, D = 3, 8, 4, 5, 64
    L = torch.tensor([300, 45, 150], dtype=torch.int32)
    cap = 310
    k = _keys(B, Hkv, cap, D, torch.bfloat16, gen)
    v = torch.randn(B, Hkv, cap, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, Hq, T, D, generator=gen).to(torch.bfloat16)
    pages = QuestPages(1, B, Hkv, D, cap, torch.bfloat16, "cpu")
    pages.build(0, k, L)
    idx, cnt = pages.select(0, q, L, 64)
    assert idx.shape == (B, Hkv, 64) and cnt.tolist()[1] == [45] * Hkv
    assert not all(torch.equal(idx[0, 0], idx[0, h]) for h in range(1, Hkv))  # per-head choices
    got = sparse_verify_attention(q, k, v, L, idx, cnt)
    want = sparse_verify_attention_reference(q, k, v, L, idx, cnt)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(quest_select(q, pages.kmin[0], pages.kmax[0], L, 64)[0], idx)
