"""Score estimation over ANY head set: layers of many heads (all 12 target / 14 draft heads of the Qwen2.5
pair) are tiled into groups of a few heads, each launched as one more layer entry, because one launch
over all of them ran out of shared memory on the H200 (tests/kernels/test_kernels_compile.py checks the budget).
Checked against the PyTorch reference under the CPU interpreter at small, odd shapes."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the triton import below

import types

import pytest
import torch

from dustin.attention.reference import attention_scores_multi_reference, attention_scores_reference
from dustin.kernels import score_estimation as se
from dustin.kernels.score_estimation import attention_scores, attention_scores_multi
from dustin.selection.config import ScoreHeads
from dustin.selection.estimators import DraftLookaheadScores, TargetHistoricalScores


def _case(gen, B, L_total, Hkv, head_counts, group, Tq, D, S, key_len, dtype=torch.float32):
    """q [B, NL, Hs_max, Tq, D] (zero heads past a layer's count), a cache [L_total, B, Hkv, S, D],
    kv_heads [NL, Hs_max] = head // group (-1 pads), query positions ending at key_len - 1."""
    NL, hs = len(head_counts), max(head_counts)
    q = torch.randn(B, NL, hs, Tq, D, generator=gen).to(dtype)
    k_all = (torch.randn(L_total, B, Hkv, S, D, generator=gen) * 1.5).to(dtype)
    kvh = torch.tensor([[h // group for h in range(n)] + [-1] * (hs - n) for n in head_counts], dtype=torch.int32)
    key_len = torch.tensor(key_len, dtype=torch.int32)
    qpos = key_len.long()[:, None] - Tq + torch.arange(Tq)[None, :]
    return q, k_all, kvh, key_len, qpos


def _tol(dtype):
    return {"atol": 1e-3, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("accumulate", [True, False])
def test_twelve_heads_one_query(accumulate):
    """The target shape: all 12 heads of a layer on 2 KV heads (6:1), one query at key_lengths - 1; S odd and
    key lengths ragged (one block-aligned, one partial)."""
    gen = torch.Generator().manual_seed(41)
    q, k_all, kvh, klen, _ = _case(gen, 3, 1, 2, [12], 6, 1, 64, 333, [333, 64, 190])
    ctx = klen - torch.tensor([0, 1, 7], dtype=torch.int32)
    start = torch.rand(3, 340, generator=gen)
    got = attention_scores(q[:, 0], k_all[0], kvh[0], klen, None, start.clone(), ctx_lengths=ctx,
                           accumulate=accumulate, num_programs=2, block_n=32)
    want = attention_scores_reference(q[:, 0], k_all[0], kvh[0], klen, (klen.long() - 1)[:, None], start.clone(),
                                      ctx_lengths=ctx, accumulate=accumulate)
    torch.testing.assert_close(got, want, **_tol(q.dtype))
    added = got[0, :333].sum() - (start[0, :333].sum() if accumulate else 0)  # row 0: ctx = key_lengths
    torch.testing.assert_close(added, torch.tensor(12.0), atol=1e-3, rtol=0)  # 12 heads, mass 1 each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fourteen_heads_four_queries_gqa(dtype):
    """The draft shape: all 14 heads on 2 KV heads (7:1) x Γ = 4 lookahead queries; groups mix KV heads."""
    gen = torch.Generator().manual_seed(42)
    q, k_all, kvh, klen, qpos = _case(gen, 2, 1, 2, [14], 7, 4, 32, 257, [257, 101], dtype)
    ctx = klen - 4
    start = torch.rand(2, 257, generator=gen)
    got = attention_scores(q[:, 0], k_all[0], kvh[0], klen, qpos, start.clone(), ctx_lengths=ctx,
                           num_programs=3, block_n=64)
    want = attention_scores_reference(q[:, 0], k_all[0], kvh[0], klen, qpos, start.clone(), ctx_lengths=ctx)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("accumulate", [True, False])
def test_layers_with_different_head_counts(accumulate):
    """One multi-layer estimate over layers of 14, 3 and 1 heads (-1 padded to 14), read in a shuffled layer
    order: the 14-head layer becomes 4 launch entries, the others 4 entries of mostly padding."""
    gen = torch.Generator().manual_seed(43)
    q, k_all, kvh, klen, qpos = _case(gen, 2, 4, 2, [14, 3, 1], 7, 2, 32, 150, [150, 77])
    layers = torch.tensor([3, 0, 2], dtype=torch.int32)
    start = torch.rand(2, 153, generator=gen)
    kw = {"ctx_lengths": klen - 2, "accumulate": accumulate}
    got = attention_scores_multi(q, k_all, layers, kvh, klen, qpos, start.clone(), num_programs=2, block_n=32,
                                 **kw)
    want = attention_scores_multi_reference(q, k_all, layers, kvh, klen, qpos, start.clone(), **kw)
    torch.testing.assert_close(got, want, **_tol(q.dtype))
    # layers=None (layers 0 .. NL-1), q a strided view (not viewable as groups: the split copies it)
    qv = torch.randn(2, 3, 16, 2, 32, generator=gen)[:, :, :14]
    got = attention_scores_multi(qv, k_all, None, kvh, klen, qpos, start.clone(), **kw)
    want = attention_scores_multi_reference(qv, k_all, None, kvh, klen, qpos, start.clone(), **kw)
    torch.testing.assert_close(got, want, **_tol(q.dtype))


def test_group_size_does_not_change_the_sum():
    """Every head-group size (1 .. all heads; uneven splits pad the last group) gives the same scores."""
    gen = torch.Generator().manual_seed(44)
    q, k_all, kvh, klen, qpos = _case(gen, 2, 2, 3, [9, 5], 3, 3, 16, 97, [97, 40])
    want = attention_scores_multi_reference(q, k_all, None, kvh, klen, qpos, torch.zeros(2, 97))
    for g in (1, 2, 3, 4, 5, 9):
        got = attention_scores_multi(q, k_all, None, kvh, klen, qpos, torch.zeros(2, 97), group_heads=g,
                                     num_programs=2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_small_head_sets_launch_as_before(monkeypatch):
    """Up to 4 heads per layer (the measured S_target / S_draft configs) are never split."""
    def no_split(*a):
        raise AssertionError("split a layer of <= 4 heads")
    monkeypatch.setattr(se, "_split_heads", no_split)
    gen = torch.Generator().manual_seed(45)
    q, k_all, kvh, klen, qpos = _case(gen, 1, 3, 2, [4, 4, 2], 2, 4, 16, 40, [40])
    attention_scores_multi(q, k_all, None, kvh, klen, qpos, torch.zeros(1, 40), num_programs=1)


def _ctx(positions, fresh=False):
    return types.SimpleNamespace(fresh=fresh, prompt=fresh, positions=positions, rows=None)


@pytest.mark.parametrize("per_layer", [False, True])
def test_draft_estimator_all_heads(per_layer):
    """DraftLookaheadScores on every head of every layer, as SpecAttn configures it (per_layer=True: one row
    per layer, through accumulate_scores -> attention_scores) and as a one-launch S_draft."""
    gen = torch.Generator().manual_seed(46)
    B, Hq, Hkv, D, cap, gamma, n_layers = 2, 14, 2, 32, 130, 4, 2
    heads = tuple(ScoreHeads(layer, tuple(range(Hq))) for layer in range(n_layers))
    cache = torch.randn(n_layers, B, Hkv, cap, D, generator=gen)
    L = torch.tensor([120, 45], dtype=torch.int32)
    est = DraftLookaheadScores(heads, Hq // Hkv, B, cap, "cpu", gamma, D, torch.float32)
    est.begin_step(L.long())
    qs = [torch.randn(n_layers, B, Hq, 1, D, generator=gen) for _ in range(gamma)]
    for t in range(gamma):
        for layer in range(n_layers):
            est.capture(layer, qs[t][layer], cache[layer], _ctx((L.long() + t)[:, None]))
    est.scores.fill_(float("nan"))
    got = est.compute({layer: cache[layer] for layer in range(n_layers)}, L, per_layer=per_layer)
    pos = L.long()[:, None] + torch.arange(gamma)[None, :]
    rows = {}
    for layer in range(n_layers):
        q = torch.cat([qs[t][layer] for t in range(gamma)], dim=2)  # [B, Hq, Γ, D]
        rows[layer] = attention_scores_reference(q, cache[layer], torch.arange(Hq) // (Hq // Hkv), L + gamma, pos,
                                                 torch.zeros(B, cap), ctx_lengths=L)
    if per_layer:
        for layer in range(n_layers):
            torch.testing.assert_close(got[layer], rows[layer], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, sum(rows.values()), atol=1e-5, rtol=1e-5)


def test_target_estimator_all_heads_unsorted():
    """TargetHistoricalScores on all 12 heads of two layers, listed out of KV-head order (sorted internally)."""
    gen = torch.Generator().manual_seed(47)
    B, Hq, Hkv, D, cap, T = 2, 12, 2, 32, 111, 3
    order = (11, 0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5)
    heads = (ScoreHeads(0, order), ScoreHeads(2, tuple(range(Hq))))
    cache = torch.randn(3, B, Hkv, cap, D, generator=gen)
    est = TargetHistoricalScores(heads, Hq // Hkv, B, cap, "cpu")
    q_full = {sh.layer: torch.randn(B, Hq, T, D, generator=gen) for sh in heads}
    for sh in heads:
        est(sh.layer, q_full[sh.layer], cache[sh.layer], _ctx(None))
    n_acc = torch.tensor([2, 0])
    est.after_verify(n_acc)
    L = torch.tensor([111, 50], dtype=torch.int32)
    got = est.compute({sh.layer: cache[sh.layer] for sh in heads}, L).clone()
    want = torch.zeros(B, cap)
    for sh in heads:
        q_last = q_full[sh.layer][torch.arange(B), :, n_acc][:, :, None]  # [B, Hq, 1, D]: the last cached token
        attention_scores_reference(q_last, cache[sh.layer], torch.arange(Hq) // (Hq // Hkv), L,
                                   (L.long() - 1)[:, None], want)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.sum(1), torch.full((B,), 24.0), atol=1e-4, rtol=0)  # 24 heads, mass 1 each
