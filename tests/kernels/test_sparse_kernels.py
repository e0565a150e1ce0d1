"""Sparse-verification kernels against their plain PyTorch references (CPU, Triton interpreter)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the triton import below

import pytest
import torch

from dustin.attention.reference import (
    attention_scores_reference,
    sparse_verify_attention_reference,
    verify_attention_reference,
)
from dustin.kernels.score_estimation import attention_scores
from dustin.kernels.selection import _select_dustin_torch, select_dustin, select_dustin_reference, select_streaming
from dustin.kernels.sparse_verify import sparse_verify_attention


def _tol(dtype):
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 2e-5, "rtol": 2e-5}


def _cache(B, Hq, Hkv, T, D, lengths, dtype, gen):
    S_cap = max(lengths) + T + 3  # a little slack past the new tokens, like a real cache
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S_cap, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S_cap, D, generator=gen).to(dtype)
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def _random_indices(lengths, counts_wanted, k_max, gen):
    """Distinct sorted positions < lengths[b]; padding slots hold in-range junk that must be ignored."""
    B = len(lengths)
    indices = torch.randint(0, min(lengths), (B, k_max), generator=gen, dtype=torch.int32)
    counts = torch.zeros(B, dtype=torch.int32)
    for b, (L, c) in enumerate(zip(lengths, counts_wanted, strict=True)):
        c = min(c, L, k_max)
        indices[b, :c] = torch.randperm(L, generator=gen)[:c].sort().values.to(torch.int32)
        counts[b] = c
    return indices, counts


# (Hq, Hkv, T, D, lengths, counts, k_max, dtype, num_splits, block_n): GQA ratios 1, 2, 4, 7; T 1..8;
# ragged; small block_n so a split loops over several gathered blocks.
SPARSE_CASES = [
    (4, 4, 1, 64, [17, 100], [17, 40], 40, torch.float32, None, None),
    (8, 4, 3, 128, [333, 17, 100], [64, 17, 7], 64, torch.bfloat16, None, 16),
    (8, 2, 5, 64, [1000, 333], [150, 90], 150, torch.float32, 3, 32),
    (14, 2, 8, 64, [100, 1000], [100, 61], 128, torch.bfloat16, 2, None),
    (7, 1, 2, 128, [17], [0], 16, torch.float32, None, None),  # empty index list: only the new tokens
    (28, 4, 4, 64, [333, 100, 17], [200, 100, 17], 200, torch.float32, 1, 32),
]


@pytest.mark.parametrize("Hq,Hkv,T,D,lengths,counts,k_max,dtype,splits,block_n", SPARSE_CASES)
def test_sparse_verify_matches_reference(Hq, Hkv, T, D, lengths, counts, k_max, dtype, splits, block_n):
    gen = torch.Generator().manual_seed(1)
    q, k, v, L = _cache(len(lengths), Hq, Hkv, T, D, lengths, dtype, gen)
    indices, counts_t = _random_indices(lengths, counts, k_max, gen)
    got = sparse_verify_attention(q, k, v, L, indices, counts_t, num_splits=splits, block_n=block_n)
    want = sparse_verify_attention_reference(q, k, v, L, indices, counts_t)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_verify_all_positions_equals_dense(dtype):
    gen = torch.Generator().manual_seed(2)
    lengths = [100, 17, 333]
    q, k, v, L = _cache(3, 8, 2, 4, 64, lengths, dtype, gen)
    k_max = max(lengths) + 5  # k >= length: every position selected, tail slots are padding
    indices = torch.arange(k_max, dtype=torch.int32).repeat(3, 1)
    indices = torch.where(indices < L[:, None], indices, torch.zeros_like(indices))
    got = sparse_verify_attention(q, k, v, L, indices, L.clone(), scale=0.07)
    want = verify_attention_reference(q, k, v, L, scale=0.07)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


def test_sparse_verify_overwrites_poisoned_out():
    gen = torch.Generator().manual_seed(3)
    q, k, v, L = _cache(2, 6, 2, 3, 64, [100, 333], torch.float32, gen)
    indices, counts = _random_indices([100, 333], [50, 80], 80, gen)
    out = torch.full_like(q, float("nan"))
    got = sparse_verify_attention(q, k, v, L, indices, counts, out=out, num_splits=2)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()
    torch.testing.assert_close(out, sparse_verify_attention_reference(q, k, v, L, indices, counts),
                               **_tol(torch.float32))


def _scores_inputs(B, Hs, Hkv, Tq, D, ctx, dtype, gen, kv_heads):
    """Draft-style queries: Tq tokens after the committed context, their keys already in the cache."""
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    S_cap = max(ctx) + Tq + 5
    q = torch.randn(B, Hs, Tq, D, generator=gen).to(dtype)
    k = (torch.randn(B, Hkv, S_cap, D, generator=gen) * 1.5).to(dtype)
    qpos = ctx_t.long()[:, None] + torch.arange(Tq)[None, :]
    return q, k, torch.tensor(kv_heads, dtype=torch.int32), ctx_t + Tq, qpos, ctx_t


# (Hs, Hkv, kv_heads, Tq, D, ctx lengths, dtype)
SCORE_CASES = [
    (1, 4, [3], 1, 128, [333, 17], torch.float32),  # target style: one head, one query
    (4, 2, [0, 0, 1, 1], 4, 64, [100, 1000], torch.float32),  # draft style, heads share KV heads
    (3, 7, [6, 2, 2], 8, 64, [17, 333, 100], torch.bfloat16),
    (2, 1, [0, 0], 5, 128, [1000], torch.bfloat16),
]


@pytest.mark.parametrize("Hs,Hkv,kv_heads,Tq,D,ctx,dtype", SCORE_CASES)
def test_attention_scores_match_reference(Hs, Hkv, kv_heads, Tq, D, ctx, dtype):
    gen = torch.Generator().manual_seed(4)
    q, k, kvh, key_len, qpos, ctx_t = _scores_inputs(len(ctx), Hs, Hkv, Tq, D, ctx, dtype, gen, kv_heads)
    start = torch.rand(len(ctx), k.shape[2], generator=gen)  # accumulate on top of existing scores
    got = attention_scores(q, k, kvh, key_len, qpos, start.clone(), ctx_lengths=ctx_t)
    want = attention_scores_reference(q, k, kvh, key_len, qpos, start.clone(), ctx_lengths=ctx_t)
    tol = {"atol": 1e-3, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(got, want, **tol)
    # Past each sequence's committed context nothing was added.
    for b, c in enumerate(ctx):
        assert torch.equal(got[b, c:], start[b, c:])


def test_attention_scores_accumulate_and_conserve_mass():
    gen = torch.Generator().manual_seed(5)
    ctx = [100, 333]
    q, k, kvh, _, _, ctx_t = _scores_inputs(2, 2, 2, 3, 64, ctx, torch.float32, gen, [1, 0])
    qpos = (ctx_t.long() - 1)[:, None].expand(2, 3)  # all queries inside the context: mass stays there
    out = torch.zeros(2, k.shape[2])
    attention_scores(q, k, kvh, ctx_t, qpos, out, num_programs=3)
    once = out.clone()
    torch.testing.assert_close(once.sum(1), torch.full((2,), 2.0 * 3), atol=1e-4, rtol=0)
    attention_scores(q, k, kvh, ctx_t, qpos, out)  # default ctx_lengths = key_lengths; other split count
    torch.testing.assert_close(out, 2 * once, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", ["topk", "torch"])
@pytest.mark.parametrize("k,m", [(64, 0), (64, 20), (64, 44), (100, 37), (20, 0), (2000, 100)])
def test_select_dustin_matches_reference(k, m, impl):
    gen = torch.Generator().manual_seed(k * 7 + m)
    B, S = 6, 1100
    lengths = torch.tensor([17, 1000, 333, 64, 65, 100], dtype=torch.int32)
    # Distinct scores so the top-k is unique and both implementations must agree exactly; some negative.
    s_target = torch.randperm(B * S, generator=gen).float().view(B, S) - 2000.0
    s_draft = torch.randperm(B * S, generator=gen).float().view(B, S)
    got = select_dustin(s_target, s_draft, lengths, k=k, m=m, impl=impl)
    want = select_dustin_reference(s_target, s_draft, lengths, k=k, m=m)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32 and got[0].shape == (B, k)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert torch.equal(got[1], lengths.clamp(max=k))
    idx, cnt = got
    for b in range(B):
        row = idx[b, : cnt[b]]
        assert bool((row[1:] > row[:-1]).all()) and int(row.max()) < int(lengths[b])
        assert bool((idx[b, cnt[b]:] == 0).all())
        L = int(lengths[b])
        if L > k:  # sinks and window always present
            assert {0, 1, 2, 3} | set(range(L - 16, L)) <= set(row.tolist())


@pytest.mark.parametrize("m", [0, 30])
def test_select_dustin_torch_fallback_matches_reference(m):
    """The pure-torch path (CPU tensors outside the interpreter) gives the same sets."""
    gen = torch.Generator().manual_seed(8)
    lengths = torch.tensor([17, 900, 333, 65], dtype=torch.int32)
    s_target = torch.randperm(4 * 1000, generator=gen).float().view(4, 1000)
    s_draft = torch.randperm(4 * 1000, generator=gen).float().view(4, 1000)
    got = _select_dustin_torch(s_target, s_draft, lengths, k=64, m=m, sinks=4, window=16)
    want = select_dustin_reference(s_target, s_draft, lengths, k=64, m=m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_select_streaming_pattern():
    idx, cnt = select_streaming(torch.tensor([3, 10, 100], dtype=torch.int32), 8)
    assert idx.dtype == torch.int32 and cnt.tolist() == [3, 8, 8]
    assert idx.tolist() == [[0, 1, 2, 0, 0, 0, 0, 0], [0, 1, 2, 3, 6, 7, 8, 9],
                            [0, 1, 2, 3, 96, 97, 98, 99]]


def test_selection_feeds_sparse_kernel():
    """End to end: scores -> Dustin selection -> sparse attention equals the reference on that set."""
    gen = torch.Generator().manual_seed(6)
    lengths = [333, 100, 17]
    q, k, v, L = _cache(3, 8, 4, 2, 64, lengths, torch.float32, gen)
    scores = torch.zeros(3, k.shape[2])
    attention_scores(q[:, :2], k, torch.tensor([0, 3], dtype=torch.int32), L, (L.long() - 1)[:, None], scores)
    idx, cnt = select_dustin(scores, torch.rand(3, k.shape[2], generator=gen), L, k=48, m=12)
    got = sparse_verify_attention(q, k, v, L, idx, cnt)
    torch.testing.assert_close(got, sparse_verify_attention_reference(q, k, v, L, idx, cnt),
                               **_tol(torch.float32))


# ---- per-KV-head index lists ([B, Hkv, K] / [B, Hkv], e.g. Quest's pages) ----

def _per_head_indices(lengths, Hkv, k_max, gen):
    """One list per (sequence, KV head): different positions and counts per head, 0-padded."""
    rows = [_random_indices(lengths, torch.randint(0, k_max + 1, (len(lengths),), generator=gen).tolist(),
                            k_max, gen) for _ in range(Hkv)]
    indices = torch.stack([r[0] for r in rows], dim=1)
    counts = torch.stack([r[1] for r in rows], dim=1)
    return torch.where(torch.arange(k_max) < counts[..., None], indices, 0), counts


# (Hq, Hkv, T, D, lengths, k_max, dtype, num_splits, block_n): GQA 1, 4, 7
PER_HEAD_CASES = [
    (4, 4, 2, 64, [100, 17], 48, torch.float32, None, 16),
    (8, 2, 5, 128, [333, 60], 96, torch.bfloat16, 3, 32),
    (28, 4, 5, 64, [200, 45, 17], 64, torch.float32, 1, None),
    (28, 4, 1, 64, [120], 80, torch.bfloat16, 2, 16),
]


@pytest.mark.parametrize("Hq,Hkv,T,D,lengths,k_max,dtype,splits,block_n", PER_HEAD_CASES)
def test_sparse_verify_per_kv_head_lists(Hq, Hkv, T, D, lengths, k_max, dtype, splits, block_n):
    gen = torch.Generator().manual_seed(11)
    q, k, v, L = _cache(len(lengths), Hq, Hkv, T, D, lengths, dtype, gen)
    indices, counts = _per_head_indices(lengths, Hkv, k_max, gen)
    got = sparse_verify_attention(q, k, v, L, indices, counts, num_splits=splits, block_n=block_n)
    want = sparse_verify_attention_reference(q, k, v, L, indices, counts)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    # Each query group used its own list: recompute group h with that list broadcast to every head.
    G = Hq // Hkv
    for h in range(Hkv):
        one = sparse_verify_attention_reference(q, k, v, L, indices[:, h], counts[:, h])
        torch.testing.assert_close(want[:, h * G:(h + 1) * G], one[:, h * G:(h + 1) * G])


def test_per_sequence_list_equals_per_head_broadcast():
    gen = torch.Generator().manual_seed(12)
    lengths = [150, 33]
    q, k, v, L = _cache(2, 8, 2, 3, 64, lengths, torch.float32, gen)
    indices, counts = _random_indices(lengths, [40, 33], 40, gen)
    flat = sparse_verify_attention(q, k, v, L, indices, counts, num_splits=2)
    per_head = sparse_verify_attention(q, k, v, L, indices[:, None].expand(2, 2, 40).contiguous(),
                                       counts[:, None].expand(2, 2).contiguous(), num_splits=2)
    torch.testing.assert_close(flat, per_head, atol=0, rtol=0)
    torch.testing.assert_close(sparse_verify_attention_reference(q, k, v, L, indices[:, None].expand(2, 2, 40),
                                                                 counts[:, None].expand(2, 2)),
                               sparse_verify_attention_reference(q, k, v, L, indices, counts))


@pytest.mark.parametrize("per_head", [False, True])
def test_sdpa_sparse_mask_matches_reference(per_head):
    """The SDPA path (sparse_mask + folded GQA mask) for both list layouts, with 0-padded short rows:
    padding at position 0 must not erase a real pick of position 0."""
    from dustin.attention.backend import AttentionBackend, sparse_mask
    from dustin.attention.context import SparsePlan

    gen = torch.Generator().manual_seed(13)
    lengths = [90, 20, 57]
    q, k, v, L = _cache(3, 12, 3, 4, 32, lengths, torch.float32, gen)
    if per_head:
        indices, counts = _per_head_indices(lengths, 3, 30, gen)
        indices[:, :, 0] = 0  # position 0 picked and padding present
    else:
        indices, counts = _random_indices(lengths, [25, 7, 0], 30, gen)
        indices = torch.where(torch.arange(30) < counts[:, None], indices, 0)
        indices[0, 0] = 0
    plan = SparsePlan(indices, counts)
    S = max(lengths) + 4
    mask = sparse_mask(L, plan, 4, S)
    assert mask.shape == (3, 3 if per_head else 1, 4, S)
    got = AttentionBackend("sdpa").sparse_verify(q, k, v, L, plan, max_len=S)
    want = sparse_verify_attention_reference(q, k, v, L, indices, counts)
    torch.testing.assert_close(got, want, **_tol(torch.float32))


# ---- the in-kernel merge: the split that finishes last (an arrival counter) merges, instead of a second launch

# (Hq, Hkv, T, D, lengths, counts, k_max, dtype, num_splits, block_n, per_head): GQA 1, 4, 7; T 1..8;
# ragged, incl. an empty list.
MERGE_CASES = [
    (4, 4, 1, 64, [17, 100], [17, 40], 40, torch.float32, 2, 16, False),
    (8, 2, 5, 64, [1000, 333], [150, 0], 150, torch.float32, 3, 32, False),
    (14, 2, 8, 64, [100, 1000], [100, 61], 128, torch.bfloat16, 4, 16, False),
    (28, 4, 5, 64, [200, 45, 17], None, 64, torch.float32, 2, 16, True),
    (8, 2, 3, 128, [333, 60], None, 96, torch.bfloat16, 4, 16, True),
]


@pytest.mark.parametrize("Hq,Hkv,T,D,lengths,counts,k_max,dtype,splits,block_n,per_head", MERGE_CASES)
def test_sparse_verify_in_kernel_merge(Hq, Hkv, T, D, lengths, counts, k_max, dtype, splits, block_n, per_head):
    from dustin.kernels.arrival import arrival_counters

    gen = torch.Generator().manual_seed(21)
    q, k, v, L = _cache(len(lengths), Hq, Hkv, T, D, lengths, dtype, gen)
    if per_head:
        indices, counts_t = _per_head_indices(lengths, Hkv, k_max, gen)
    else:
        indices, counts_t = _random_indices(lengths, counts, k_max, gen)
    want = sparse_verify_attention_reference(q, k, v, L, indices, counts_t)
    launch = sparse_verify_attention(q, k, v, L, indices, counts_t, num_splits=splits, block_n=block_n, merge=False)
    for _ in range(2):  # the second call checks that the counters were left at zero
        out = torch.full_like(q, float("nan"))
        got = sparse_verify_attention(q, k, v, L, indices, counts_t, num_splits=splits, block_n=block_n, out=out)
        torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
        torch.testing.assert_close(got, launch, atol=0, rtol=0)  # same partials, same merge order
        assert int(arrival_counters("cpu", 1).abs().sum()) == 0


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("per_head", [False, True])
def test_dense_rows_of_a_plan_see_the_whole_cache(backend, per_head):
    """`SparsePlan.dense` (`--budget-dense`): a dense row's output is full verification's, every other row's its
    sparse set's; the Triton path runs both kernels over the batch (each returning at once past the rows it does not
    own) and keeps each row's own."""
    from dustin.attention.backend import AttentionBackend
    from dustin.attention.context import SparsePlan

    gen = torch.Generator().manual_seed(21)
    lengths = [90, 140, 57, 33]
    q, k, v, L = _cache(4, 8, 2, 3, 32, lengths, torch.float32, gen)
    if per_head:
        indices, counts = _per_head_indices(lengths, 2, 24, gen)
    else:
        indices, counts = _random_indices(lengths, [20, 24, 9, 0], 24, gen)
    dense = torch.tensor([True, False, True, False])
    got = AttentionBackend(backend).sparse_verify(q, k, v, L, SparsePlan(indices, counts, dense),
                                                  max_len=max(lengths) + 3)
    full = verify_attention_reference(q, k, v, L)
    sparse = sparse_verify_attention_reference(q, k, v, L, indices, counts)
    for b in range(4):
        torch.testing.assert_close(got[b], (full if dense[b] else sparse)[b], **_tol(torch.float32))
    assert not torch.allclose(full[1], sparse[1])  # the rows' sets really drop positions
