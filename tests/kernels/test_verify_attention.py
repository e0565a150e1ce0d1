"""Split-K Triton verify attention and its SDPA path against the plain PyTorch reference (CPU, interpreter)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the triton import below

import pytest
import torch

pytest.importorskip("triton")

from dustin.attention.reference import verify_attention_reference  # noqa: E402
from dustin.attention.sdpa import verify_attention_sdpa  # noqa: E402
from dustin.kernels.sparse_verify import sparse_verify_attention  # noqa: E402
from dustin.kernels.verify_attention import default_num_splits, key_upper_bound, verify_attention  # noqa: E402


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)


def _inputs(lengths, Hq, Hkv, T, D, dtype=torch.float32, seed=0, slack=3):
    gen = torch.Generator().manual_seed(seed)
    B, S_cap = len(lengths), max(lengths) + T + slack  # slack: stale rows past the new tokens, as in a cache
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S_cap, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S_cap, D, generator=gen).to(dtype)
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def _both_paths(q, k, v, lengths, **kw):
    max_len = int(lengths.max()) + q.shape[2]
    return {"triton": verify_attention(q, k, v, lengths, **kw),
            "sdpa": verify_attention_sdpa(q, k, v, lengths, max_len=max_len, **kw)}


# (lengths, Hq, Hkv, T, D, dtype): ragged, non-power-of-two lengths; GQA ratios 1, 2, 4, 7, 8; T 1..16.
CASES = [
    ([1, 17, 100], 4, 2, 5, 64, torch.float32),
    ([333], 4, 4, 1, 128, torch.float32),
    ([100, 17], 8, 2, 8, 64, torch.bfloat16),
    ([1000, 1], 14, 2, 3, 64, torch.float32),
    ([17, 100], 14, 2, 16, 64, torch.bfloat16),
    ([5, 333], 8, 1, 2, 128, torch.bfloat16),
    ([1, 1], 2, 1, 4, 64, torch.float32),
]


@pytest.mark.parametrize("lengths,Hq,Hkv,T,D,dtype", CASES)
def test_matches_reference(lengths, Hq, Hkv, T, D, dtype):
    q, k, v, L = _inputs(lengths, Hq, Hkv, T, D, dtype)
    want = verify_attention_reference(q, k, v, L)
    for name, got in _both_paths(q, k, v, L).items():
        assert got.dtype == dtype and got.shape == q.shape, name
        torch.testing.assert_close(got, want, **_tol(dtype), msg=name)


@pytest.mark.parametrize("sinks,window", [(4, 1), (4, 8), (4, 100), (4, 5000), (0, 16), (4, 0)])
def test_streaming_matches_reference(sinks, window):
    q, k, v, L = _inputs([3, 17, 333], 4, 2, 5, 64)
    want = verify_attention_reference(q, k, v, L, sinks=sinks, window=window)
    for name, got in _both_paths(q, k, v, L, sinks=sinks, window=window).items():
        torch.testing.assert_close(got, want, **_tol(torch.float32), msg=name)


def test_streaming_bf16_gqa7():
    q, k, v, L = _inputs([40, 250], 14, 2, 4, 128, torch.bfloat16)
    want = verify_attention_reference(q, k, v, L, sinks=4, window=32)
    for name, got in _both_paths(q, k, v, L, sinks=4, window=32).items():
        torch.testing.assert_close(got, want, **_tol(torch.bfloat16), msg=name)


def test_streaming_reads_only_sinks_and_window():
    """Positions outside [0, sinks) and the window must not be read at all: NaN there changes nothing."""
    q, k, v, L = _inputs([300, 200], 4, 2, 3, 64)
    want = verify_attention_reference(q, k, v, L, sinks=4, window=20)
    for b, length in enumerate(L.tolist()):
        k[b, :, 4:length - 20 + 1] = float("nan")
        v[b, :, 4:length - 20 + 1] = float("nan")
    torch.testing.assert_close(verify_attention(q, k, v, L, sinks=4, window=20), want, **_tol(torch.float32))


@pytest.mark.parametrize("num_splits,block_n", [(1, 64), (2, 32), (7, 32), (1000, 64)])
def test_split_and_tile_overrides(num_splits, block_n):
    q, k, v, L = _inputs([100, 333], 8, 2, 5, 64)
    want = verify_attention_reference(q, k, v, L)
    got = verify_attention(q, k, v, L, num_splits=num_splits, block_n=block_n, num_warps=4, num_stages=2)
    torch.testing.assert_close(got, want, **_tol(torch.float32))


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("lengths,Hq,Hkv,T,D", [([517, 3, 260], 14, 2, 2, 64), ([700, 129], 14, 2, 5, 128)])
def test_direct_single_split_equals_split_and_reference(lengths, Hq, Hkv, T, D, streaming):
    """One split writes the output in place (no combine): same result as several splits and the reference,
    over ragged lengths, GQA 7, the draft's two-token first forward and a streaming window."""
    q, k, v, L = _inputs(lengths, Hq, Hkv, T, D, dtype=torch.bfloat16, seed=3)
    kw = dict(sinks=4, window=300) if streaming else {}
    want = verify_attention_reference(q, k, v, L, **kw)
    direct = verify_attention(q, k, v, L, num_splits=1, **kw)
    torch.testing.assert_close(direct, want, **_tol(torch.bfloat16))
    torch.testing.assert_close(verify_attention(q, k, v, L, num_splits=3, **kw), want, **_tol(torch.bfloat16))


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("lengths,Hq,Hkv,T,D,dtype,splits", [
    ([517, 3, 260], 14, 2, 2, 64, torch.bfloat16, 5), ([700, 129], 12, 2, 5, 128, torch.float32, 3),
    ([1000, 1, 64], 2, 2, 1, 64, torch.float32, 8)])
def test_in_kernel_merge_equals_the_combine_launch(lengths, Hq, Hkv, T, D, dtype, splits, streaming):
    """The split that finishes last merges every split of its (sequence, KV head) in the launch: bit-equal to the
    separate combine kernel (same partials, same merge order), also where short rows leave most splits idle (the
    counter waits only for the splits that hold keys), and the arrival counters are left at zero for the next
    launch (a graph replay)."""
    from dustin.kernels.arrival import arrival_counters

    q, k, v, L = _inputs(lengths, Hq, Hkv, T, D, dtype=dtype, seed=5)
    kw = dict(sinks=4, window=300) if streaming else {}
    two = verify_attention(q, k, v, L, num_splits=splits, merge=False, **kw)
    for _ in range(2):
        one = verify_attention(q, k, v, L, num_splits=splits, out=torch.full_like(q, float("nan")), **kw)
        assert torch.equal(one, two)
        assert int(arrival_counters("cpu", 1).abs().sum()) == 0
    torch.testing.assert_close(one, verify_attention_reference(q, k, v, L, **kw), **_tol(dtype))


def test_max_len_bounds_the_grid():
    """A tight max_len is exact; a grid sized from a much larger capacity gives the same result."""
    q, k, v, L = _inputs([50, 130], 4, 2, 4, 64, slack=400)
    want = verify_attention_reference(q, k, v, L)
    torch.testing.assert_close(verify_attention(q, k, v, L, max_len=134), want, **_tol(torch.float32))
    torch.testing.assert_close(verify_attention(q, k, v, L), want, **_tol(torch.float32))
    torch.testing.assert_close(verify_attention_sdpa(q, k, v, L, max_len=134), want, **_tol(torch.float32))


def test_poisoned_output_fully_overwritten():
    q, k, v, L = _inputs([17, 100], 14, 2, 5, 64)
    out = torch.full_like(q, float("nan"))
    got = verify_attention(q, k, v, L, out=out)
    assert got is out and not out.isnan().any()
    torch.testing.assert_close(out, verify_attention_reference(q, k, v, L), **_tol(torch.float32))


def test_stale_cache_rows_are_ignored():
    """Rows past each sequence's lengths + T (rolled-back drafts) never reach the result."""
    q, k, v, L = _inputs([20, 90], 4, 2, 3, 64, slack=50)
    want = verify_attention_reference(q, k, v, L)
    for b, end in enumerate((L + 3).tolist()):
        k[b, :, end:], v[b, :, end:] = float("nan"), float("nan")
    torch.testing.assert_close(verify_attention(q, k, v, L), want, **_tol(torch.float32))
    for b, end in enumerate((L + 3).tolist()):  # SDPA multiplies masked rows by 0: only finite junk is ignored
        k[b, :, end:], v[b, :, end:] = 1e4, -1e4
    torch.testing.assert_close(verify_attention_sdpa(q, k, v, L, max_len=93), want, **_tol(torch.float32))


def test_noncontiguous_q_and_out_and_int64_lengths():
    q, k, v, L = _inputs([33, 64], 8, 2, 4, 64)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, Hq, D] storage, as a model produces
    out = torch.empty(2, 4, 8, 64).transpose(1, 2)
    got = verify_attention(q_strided, k, v, L.long(), out=out)
    torch.testing.assert_close(got, verify_attention_reference(q, k, v, L), **_tol(torch.float32))
    torch.testing.assert_close(verify_attention_sdpa(q_strided, k, v, L.long(), max_len=68), got,
                               **_tol(torch.float32))


def test_wrong_inputs_change_the_result():
    """The comparisons above can fail: off-by-one lengths or a wrong GQA head mapping are detected."""
    q, k, v, L = _inputs([40, 77], 8, 2, 4, 64, slack=8)
    want = verify_attention_reference(q, k, v, L)
    for name, got in _both_paths(q, k, v, L + 1).items():
        assert not torch.allclose(got, want, atol=1e-3), name
    swapped = verify_attention(q, k.flip(1), v.flip(1), L)  # KV heads swapped: query heads hit the wrong group
    assert not torch.allclose(swapped, want, atol=1e-3)


def test_rejects_unsupported_inputs():
    q, k, v, L = _inputs([10], 4, 2, 2, 48)
    with pytest.raises(ValueError, match="power-of-two"):
        verify_attention(q, k, v, L)
    q, k, v, L = _inputs([10], 6, 4, 2, 64)
    with pytest.raises(ValueError, match="multiple"):
        verify_attention(q, k, v, L)
    with pytest.raises(ValueError, match="dtype"):
        verify_attention(q[:, :4].bfloat16(), k[:, :2], v[:, :2], L)


def test_num_splits_heuristic():
    # a short range is one split written in place: the streaming 0.5B draft's window at D 64 in bf16
    assert default_num_splits(32, 4 + 508 + 2, 64) == 3  # the streaming draft's window: 3 splits of 3 tiles
    assert default_num_splits(32, 2048, 64) == 8  # longer: one wave
    assert default_num_splits(64, 8197, 64) == 4  # fills one wave of 2 programs x 132 SMs
    assert default_num_splits(128, 32773, 64) == 2
    assert default_num_splits(512, 32773, 64) == 1  # more (sequence, head) pairs than slots: no split
    assert default_num_splits(2, 100, 64) == 1  # 2 tiles: one split, written in place
    assert default_num_splits(2, 6 * 64, 64) == 2  # never fewer than 3 tiles a split
    assert key_upper_bound(32773, 5, sinks=4, window=508) == 4 + 508 + 4
    assert key_upper_bound(300, 5, sinks=4, window=508) == 300
    assert key_upper_bound(300, 5, sinks=4, window=0) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_batch_or_the_bound(dtype):
    """Each sequence cuts its own keys into the grid's splits: row 1's output is bit-equal whether its neighbour is
    short or long, and whether the grid was sized by a tight bound or a slot capacity 8x larger (a server's
    graph); the split count itself is the grid's (from the batch width), as before."""
    q, k, v, _ = _inputs([700, 1200], 8, 2, 5, 64, dtype, slack=3000)
    row = []
    for other, bound in ((10, None), (1190, None), (10, 1205), (1190, 4000)):
        L = torch.tensor([other, 1200], dtype=torch.int32)
        row.append(verify_attention(q, k, v, L, max_len=bound, num_splits=4)[1])
    assert all(torch.equal(r, row[0]) for r in row[1:])
    ref = verify_attention_reference(q[1:], k[1:], v[1:], torch.tensor([1200], dtype=torch.int32))
    torch.testing.assert_close(row[0], ref[0], **_tol(dtype))


def test_triton_backend_writes_the_o_proj_input_in_place():
    """The Triton backend's verify and sparse-verify outputs are [B, Hq, T, D] views of token-major memory: the
    o_proj input `out.transpose(1, 2).reshape(B, T, Hq * D)` is a view of the same storage (no copy kernel), and the
    values are those of the head-major output."""
    from dustin.attention.backend import AttentionBackend
    from dustin.attention.context import SparsePlan

    q, k, v, L = _inputs([100, 33], 8, 2, 5, 64, dtype=torch.bfloat16, seed=7)
    tri = AttentionBackend("triton")
    idx = torch.stack([torch.randperm(30)[:24] for _ in range(2)]).int()
    cnt = torch.tensor([24, 17], dtype=torch.int32)
    plan = SparsePlan(idx, cnt)
    for got, want in ((tri.verify(q, k, v, L, max_len=110), verify_attention(q, k, v, L, max_len=110)),
                      (tri.sparse_verify(q, k, v, L, plan, max_len=110),
                       sparse_verify_attention(q, k, v, L, idx, cnt))):
        assert got.shape == want.shape and torch.equal(got, want)
        assert not want.transpose(1, 2).is_contiguous()  # the head-major layout needs a copy there
        flat = got.transpose(1, 2).reshape(2, 5, 8 * 64)
        assert flat.data_ptr() == got.data_ptr()  # a view of the kernel's output: no copy
