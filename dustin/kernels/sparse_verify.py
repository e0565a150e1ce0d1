"""Sparse verify attention: the T new queries attend to a list of cached positions plus the new tokens
themselves (causally), reading the selected K/V rows in place from the cache. The list is either one per
sequence (indices [B, K], counts [B]: Dustin's layer- and head-invariant set) or one per KV head
(indices [B, Hkv, K], counts [B, Hkv]: Quest's per-head pages), shared by that head's query group.

Layout and masking follow dustin/attention/reference.py (`sparse_verify_attention_reference`).

Design (flash-decoding over the index list):
- One program = (sequence b, KV head, split of the index list). The G = Hq // Hkv query heads of that KV
  head and the T new queries are folded into the M rows of one tl.dot block (row r -> head r // T, query
  r % T), so every gathered K/V row is read once for the whole group instead of G times.
- K/V rows are addressed as cache_base + index * stride_s: no torch.gather copy, each row is D contiguous
  elements, so a gather costs exactly its bytes.
- Splits cover contiguous chunks of the index list; the last one also attends to the T new tokens with
  the causal mask. With several splits each writes unnormalised fp32 (acc, m, l); the split that finishes
  last (an arrival counter, dustin/kernels/arrival.py) merges them in split order within the same launch
  (`merge=False`: a second, combine kernel does; same bits). With one split (enough when B*Hkv fills the GPU)
  the kernel writes the output directly.
  Masked logits are -inf but the running max starts at a finite -1e30, so a split that sees no key
  (empty chunk, padding) yields acc = 0, l = 0 and no NaN.
- No host syncs: the grid depends only on shapes (indices.shape[1] bounds the work); counts and lengths
  stay on the device.
Measured on an H200 (bf16, k 512, T 5, CUDA graph, cold L2; scripts/gpu_sparse_kernels.py at commit 2927804): 15-20 us a
layer at Qwen2.5-7B/32B shapes, B 8-16, 8k-32k context (1.8 TB/s on the 34 MB of B 16 x Hkv 8), against
124-250 us for torch.gather + SDPA. Small problems sit on a ~14 us latency floor (index load, gather,
merge kernel), so the ~10 us the bytes alone allow is not reached. A sweep of 12 launch configurations
(splits 1-8, either merge, BLOCK_N 32-128, 2-8 warps, 1-4 stages; scripts/gpu_tune.py at commit 91e0610,
docs/results/gpu_tune_h200.json) found the default best at 32k x 16 (19.6 us on the 32B shape, next
22.4 us): 1 split there, as B * Hkv = 128 fills the SMs. Where the default splits (small B * Hkv: the 1.5B
target's 2 KV heads), the same launch configuration merged in-kernel was faster than with a combine launch in
every case measured (16.5 vs 20.2 us at 32B 8k x 8, 18.3 vs 21.1 us at 7B 32k x 16): hence the in-kernel merge.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dustin.kernels.arrival import arrival_counters, last_to_arrive, merge_partial
from dustin.kernels.dispatch import interpreting
from dustin.kernels.launch import num_sms, pdl_options, pdl_start, watched

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b. IEEE: fp32 operands and exact fp32 products (fp32 callers; and the CPU interpreter,
    whose bf16 tl.dot multiplies the raw uint16 bit patterns)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gather(base, pos, ok, d, stride_s):
    """Rows pos [N] of one (sequence, KV head) cache slice, read in place: [N, D]."""
    return tl.load(base + pos[:, None] * stride_s + d[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _attend(q, k, v, logit_mask, acc, m_i, l_i, qk_scale, IEEE: tl.constexpr, log2_w=None):
    """One online-softmax step over a gathered key block k, v [N, D]; logit_mask (broadcastable to
    [M, N]) says which logits count; log2_w [N] (or None), each key's log2-weight, added to its logit."""
    s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), IEEE)
    if log2_w is not None:
        s = tl.where(logit_mask, s * qk_scale + log2_w[None, :], float("-inf"))  # log2 domain
    else:
        s = tl.where(logit_mask, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return acc, m_new, l_i


@watched
@triton.jit
def _sparse_verify_split_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, idx_ptr, counts_ptr, w_ptr, out_ptr,
    acc_ptr, ml_ptr,  # partials: acc [B*Hkv, NUM_SPLITS, BLOCK_M, D] fp32, ml [B*Hkv, NUM_SPLITS, 2, BLOCK_M]
    cnt_ptr,  # MERGE: int32 arrival counters [B*Hkv], zero between launches (dustin/kernels/arrival.py)
    qk_scale,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    so_b, so_h, so_t, so_d,
    si_b, si_h, sc_b, sc_h,  # si_h / sc_h are 0 for a per-sequence list (broadcast over KV heads)
    sw_b, sw_h,  # the log-weights' strides (HAS_W), laid out like the indices
    H_KV: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NEW_N: tl.constexpr, IEEE: tl.constexpr,
    MERGE: tl.constexpr = False, HAS_W: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)  # int64: b * stride of a large cache overflows int32
    kvh = pid_bh % H_KV

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * T
    head = kvh * GROUP + rows // T
    t = rows % T
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :] * sq_d,
                mask=row_ok[:, None], other=0.0)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    count = tl.load(counts_ptr + b * sc_b + kvh * sc_h)
    start = split * CHUNK
    stop = tl.minimum(start + CHUNK, count)
    idx_row = idx_ptr + b * si_b + kvh * si_h
    w_row = w_ptr + b * sw_b + kvh * sw_h
    # Plain loop: Triton's software pipeliner (num_stages=3) already overlaps the index load and the
    # gathers of later blocks; hand-written index or K/V prefetching measured no faster on an H200.
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + offs_n
        pos = tl.load(idx_row + n, mask=n < stop, other=0).to(tl.int64)
        ok = (n < stop) & (pos < length)  # the reference ignores out-of-range positions; so do we
        if HAS_W:  # natural-log weights, read next to the indices, into the log2 domain
            log2_w = tl.load(w_row + n, mask=n < stop, other=0.0).to(tl.float32) * 1.4426950408889634
            acc, m_i, l_i = _attend(q, _gather(k_base, pos, ok, d, sk_s), _gather(v_base, pos, ok, d, sv_s),
                                    ok[None, :], acc, m_i, l_i, qk_scale, IEEE, log2_w)
        else:
            acc, m_i, l_i = _attend(q, _gather(k_base, pos, ok, d, sk_s), _gather(v_base, pos, ok, d, sv_s),
                                    ok[None, :], acc, m_i, l_i, qk_scale, IEEE)
    if split == NUM_SPLITS - 1:
        # The last split also takes the new tokens: key c (position length + c) is visible to query t
        # iff c <= t. Folding them in here (not a split of their own) saves one partial per program.
        c = tl.arange(0, NEW_N)
        new_ok = c < T
        acc, m_i, l_i = _attend(q, _gather(k_base, length + c, new_ok, d, sk_s),
                                _gather(v_base, length + c, new_ok, d, sv_s),
                                c[None, :] <= t[:, None], acc, m_i, l_i, qk_scale, IEEE)

    if NUM_SPLITS == 1:  # nothing to combine: normalise and write the output directly
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * so_b + head[:, None] * so_h + t[:, None] * so_t + d[None, :] * so_d,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = pid_bh * NUM_SPLITS + split
        tl.store(acc_ptr + (part * BLOCK_M + rows[:, None]) * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + part * 2 * BLOCK_M + rows, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 * BLOCK_M + BLOCK_M + rows, l_i, mask=row_ok)
        if MERGE:  # the split that finishes last merges them all, in this launch
            if last_to_arrive(cnt_ptr, pid_bh, NUM_SPLITS):
                _merge_rows(acc_ptr, ml_ptr, out_ptr, pid_bh, b, kvh, rows, so_b, so_h, so_t, so_d,
                            GROUP, T, D, NUM_SPLITS, BLOCK_M)


@watched
@triton.jit
def _sparse_verify_combine_kernel(
    acc_ptr, ml_ptr, out_ptr,
    so_b, so_h, so_t, so_d,
    H_KV: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False,
):
    # One program per (sequence, KV head, ROWS rows): many small programs keep this latency-bound merge short.
    pdl_start(PDL)
    pid_bh = tl.program_id(0)
    b = (pid_bh // H_KV).to(tl.int64)
    kvh = pid_bh % H_KV
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    _merge_rows(acc_ptr, ml_ptr, out_ptr, pid_bh, b, kvh, rows, so_b, so_h, so_t, so_d,
                GROUP, T, D, NUM_PARTS, BLOCK_M)


@triton.jit
def _merge_rows(acc_ptr, ml_ptr, out_ptr, pid_bh, b, kvh, rows, so_b, so_h, so_t, so_d,
                GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, NUM_PARTS: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Merge the NUM_PARTS partials of (sequence, KV head) pid_bh for the given rows and write them out.
    Loads go through L2 (.cg): the in-kernel merge reads partials that other SMs wrote in the same launch."""
    row_ok = rows < GROUP * T
    d = tl.arange(0, D)
    m_tot = tl.full([rows.shape[0]], -1.0e30, dtype=tl.float32)
    l_tot = tl.zeros([rows.shape[0]], dtype=tl.float32)
    acc = tl.zeros([rows.shape[0], D], dtype=tl.float32)
    for s in range(NUM_PARTS):
        part = pid_bh * NUM_PARTS + s
        m_s = tl.load(ml_ptr + part * 2 * BLOCK_M + rows, mask=row_ok, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(ml_ptr + part * 2 * BLOCK_M + BLOCK_M + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
        a_s = tl.load(acc_ptr + (part * BLOCK_M + rows[:, None]) * D + d[None, :], mask=row_ok[:, None],
                      other=0.0, cache_modifier=".cg")
        m_tot, l_tot, acc = merge_partial(m_tot, l_tot, acc, m_s, l_s, a_s)
    # l_tot >= 1 for every real row: the last split always sees new-token key c = 0.
    out = acc / tl.where(row_ok, l_tot, 1.0)[:, None]
    head = kvh * GROUP + rows // T
    t = rows % T
    tl.store(out_ptr + b * so_b + head[:, None] * so_h + t[:, None] * so_t + d[None, :] * so_d,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _default_num_splits(n_programs: int, k_max: int, block_n: int, device: torch.device) -> int:
    """About one program per SM: on an H200 (k 512) splitting B*Hkv = 128 programs only added partial
    traffic, while B*Hkv = 32 wanted 4 splits; never a split smaller than one block."""
    sms = num_sms(device, 4)
    return max(1, min(sms // max(n_programs, 1), triton.cdiv(k_max, block_n)))


def sparse_verify_attention(q, k_cache, v_cache, lengths, indices, counts, *, log_weights=None, scale=None,
                            num_splits=None, out=None, block_n=None, num_warps=None, num_stages=None, merge=True):
    """Attention of q [B, Hq, T, D] over cached positions indices[b, :counts[b]] (distinct, each < lengths[b])
    plus the new tokens lengths[b] .. lengths[b]+t (causal). Returns out [B, Hq, T, D] in q's dtype.
    Per-KV-head lists: indices [B, Hkv, K] / counts [B, Hkv]; query head h reads list h // (Hq // Hkv).
    log_weights (float, shaped like indices; `SparsePlan.bias`): position indices[.., i] enters the softmax with
    weight exp(log_weights[.., i]), its score plus that natural-log weight; the new tokens keep weight 1. None
    compiles the kernel without the weight's load and add (the bits of a plan without weights).
    block_n / num_warps / num_stages override the launch configuration (for tuning). merge: several splits are
    merged by the last of them to finish, in the same launch (False: by a second, combine launch; the same bits)."""
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    per_head = indices.dim() == 3
    assert indices.shape[:-1] == ((B, Hkv) if per_head else (B,)) and counts.shape == indices.shape[:-1], \
        f"indices {tuple(indices.shape)} / counts {tuple(counts.shape)}: want [B, K] / [B] or [B, Hkv, K] / [B, Hkv]"
    assert Hq % Hkv == 0 and D >= 16 and (D & (D - 1)) == 0, "need Hq % Hkv == 0 and D a power of two"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    group = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    if log_weights is not None:
        assert log_weights.shape == indices.shape and log_weights.is_floating_point(), \
            f"log_weights {tuple(log_weights.shape)} must be a float tensor shaped like indices {tuple(indices.shape)}"
        log_weights = log_weights if log_weights.stride(-1) == 1 else log_weights.contiguous()
    w = log_weights if log_weights is not None else indices  # unread without weights (HAS_W False)
    k_max = max(indices.shape[-1], 1)
    block_m = max(16, triton.next_power_of_2(group * T))
    # Tuned on an H200 (bf16, D 128, k 512): 128-row gathers with 3 pipeline stages keep the most bytes
    # in flight; halve them past 64 query rows to stay within registers.
    block_n = block_n or (128 if block_m <= 64 else 64)
    if num_splits is None:
        num_splits = _default_num_splits(B * Hkv, k_max, block_n, q.device)
    chunk = triton.cdiv(triton.cdiv(k_max, num_splits), block_n) * block_n
    num_splits = triton.cdiv(k_max, chunk)  # drop splits that could never hold an index
    if out is None:
        out = torch.empty_like(q)
    if num_splits > 1:
        acc_part = torch.empty(B * Hkv, num_splits, block_m, D, device=q.device, dtype=torch.float32)
        ml_part = torch.empty(B * Hkv, num_splits, 2, block_m, device=q.device, dtype=torch.float32)
    else:
        acc_part = ml_part = out  # unused
    # fp32 callers want fp32 accuracy, not tf32; the interpreter needs fp32 operands (see _dot).
    ieee = q.dtype == torch.float32 or interpreting()
    num_warps = num_warps or (4 if block_m <= 64 else 8)
    pdl = pdl_options(q.device)
    merge = merge and num_splits > 1
    counters = arrival_counters(q.device, B * Hkv) if merge else acc_part
    _sparse_verify_split_kernel[(B * Hkv, num_splits)](
        q, k_cache, v_cache, lengths, indices, counts, w, out, acc_part, ml_part, counters, scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        indices.stride(0), indices.stride(1) if per_head else 0, counts.stride(0), counts.stride(1) if per_head else 0,
        w.stride(0), w.stride(1) if per_head else 0,
        H_KV=Hkv, GROUP=group, T=T, D=D, CHUNK=chunk, NUM_SPLITS=num_splits,
        BLOCK_M=block_m, BLOCK_N=block_n, NEW_N=max(16, triton.next_power_of_2(T)), IEEE=ieee, MERGE=merge,
        HAS_W=log_weights is not None, num_warps=num_warps, num_stages=num_stages or 3, **pdl,
    )
    if num_splits > 1 and not merge:
        _sparse_verify_combine_kernel[(B * Hkv, block_m // 16)](
            acc_part, ml_part, out, *out.stride(),
            H_KV=Hkv, GROUP=group, T=T, D=D, NUM_PARTS=num_splits, BLOCK_M=block_m, ROWS=16, num_warps=4, **pdl,
        )
    return out
