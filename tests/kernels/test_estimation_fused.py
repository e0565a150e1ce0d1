"""Multi-layer score estimation (one launch per pass, the log-sum-exp reduced inside pass 2, pass 2 reading the
logits pass 1 stored) against the plain PyTorch reference (CPU, Triton interpreter), and the estimators'
one-launch path against their per-layer path."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the triton import below

import types

import pytest
import torch

from dustin.attention.reference import attention_scores_multi_reference
from dustin.kernels.score_estimation import attention_scores_multi
from dustin.selection.config import ScoreHeads
from dustin.selection.estimators import DraftLookaheadScores, TargetHistoricalScores, stacked_cache


def _inputs(B, L_total, layers, Hkv, head_sets, Tq, D, ctx, dtype, gen):
    """q [B, NL, Hs_max, Tq, D], a whole cache [L, B, Hkv, S, D], kv_heads [NL, Hs_max] (-1 padded)."""
    NL, hs = len(layers), max(len(h) for h in head_sets)
    S = max(ctx) + Tq + 3
    q = torch.randn(B, NL, hs, Tq, D, generator=gen).to(dtype)
    k_all = (torch.randn(L_total, B, Hkv, S, D, generator=gen) * 1.5).to(dtype)
    kvh = torch.tensor([list(h) + [-1] * (hs - len(h)) for h in head_sets], dtype=torch.int32)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    qpos = ctx_t.long()[:, None] + torch.arange(Tq)[None, :]  # draft style: after the context
    return q, k_all, torch.tensor(layers, dtype=torch.int32), kvh, ctx_t, qpos


# (B, L_total, layers, Hkv, kv head sets per layer, Tq, D, ctx, dtype): GQA via shared KV heads, Γ 1..8,
# odd and ragged lengths, layers with different (and differently many) heads.
MULTI_CASES = [
    (2, 4, [1, 3], 2, [[0, 0, 1, 1], [1, 0]], 4, 64, [333, 17], torch.float32),
    (3, 3, [0, 1, 2], 4, [[3], [0, 2], [1, 1, 2]], 1, 32, [100, 57, 211], torch.float32),
    (2, 5, [4, 0, 2], 1, [[0, 0], [0], [0, 0]], 8, 16, [77, 150], torch.bfloat16),
    (1, 2, [1], 7, [[6, 2, 2]], 5, 64, [299], torch.bfloat16),
    (2, 3, [2, 0], 2, [[1], [0, 1]], 2, 128, [64, 129], torch.float32),
]


def _tol(dtype):
    return {"atol": 1e-3, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-5}


@pytest.mark.parametrize("kv_slots", [False, True])
@pytest.mark.parametrize("B,L_total,layers,Hkv,heads,Tq,D,ctx,dtype", MULTI_CASES)
def test_multi_layer_matches_reference(B, L_total, layers, Hkv, heads, Tq, D, ctx, dtype, kv_slots):
    """Both ways of reading K: a slot per head (repeats masked) and a slot per KV head of the cache (unused
    ones masked; with Hkv 7 > 3 heads, more slots than heads)."""
    gen = torch.Generator().manual_seed(31)
    q, k_all, lay, kvh, ctx_t, qpos = _inputs(B, L_total, layers, Hkv, heads, Tq, D, ctx, dtype, gen)
    start = torch.rand(B, k_all.shape[3] + 2, generator=gen)  # accumulate onto existing scores; wider row
    got = attention_scores_multi(q, k_all, lay, kvh, ctx_t + Tq, qpos, start.clone(), ctx_lengths=ctx_t,
                                 num_programs=3, block_n=16, kv_slots=kv_slots)
    want = attention_scores_multi_reference(q, k_all, lay, kvh, ctx_t + Tq, qpos, start.clone(), ctx_lengths=ctx_t)
    torch.testing.assert_close(got, want, **_tol(dtype))
    for b, c in enumerate(ctx):  # nothing added past the committed context
        assert torch.equal(got[b, c:], start[b, c:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_kv_heads_out_of_order(dtype):
    """Heads sharing KV heads, listed out of KV order (a repeat after another KV head), with -1 pads: the
    kernel loads and multiplies each distinct KV head once per key block; the sums must not change."""
    gen = torch.Generator().manual_seed(35)
    B, Hkv, group, Tq, D, S_cap = 3, 2, 3, 4, 32, 157  # odd S_cap: the last key block is partial
    q_heads = [[5, 0, 4], [1, 2]]  # query heads of 2 layers; KV head = query head // group
    kvh = torch.tensor([[h // group for h in hs] + [-1] * (4 - len(hs)) for hs in q_heads], dtype=torch.int32)
    assert kvh.tolist() == [[1, 0, 1, -1], [0, 0, -1, -1]]
    q = torch.randn(B, 2, 4, Tq, D, generator=gen).to(dtype)
    k_all = (torch.randn(3, B, Hkv, S_cap, D, generator=gen) * 1.5).to(dtype)
    lay = torch.tensor([2, 0], dtype=torch.int32)
    ctx_t = torch.tensor([150, 41, 97], dtype=torch.int32)  # ragged; key_lengths = ctx + Tq <= S_cap
    qpos = ctx_t.long()[:, None] + torch.arange(Tq)[None, :]
    start = torch.rand(B, S_cap + 3, generator=gen)
    want = attention_scores_multi_reference(q, k_all, lay, kvh, ctx_t + Tq, qpos, start.clone(), ctx_lengths=ctx_t)
    for kw in ({"num_programs": 3, "block_n": 16}, {}, {"kv_slots": False}):  # {}: a slot per KV head
        got = attention_scores_multi(q, k_all, lay, kvh, ctx_t + Tq, qpos, start.clone(), ctx_lengths=ctx_t, **kw)
        torch.testing.assert_close(got, want, **_tol(dtype))


def test_overwrite_and_optional_lengths():
    """accumulate=False overwrites the whole row (zeros past the context); key_lengths None bounds keys by
    the query positions only; query_positions None puts one query at key_lengths - 1 (the target case)."""
    gen = torch.Generator().manual_seed(32)
    q, k_all, lay, kvh, ctx_t, qpos = _inputs(3, 3, [2, 0], 2, [[0, 1], [1]], 3, 32, [90, 33, 150], torch.float32,
                                              gen)
    poisoned = torch.full((3, k_all.shape[3] + 5), float("nan"))
    got = attention_scores_multi(q, k_all, lay, kvh, None, qpos, poisoned, ctx_lengths=ctx_t, accumulate=False,
                                 num_programs=2)
    want = attention_scores_multi_reference(q, k_all, lay, kvh, (qpos[:, -1] + 1).int(), qpos,
                                            torch.zeros_like(poisoned), ctx_lengths=ctx_t)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    q1 = q[:, :, :, :1]
    got = attention_scores_multi(q1, k_all, lay, kvh, ctx_t, None, poisoned, accumulate=False)
    want = attention_scores_multi_reference(q1, k_all, lay, kvh, ctx_t, (ctx_t.long() - 1)[:, None],
                                            torch.zeros_like(poisoned))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # layers=None reads layers 0 .. NL-1
    got = attention_scores_multi(q1, k_all, None, kvh, ctx_t, None, torch.zeros_like(poisoned))
    want = attention_scores_multi_reference(q1, k_all, None, kvh, ctx_t, None, torch.zeros_like(poisoned))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_stacked_cache_from_views():
    k = torch.randn(5, 2, 3, 7, 16)
    views = {layer: k[layer] for layer in (1, 4)}
    full = stacked_cache(views, [1, 4])
    assert full is not None and torch.equal(full[1], k[1]) and torch.equal(full[4], k[4])
    with torch.inference_mode():  # inference tensors' views carry no _base: metadata alone must do
        ki = torch.randn(3, 2, 2, 5, 16)
        full = stacked_cache({0: ki[0], 2: ki[2]}, [0, 2])
        assert full is not None and torch.equal(full[2], ki[2])
    assert stacked_cache({0: torch.randn(2, 3, 7, 16), 1: torch.randn(2, 3, 7, 16)}, [0, 1]) is None
    assert stacked_cache({0: k[0, :, :2]}, [0]) is None  # not contiguous


def _ctx(positions, fresh=False):
    return types.SimpleNamespace(fresh=fresh, prompt=fresh, positions=positions, rows=None)


# (layer -> heads), group: layers with different head sets and counts
DRAFT_HEADS = (ScoreHeads(0, (0, 3)), ScoreHeads(2, (5,)), ScoreHeads(3, (1, 2, 7)))


@pytest.mark.parametrize("gamma", [1, 4])
def test_draft_estimator_one_launch_equals_per_layer(gamma):
    gen = torch.Generator().manual_seed(33)
    B, Hq, Hkv, D, cap = 2, 8, 2, 32, 160
    cache = torch.randn(4, B, Hkv, cap, D, generator=gen)
    L = torch.tensor([100, 37], dtype=torch.int32)
    est = DraftLookaheadScores(DRAFT_HEADS, Hq // Hkv, B, cap, "cpu", gamma, D, torch.float32)
    est.begin_step(L.long())
    for t in range(gamma):
        pos = (L.long() + t)[:, None]
        for sh in DRAFT_HEADS:
            est.capture(sh.layer, torch.randn(B, Hq, 1, D, generator=gen), cache[sh.layer], _ctx(pos))
    views = {layer: cache[layer] for layer in est.layers}
    est.scores.fill_(float("nan"))  # the one-launch path overwrites the row
    got = est.compute(views, L).clone()
    rows = est.compute(views, L, per_layer=True)  # one estimate per layer
    want = sum(rows.values())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(got[:, 100:], torch.zeros_like(got[:, 100:]))
    # the same through the fallback (separate tensors: no multi-layer launch)
    separate = {layer: v.clone() for layer, v in views.items()}
    torch.testing.assert_close(est.compute(separate, L).clone(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(est.compute({}, L, k_all=cache).clone(), want, atol=1e-6, rtol=1e-5)
    # mass: each of the Γ queries of each head puts total mass <= 1 on the context
    assert bool((got.sum(1) <= gamma * 6 + 1e-3).all())


def test_target_estimator_one_launch_equals_per_layer():
    gen = torch.Generator().manual_seed(34)
    B, Hq, Hkv, D, cap, T = 3, 8, 4, 32, 140, 3
    cache = torch.randn(4, B, Hkv, cap, D, generator=gen)
    heads = (ScoreHeads(1, (3,)), ScoreHeads(3, (0, 6)))
    est = TargetHistoricalScores(heads, Hq // Hkv, B, cap, "cpu")
    for sh in heads:
        est(sh.layer, torch.randn(B, Hq, T, D, generator=gen), cache[sh.layer], _ctx(None))
    est.after_verify(torch.tensor([0, 2, 1]))
    L = torch.tensor([120, 19, 64], dtype=torch.int32)
    views = {layer: cache[layer] for layer in est.layers}
    got = est.compute(views, L).clone()
    want = torch.zeros(B, cap)
    from dustin.attention.reference import attention_scores_reference
    for sh in heads:
        attention_scores_reference(est.last_queries[sh.layer], cache[sh.layer], est.kv_heads[sh.layer], L,
                                   (L.long() - 1)[:, None], want)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(1), torch.full((B,), 3.0), atol=1e-5, rtol=0)  # 3 heads, mass 1 each
    separate = {layer: v.clone() for layer, v in views.items()}
    torch.testing.assert_close(est.compute(separate, L).clone(), want, atol=1e-6, rtol=1e-5)


def test_draft_estimator_slots_survive_graph_warmup_writes():
    """Under CUDA graphs the observer also runs on dummy inputs (warm-up, capture) and is then replayed: every
    forward writes its query into slot (position - step base). Junk writes before the step's real forwards must
    not change S_draft, and a replayed step (no host-side appends) must see the new queries."""
    gen = torch.Generator().manual_seed(35)
    B, Hq, Hkv, D, cap, gamma = 2, 8, 2, 32, 160, 3
    cache = torch.randn(4, B, Hkv, cap, D, generator=gen)
    L = torch.tensor([100, 37], dtype=torch.int32)
    views = {sh.layer: cache[sh.layer] for sh in DRAFT_HEADS}
    queries = [torch.randn(B, Hq, 1, D, generator=gen) for _ in range(gamma)]

    def run(est, junk: bool):
        est.begin_step(L.long())
        if junk:  # e.g. graph capture with positions at the end of the cache
            for sh in DRAFT_HEADS:
                est.capture(sh.layer, torch.randn(B, Hq, 1, D, generator=gen), views[sh.layer],
                            _ctx(torch.full((B, 1), 150)))
        for t in range(gamma):
            for sh in DRAFT_HEADS:
                est.capture(sh.layer, queries[t], views[sh.layer], _ctx((L.long() + t)[:, None]))
        return est.compute(views, L).clone()

    clean = run(DraftLookaheadScores(DRAFT_HEADS, Hq // Hkv, B, cap, "cpu", gamma, D, torch.float32), junk=False)
    est = DraftLookaheadScores(DRAFT_HEADS, Hq // Hkv, B, cap, "cpu", gamma, D, torch.float32)
    torch.testing.assert_close(run(est, junk=True), clean)
    # next step: new base, same buffers (what a graph replay writes into), different scores
    L += 2
    queries = [torch.randn(B, Hq, 1, D, generator=gen) for _ in range(gamma)]
    fresh = run(DraftLookaheadScores(DRAFT_HEADS, Hq // Hkv, B, cap, "cpu", gamma, D, torch.float32), junk=False)
    torch.testing.assert_close(run(est, junk=False), fresh)
    assert not torch.allclose(fresh, clean)


def test_draft_estimator_counts_each_rows_own_gamma():
    """Γ per row (`--gamma auto`): a step of G = 3 or 4 draft forwards over rows of Γ 1 and 3 gives each row the
    S_draft of a step of its own Γ (its later lookahead queries left out), through the one-launch estimate and the
    per-tensor fallback alike. (Both G in one test: the steps of one Γ for every row, the references, are
    estimated once for both.)"""
    gen = torch.Generator().manual_seed(36)
    B, Hq, Hkv, D, cap, gamma = 2, 8, 2, 32, 160, 4
    cache = torch.randn(4, B, Hkv, cap, D, generator=gen)
    L = torch.tensor([100, 37], dtype=torch.int32)
    views = {sh.layer: cache[sh.layer] for sh in DRAFT_HEADS}
    queries = [torch.randn(B, Hq, 1, D, generator=gen) for _ in range(gamma)]

    def run(row_gamma, n, k_caches):
        est = DraftLookaheadScores(DRAFT_HEADS, Hq // Hkv, B, cap, "cpu", gamma, D, torch.float32)
        est.begin_step(L.long(), row_gamma)
        for t in range(n):
            for sh in DRAFT_HEADS:
                est.capture(sh.layer, queries[t], views[sh.layer], _ctx((L.long() + t)[:, None]))
        return est.compute(k_caches, L).clone()

    row_gamma = torch.tensor([1, 3])
    for k_caches in (views, {layer: v.clone() for layer, v in views.items()}):
        own = {n: run(None, n, k_caches) for n in (1, 3, 4)}  # every row at Γ = n
        for forwards in (3, 4):
            got = run(row_gamma, forwards, k_caches)
            torch.testing.assert_close(got[0], own[1][0], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got[1], own[3][1], atol=1e-6, rtol=1e-5)
            if forwards > 3:  # the later query would have counted
                assert not torch.allclose(got[1], own[forwards][1])
