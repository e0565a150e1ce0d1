"""EXPERIMENT (not run by the engine): Dustin's verification set (paper Eq. 6) in three Triton launches,
without torch.topk. Moved out of dustin/kernels/ because it measured slower than the default path
(`dustin.kernels.selection.select_dustin`, torch.topk between two Triton kernels); kept runnable here, with
its test in tests/test_select_radix.py, in case its 2-level histogram (below) is ever built.

    from scripts.experiments.select_radix import select_dustin_radix
    indices, counts = select_dustin_radix(s_target, s_draft, lengths, k=512, m=128)

Semantics are those of `selection.select_dustin_reference`: draft picks = the m best pickable positions
by s_draft, target picks = the n - m best of the rest by s_target (n = k - sinks - window), best meaning
higher score, then lower position. Why: on an H200, torch.topk over [2B, S] plus the two kernels around
it took 80-120 us a step (B 8-16, S 8k-32k), mostly a chain of small launches; this path is three.

Scores become int32 keys whose signed order is the float order (`_order_key`). Rows: the B draft rows
(when m > 0) then the B target rows; row r needs `need` = m (draft) or n (target) picks.
1. `_histogram_kernel`, grid (rows, chunks): a 2048-bin histogram of each chunk's top 11 key bits,
   added atomically into one histogram per row. The last chunk of a row to finish (atomic counter)
   finds the boundary bin b*: fewer than `need` keys lie above it, at least `need` at or above it.
   It writes (b*, count above), and leaves the histogram and counter at zero for the next call.
2. `_compact_kernel`, same grid: keys above b* are certain picks, keys in b* candidates; both are
   appended to per-row lists (atomic slot counters; order does not matter).
3. `_finish_kernel`, one program per sequence: picks the `need - above` best candidates by bisection
   over the low key bits and then over positions (ties), for the draft row and the target row; drops the
   draft picks from the target's n and keeps the n - m best of the rest (the target's n best contain the
   n - m best outside the draft picks); then protected + draft + target are sorted ascending into the row.
No host syncs; every size is a Python int, so the launches are CUDA-graph friendly.

Measured on an H200 (scripts/gpu_tune.py, docs/results/gpu_tune_h200.json): equal to the reference and to
the topk path, but SLOWER: 103 / 147 / 197 / 225 us at B 8 x 8k, 16 x 16k, 8 x 32k, 16 x 32k against 79-99 us
for the topk path, which is the engine's. The likely cause: 11 key bits are too coarse
for scores packed in a narrow range (the benchmark's uniform [0, 1) scores put a quarter of a row in one
bin), so the boundary bin holds thousands of candidates and step 3 takes its streamed path, ~37 serial
passes over them in one program per sequence. A second histogram level over the boundary bin's next bits
(inside step 3) would cut that to a few candidates; not built, since no device time was left to measure it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dustin.kernels.arrival import zeroed_int32
from dustin.kernels.selection import in_list, select_dustin, sort_row_width, write_sorted_row

SHIFT = 21  # the histogram bins the top 32 - SHIFT = 11 bits of a key
NB = 1 << (32 - SHIFT)
CHUNK = 4096
CAND_BLOCK = 1024  # candidates handled in registers at once by the finish kernel


@triton.jit
def _order_key(x):
    """fp32 -> int32 key with the same order (signed); -0.0 is folded into 0.0 as float compares do."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _row_keys(sd_ptr, st_ptr, lengths_ptr, r, c, B, S, sd_stride, st_stride,
              SINKS: tl.constexpr, WINDOW: tl.constexpr, BOTH: tl.constexpr, CH: tl.constexpr):
    """Row r's keys over chunk c, and which of those positions may be picked."""
    b = (r % B).to(tl.int64)
    L = tl.load(lengths_ptr + b)
    j = c * CH + tl.arange(0, CH)
    pickable = (j >= SINKS) & (j < L - WINDOW) & (j < S)
    if BOTH:  # rows 0 .. B-1 are the draft's
        row_ptr = tl.where(r < B, sd_ptr + b * sd_stride, st_ptr + b * st_stride)
    else:
        row_ptr = st_ptr + b * st_stride
    x = tl.load(row_ptr + j, mask=pickable, other=0.0).to(tl.float32)
    return j, _order_key(x), pickable


@triton.jit
def _histogram_kernel(sd_ptr, st_ptr, lengths_ptr, hist_ptr, done_ptr, meta_ptr, fill_ptr, B, S,
                      sd_stride, st_stride, SINKS: tl.constexpr, WINDOW: tl.constexpr, BOTH: tl.constexpr,
                      M: tl.constexpr, N_PICK: tl.constexpr, CH: tl.constexpr, SHIFT: tl.constexpr,
                      NB: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    _, key, pickable = _row_keys(sd_ptr, st_ptr, lengths_ptr, r, c, B, S, sd_stride, st_stride,
                                 SINKS, WINDOW, BOTH, CH)
    bins = tl.arange(0, NB)
    # No histogram mask (older Triton lacks it): unpickable slots go to bin 0 and are taken out again.
    h = tl.histogram(tl.where(pickable, (key >> SHIFT) + NB // 2, 0), NB)
    h -= tl.where(bins == 0, CH - tl.sum(pickable.to(tl.int32)), 0)
    tl.atomic_add(hist_ptr + r * NB + bins, h, mask=h > 0)
    tl.debug_barrier()  # every thread's histogram adds precede the release below
    done = tl.atomic_add(done_ptr + r, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:  # the row's last chunk: all adds are in
        tot = tl.load(hist_ptr + r * NB + bins, cache_modifier=".cg")
        tl.store(hist_ptr + r * NB + bins, tl.zeros([NB], dtype=tl.int32))
        tl.store(done_ptr + r, 0)
        if BOTH:
            need = tl.where(r < B, M, N_PICK)
        else:
            need = N_PICK
        at_or_above = tl.sum(tot, 0) - tl.cumsum(tot, 0) + tot
        b_star = tl.maximum(tl.max(tl.where(at_or_above >= need, bins, -1), 0), 0)
        tl.store(meta_ptr + 2 * r, b_star)
        tl.store(meta_ptr + 2 * r + 1, tl.sum(tl.where(bins > b_star, tot, 0), 0))
        tl.store(fill_ptr + 2 * r, 0)
        tl.store(fill_ptr + 2 * r + 1, 0)


@triton.jit
def _append(flag, pos, key, fill_ptr, pos_ptr, key_ptr):
    """Append the flagged (pos, key) pairs at an atomically reserved run of slots."""
    base = tl.atomic_add(fill_ptr, tl.sum(flag.to(tl.int32), 0))
    slot = base + tl.cumsum(flag.to(tl.int32), 0) - 1
    tl.store(pos_ptr + slot, pos, mask=flag)
    tl.store(key_ptr + slot, key, mask=flag)


@triton.jit
def _compact_kernel(sd_ptr, st_ptr, lengths_ptr, meta_ptr, fill_ptr, in_pos_ptr, in_key_ptr, cand_pos_ptr,
                    cand_key_ptr, B, S, sd_stride, st_stride, SINKS: tl.constexpr, WINDOW: tl.constexpr,
                    BOTH: tl.constexpr, NP_CAP: tl.constexpr, CH: tl.constexpr, SHIFT: tl.constexpr,
                    NB: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    j, key, pickable = _row_keys(sd_ptr, st_ptr, lengths_ptr, r, c, B, S, sd_stride, st_stride,
                                 SINKS, WINDOW, BOTH, CH)
    b_star = tl.load(meta_ptr + 2 * r)
    bin_ = (key >> SHIFT) + NB // 2
    r64 = r.to(tl.int64)
    _append(pickable & (bin_ > b_star), j, key, fill_ptr + 2 * r, in_pos_ptr + r64 * NP_CAP,
            in_key_ptr + r64 * NP_CAP)
    _append(pickable & (bin_ == b_star), j, key, fill_ptr + 2 * r + 1, cand_pos_ptr + r64 * S,
            cand_key_ptr + r64 * S)


@triton.jit
def _best(keys, pos, valid, want, lo, hi, N_ITER: tl.constexpr, POS_BITS: tl.constexpr):
    """Mask of the `want` best valid entries (higher key, then lower position); keys lie in [lo, hi]."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    for _ in tl.static_range(N_ITER):  # the want-th largest key: max t with #(key >= t) >= want
        mid = (lo + hi + 1) >> 1
        ok = tl.sum((valid & (keys >= mid)).to(tl.int32), 0) >= want
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    above = valid & (keys > lo)
    tie = valid & (keys == lo)
    ties_wanted = want - tl.sum(above.to(tl.int32), 0)
    p = lo * 0  # the ties_wanted-th smallest tied position: max p with #(tie, pos < p) < ties_wanted
    for bit in tl.static_range(POS_BITS - 1, -1, -1):
        trial = p | (1 << bit)
        p = tl.where(tl.sum((tie & (pos < trial)).to(tl.int32), 0) < ties_wanted, trial, p)
    p = tl.where(ties_wanted > 0, p, -1)
    return above | (tie & (pos <= p))


@triton.jit
def _finish_row(r, need, meta_ptr, fill_ptr, in_pos_ptr, in_key_ptr, cand_pos_ptr, cand_key_ptr, S,
                NP_CAP: tl.constexpr, CB: tl.constexpr, SHIFT: tl.constexpr, NB: tl.constexpr,
                POS_BITS: tl.constexpr):
    """Append row r's best `need - above` boundary candidates to its certain picks."""
    r64 = r.to(tl.int64)
    above = tl.load(meta_ptr + 2 * r + 1)
    n_cand = tl.load(fill_ptr + 2 * r + 1)
    want = tl.maximum(need - above, 0)
    lo = (tl.load(meta_ptr + 2 * r) - NB // 2) << SHIFT  # every candidate key shares the top bits
    hi = lo + ((1 << SHIFT) - 1)
    i = tl.arange(0, CB)
    kp, pp = cand_key_ptr + r64 * S, cand_pos_ptr + r64 * S
    if n_cand <= CB:  # the usual case: one register tile
        keys = tl.load(kp + i, mask=i < n_cand, other=0)
        pos = tl.load(pp + i, mask=i < n_cand, other=0)
        win = _best(keys, pos, i < n_cand, want, lo, hi, SHIFT, POS_BITS)
        _store_run(win, pos, keys, above, in_pos_ptr + r64 * NP_CAP, in_key_ptr + r64 * NP_CAP)
    else:  # many near-equal scores: the same bisections, streamed over the list in tiles
        lo64 = lo.to(tl.int64)
        hi64 = hi.to(tl.int64)
        for _ in tl.static_range(SHIFT):
            mid = (lo64 + hi64 + 1) >> 1
            cnt = 0
            for t0 in range(0, n_cand, CB):
                keys = tl.load(kp + t0 + i, mask=t0 + i < n_cand, other=0)
                cnt += tl.sum(((t0 + i < n_cand) & (keys >= mid)).to(tl.int32), 0)
            ok = cnt >= want
            lo64 = tl.where(ok, mid, lo64)
            hi64 = tl.where(ok, hi64, mid - 1)
        n_above = 0
        for t0 in range(0, n_cand, CB):
            keys = tl.load(kp + t0 + i, mask=t0 + i < n_cand, other=0)
            n_above += tl.sum(((t0 + i < n_cand) & (keys > lo64)).to(tl.int32), 0)
        ties_wanted = want - n_above
        p = lo64 * 0
        for bit in tl.static_range(POS_BITS - 1, -1, -1):
            trial = p | (1 << bit)
            cnt = 0
            for t0 in range(0, n_cand, CB):
                ok_i = t0 + i < n_cand
                keys = tl.load(kp + t0 + i, mask=ok_i, other=0)
                pos = tl.load(pp + t0 + i, mask=ok_i, other=0)
                cnt += tl.sum((ok_i & (keys == lo64) & (pos < trial)).to(tl.int32), 0)
            p = tl.where(cnt < ties_wanted, trial, p)
        written = above
        for t0 in range(0, n_cand, CB):
            ok_i = t0 + i < n_cand
            keys = tl.load(kp + t0 + i, mask=ok_i, other=0)
            pos = tl.load(pp + t0 + i, mask=ok_i, other=0)
            win = ok_i & ((keys > lo64) | ((keys == lo64) & (pos <= tl.where(ties_wanted > 0, p, -1))))
            _store_run(win, pos, keys, written, in_pos_ptr + r64 * NP_CAP, in_key_ptr + r64 * NP_CAP)
            written += tl.sum(win.to(tl.int32), 0)


@triton.jit
def _store_run(flag, pos, key, start, pos_ptr, key_ptr):
    slot = start + tl.cumsum(flag.to(tl.int32), 0) - 1
    tl.store(pos_ptr + slot, pos, mask=flag)
    tl.store(key_ptr + slot, key, mask=flag)


@triton.jit
def _finish_kernel(meta_ptr, fill_ptr, in_pos_ptr, in_key_ptr, cand_pos_ptr, cand_key_ptr, lengths_ptr,
                   scratch_ptr, idx_ptr, counts_ptr, B, S,
                   SINKS: tl.constexpr, WINDOW: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                   N_PICK: tl.constexpr, NP_CAP: tl.constexpr, NP_PAD: tl.constexpr, M_PAD: tl.constexpr,
                   SW_PAD: tl.constexpr, P: tl.constexpr, CB: tl.constexpr, SHIFT: tl.constexpr,
                   NB: tl.constexpr, POS_BITS: tl.constexpr):
    b = tl.program_id(0)
    if M > 0:
        rt = b + B
    else:
        rt = b
    if M > 0:
        _finish_row(b, M, meta_ptr, fill_ptr, in_pos_ptr, in_key_ptr, cand_pos_ptr, cand_key_ptr, S,
                    NP_CAP, CB, SHIFT, NB, POS_BITS)
    _finish_row(rt, N_PICK, meta_ptr, fill_ptr, in_pos_ptr, in_key_ptr, cand_pos_ptr, cand_key_ptr, S,
                NP_CAP, CB, SHIFT, NB, POS_BITS)
    tl.debug_barrier()  # the appended picks are visible to every thread below
    r = tl.arange(0, NP_PAD)
    t_row = rt.to(tl.int64) * NP_CAP
    target = tl.load(in_pos_ptr + t_row + r, mask=r < N_PICK, other=0)
    keep = r < N_PICK
    if M > 0:  # drop the draft's picks, keep the n - m best of the rest
        in_draft = in_list(target, in_pos_ptr + b.to(tl.int64) * NP_CAP, M, M_PAD)
        keys = tl.load(in_key_ptr + t_row + r, mask=r < N_PICK, other=0)
        lo = b.to(tl.int64) * 0 - 2147483648  # the whole int32 key range
        keep = _best(keys, target, keep & ~in_draft, N_PICK - M, lo, lo + 4294967295, 32, POS_BITS)
    draft = tl.load(in_pos_ptr + b.to(tl.int64) * NP_CAP + tl.arange(0, M_PAD), mask=tl.arange(0, M_PAD) < M, other=0)
    write_sorted_row(draft, target, keep, tl.load(lengths_ptr + b).to(tl.int32), b, scratch_ptr, idx_ptr, counts_ptr,
                     S, SINKS, WINDOW, K, M, NP_PAD, M_PAD, SW_PAD, P)


def select_dustin_radix(s_target, s_draft, lengths, *, k: int, m: int, sinks: int = 4, window: int = 16):
    """`select_dustin`'s sets (same arguments) from the three launches; the cases that the default path
    answers without its kernels (k <= sinks + window, S <= k, a sort row past 4096, CPU tensors outside
    the Triton interpreter) are handed to it. Returns (indices int32 [B, k], counts int32 [B])."""
    B, S = s_target.shape
    assert s_draft.shape == (B, S) and 0 <= m <= k - sinks - window
    kernels_ok = s_target.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if k - sinks - window == 0 or S <= k or sort_row_width(k, m, sinks, window) > 4096 or not kernels_ok:
        return select_dustin(s_target, s_draft, lengths, k=k, m=m, sinks=sinks, window=window)
    assert s_target.stride(1) == 1 and s_draft.stride(1) == 1
    return _launch(s_target, s_draft.to(s_target.dtype), lengths.to(s_target.device), k=k, m=m, sinks=sinks,
                   window=window, p=sort_row_width(k, m, sinks, window))


def _launch(s_target, s_draft, lengths, *, k: int, m: int, sinks: int, window: int, p: int):
    """The three launches; p = the padded width of the sort row."""
    B, S = s_target.shape
    device = s_target.device
    n_pick = k - sinks - window
    rows = 2 * B if m > 0 else B
    chunks = triton.cdiv(S, CHUNK)
    i32 = torch.int32
    hist = zeroed_int32("radix_hist", device, rows * NB)
    done = zeroed_int32("radix_done", device, rows)
    meta, fill = torch.empty(rows, 2, device=device, dtype=i32), torch.empty(rows, 2, device=device, dtype=i32)
    np_pad = triton.next_power_of_2(n_pick)
    in_pos, in_key = (torch.empty(rows, n_pick, device=device, dtype=i32) for _ in range(2))
    cand_pos, cand_key = (torch.empty(rows, S, device=device, dtype=i32) for _ in range(2))
    common = {"SINKS": sinks, "WINDOW": window, "BOTH": m > 0, "CH": CHUNK, "SHIFT": SHIFT, "NB": NB}
    strides = (s_draft.stride(0), s_target.stride(0))
    _histogram_kernel[(rows, chunks)](s_draft, s_target, lengths, hist, done, meta, fill, B, S, *strides,
                                      M=m, N_PICK=n_pick, num_warps=8, **common)
    _compact_kernel[(rows, chunks)](s_draft, s_target, lengths, meta, fill, in_pos, in_key, cand_pos, cand_key,
                                    B, S, *strides, NP_CAP=n_pick, num_warps=8, **common)
    scratch = torch.empty(B, p, device=device, dtype=i32)
    indices = torch.empty(B, k, device=device, dtype=i32)
    counts = torch.empty(B, device=device, dtype=i32)
    _finish_kernel[(B,)](meta, fill, in_pos, in_key, cand_pos, cand_key, lengths, scratch, indices, counts, B, S,
                         SINKS=sinks, WINDOW=window, K=k, M=m, N_PICK=n_pick, NP_CAP=n_pick, NP_PAD=np_pad,
                         M_PAD=max(32, triton.next_power_of_2(m)), SW_PAD=triton.next_power_of_2(sinks + window),
                         P=p, CB=CAND_BLOCK, SHIFT=SHIFT, NB=NB, POS_BITS=max(int(S).bit_length(), 1),
                         num_warps=8)
    return indices, counts
