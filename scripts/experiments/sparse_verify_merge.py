"""EXPERIMENT (not run by the engine): sparse verify attention whose splits are merged inside the same
launch. Moved out of dustin/kernels/sparse_verify.py, which keeps the engine's path (several splits merged
by a second, combine launch); same arguments and results as `sparse_verify_attention`.

Each split writes its unnormalised fp32 partial (acc, m, l), then bumps an atomic counter of its (sequence,
KV head); the split that finishes last merges all of them, writes the output and resets the counter to 0
(so CUDA-graph replays find it zeroed). One launch instead of two, at the cost of an atomic per program.

Measured on an H200 (scripts/gpu_tune.py, docs/results/gpu_tune_h200.json; bf16, k 512, Γ 4): the same
launch configuration is faster merged in-kernel (4 splits, BLOCK_N 64, 2 stages: 16.5 vs 20.2 us at
Qwen2.5-32B 8k x 8, 18.3 vs 21.1 us at 7B 32k x 16), and 4 splits merged in-kernel beat the engine's
default launch where B * Hkv is small (32B 8k x 8: 16.5 vs 17.5-18.8 us). At the goal setting (32k x 16)
the default (1 split, no merge at all) stays best (19.6 us; 22.4 us for the best in-kernel merge), so the
engine does not use it; it is a candidate for the small-B * Hkv shapes where the default does split.

    from scripts.experiments.sparse_verify_merge import sparse_verify_attention_kernel_merge
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from dustin.kernels.sparse_verify import (
    _LOG2E,
    _attend,
    _default_num_splits,
    _gather,
    _merge_rows,
    sparse_verify_attention,
)
from scripts.experiments.scratch import zeroed_int32


@triton.jit
def _split_kernel_merge(
    q_ptr, k_ptr, v_ptr, lengths_ptr, idx_ptr, counts_ptr, out_ptr,
    acc_ptr, ml_ptr,  # partials: acc [B*Hkv, NUM_SPLITS, BLOCK_M, D] fp32, ml [B*Hkv, NUM_SPLITS, 2, BLOCK_M]
    cnt_ptr,  # int32 [B*Hkv] finished-split counters, 0 between launches
    qk_scale,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    so_b, so_h, so_t, so_d,
    si_b, si_h, sc_b, sc_h,  # si_h / sc_h are 0 for a per-sequence list (broadcast over KV heads)
    H_KV: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NEW_N: tl.constexpr, IEEE: tl.constexpr,
):
    """dustin.kernels.sparse_verify._sparse_verify_split_kernel for NUM_SPLITS > 1, plus the merge."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
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
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + offs_n
        pos = tl.load(idx_row + n, mask=n < stop, other=0).to(tl.int64)
        ok = (n < stop) & (pos < length)
        acc, m_i, l_i = _attend(q, _gather(k_base, pos, ok, d, sk_s), _gather(v_base, pos, ok, d, sv_s),
                                ok[None, :], acc, m_i, l_i, qk_scale, IEEE)
    if split == NUM_SPLITS - 1:  # the new tokens, causally
        c = tl.arange(0, NEW_N)
        new_ok = c < T
        acc, m_i, l_i = _attend(q, _gather(k_base, length + c, new_ok, d, sk_s),
                                _gather(v_base, length + c, new_ok, d, sv_s),
                                c[None, :] <= t[:, None], acc, m_i, l_i, qk_scale, IEEE)

    part = pid_bh * NUM_SPLITS + split
    tl.store(acc_ptr + (part * BLOCK_M + rows[:, None]) * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(ml_ptr + part * 2 * BLOCK_M + rows, m_i, mask=row_ok)
    tl.store(ml_ptr + part * 2 * BLOCK_M + BLOCK_M + rows, l_i, mask=row_ok)
    # acq_rel: this split's partial stores are visible before its count, and the last split sees every
    # other split's partial. The last one merges, and resets the counter for the next launch.
    done = tl.atomic_add(cnt_ptr + pid_bh, 1, sem="acq_rel")
    if done == NUM_SPLITS - 1:
        tl.store(cnt_ptr + pid_bh, 0)
        _merge_rows(acc_ptr, ml_ptr, out_ptr, pid_bh, b, kvh, rows, so_b, so_h, so_t, so_d,
                    GROUP, T, D, NUM_SPLITS, BLOCK_M)


def sparse_verify_attention_kernel_merge(q, k_cache, v_cache, lengths, indices, counts, *, scale=None,
                                         num_splits=None, out=None, block_n=None, num_warps=None,
                                         num_stages=None):
    """`dustin.kernels.sparse_verify.sparse_verify_attention` (same arguments, same output) with the splits
    merged in the one launch. One split has nothing to merge: that case is the engine's kernel."""
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    per_head = indices.dim() == 3
    assert indices.shape[:-1] == ((B, Hkv) if per_head else (B,)) and counts.shape == indices.shape[:-1]
    assert Hq % Hkv == 0 and D >= 16 and (D & (D - 1)) == 0
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = Hq // Hkv
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    k_max = max(indices.shape[-1], 1)
    block_m = max(16, triton.next_power_of_2(group * T))
    block_n = block_n or (128 if block_m <= 64 else 64)  # as the engine's wrapper
    if num_splits is None:
        num_splits = _default_num_splits(B * Hkv, k_max, block_n, q.device)
    chunk = triton.cdiv(triton.cdiv(k_max, num_splits), block_n) * block_n
    num_splits = triton.cdiv(k_max, chunk)
    kw = {"scale": scale, "out": out, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
    if num_splits == 1:
        return sparse_verify_attention(q, k_cache, v_cache, lengths, indices, counts, num_splits=1, **kw)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty_like(q) if out is None else out
    acc_part = torch.empty(B * Hkv, num_splits, block_m, D, device=q.device, dtype=torch.float32)
    ml_part = torch.empty(B * Hkv, num_splits, 2, block_m, device=q.device, dtype=torch.float32)
    counters = zeroed_int32("split_counters", q.device, B * Hkv)
    ieee = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _split_kernel_merge[(B * Hkv, num_splits)](
        q, k_cache, v_cache, lengths, indices, counts, out, acc_part, ml_part, counters, scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        indices.stride(0), indices.stride(1) if per_head else 0, counts.stride(0), counts.stride(1) if per_head else 0,
        H_KV=Hkv, GROUP=group, T=T, D=D, CHUNK=chunk, NUM_SPLITS=num_splits,
        BLOCK_M=block_m, BLOCK_N=block_n, NEW_N=max(16, triton.next_power_of_2(T)), IEEE=ieee,
        num_warps=num_warps or (4 if block_m <= 64 else 8), num_stages=num_stages or 3,
    )
    return out
