"""Importance-score estimation (paper Eq. 5, Sec. 4.2.3): the softmax mass that a few selected heads'
queries put on every committed context position, accumulated into a per-sequence score buffer.

    out[b, j] += sum_{h, t} softmax_j(q_sel[b, h, t] . k_cache[b, kv_heads[h], j] * scale)
                 for j < ctx_lengths[b]; the softmax of query (b, t) runs over keys
                 j <= query_positions[b, t] and j < key_lengths[b].

FlashAttention never materialises these probabilities, so they are recomputed for the few Semantic
Retrieval Heads only. Design:
- All Hs heads x Tq queries are folded into the rows of one tl.dot block (row r -> head r // Tq, query
  r % Tq). Per key block, each head's K tile is loaded and multiplied with the Q rows of that head only
  (other rows zeroed), summed into one logit tile. Heads sharing a KV head load the same tile back to
  back, so the re-read hits L1/L2 and HBM sees each KV head's keys about once per pass.
- Pass 1 (grid B x P, key blocks strided over the P programs so ragged lengths stay balanced) writes a
  per-program running (max, sum-exp) per row; a tiny combine turns them into one log-sum-exp per row.
- Pass 2 recomputes the logits; a program owns disjoint key blocks of one sequence and sums all rows'
  normalised probabilities into out[b, j] with a plain read-add-write: no atomics, deterministic.
- No host syncs: grids depend only on shapes.
Measured on an H200 (bf16, CUDA graph, cold L2), B 16 x 32k: 80 us for one target head (D 128, 1 query)
and 97 us for 4 draft heads on 2 KV heads (D 64, 4 queries): both ~3 TB/s over two reads of K.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


@triton.jit
def _logits(q_ptr, k_ptr, kvh_ptr, b, j, j_ok, row_head, row_t, d,
            sq_b, sq_h, sq_t, sk_b, sk_h, sk_s,
            HS: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Raw logits [R_PAD, BLOCK_N] of every (head, query) row against keys j of its own KV head."""
    s = tl.zeros([R_PAD, BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(HS):
        kvh = tl.load(kvh_ptr + h).to(tl.int64)
        k = tl.load(k_ptr + b * sk_b + kvh * sk_h + j[:, None] * sk_s + d[None, :],
                    mask=j_ok[:, None], other=0.0)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + row_t[:, None] * sq_t + d[None, :],
                    mask=(row_head == h)[:, None], other=0.0)
        if IEEE:  # fp32 callers, and the CPU interpreter whose bf16 tl.dot multiplies raw bit patterns
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), s, input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), s)
    return s


@triton.jit
def _score_pass1_kernel(q_ptr, k_ptr, kvh_ptr, klen_ptr, qpos_ptr, ml_ptr, qk_scale,
                        sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sp_b, sp_t, S_CAP,
                        HS: tl.constexpr, TQ: tl.constexpr, D: tl.constexpr, NUM_PROGS: tl.constexpr,
                        R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride of a large cache overflows int32
    pid = tl.program_id(1)
    rows = tl.arange(0, R_PAD)
    row_ok = rows < HS * TQ
    row_head = tl.where(row_ok, rows // TQ, -1)
    row_t = rows % TQ
    d = tl.arange(0, D)
    qpos = tl.load(qpos_ptr + b * sp_b + row_t * sp_t, mask=row_ok, other=-1).to(tl.int64)
    key_end = tl.minimum(tl.minimum(tl.load(klen_ptr + b).to(tl.int64), S_CAP), tl.max(qpos, 0) + 1)
    m_i = tl.full([R_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([R_PAD], dtype=tl.float32)
    for blk in range(pid, tl.cdiv(key_end, BLOCK_N), NUM_PROGS):
        j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < key_end
        s = _logits(q_ptr, k_ptr, kvh_ptr, b, j, j_ok, row_head, row_t, d,
                    sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, HS, R_PAD, BLOCK_N, IEEE)
        s = tl.where(j_ok[None, :] & (j[None, :] <= qpos[:, None]), s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    base = ml_ptr + (b * NUM_PROGS + pid) * 2 * R_PAD
    tl.store(base + rows, m_i)
    tl.store(base + R_PAD + rows, l_i)


@triton.jit
def _score_combine_kernel(ml_ptr, lse_ptr, NUM_PROGS: tl.constexpr, P_PAD: tl.constexpr,
                          R_PAD: tl.constexpr):
    b = tl.program_id(0)
    p = tl.arange(0, P_PAD)
    rows = tl.arange(0, R_PAD)
    base = ml_ptr + (b * NUM_PROGS + p[:, None]) * 2 * R_PAD + rows[None, :]
    m = tl.load(base, mask=(p < NUM_PROGS)[:, None], other=-1.0e30)
    l = tl.load(base + R_PAD, mask=(p < NUM_PROGS)[:, None], other=0.0)
    m_max = tl.max(m, 0)
    l_tot = tl.sum(l * tl.exp2(m - m_max[None, :]), 0)
    # A row with no visible key (padding) gets +inf so its probabilities come out as exactly 0.
    lse = tl.where(l_tot > 0, m_max + tl.log2(tl.maximum(l_tot, 1e-30)), float("inf"))
    tl.store(lse_ptr + b * R_PAD + rows, lse)


@triton.jit
def _score_pass2_kernel(q_ptr, k_ptr, kvh_ptr, klen_ptr, ctx_ptr, qpos_ptr, lse_ptr, out_ptr, qk_scale,
                        sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sp_b, sp_t, so_b, S_CAP,
                        HS: tl.constexpr, TQ: tl.constexpr, D: tl.constexpr, NUM_PROGS: tl.constexpr,
                        R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride of a large cache overflows int32
    pid = tl.program_id(1)
    rows = tl.arange(0, R_PAD)
    row_ok = rows < HS * TQ
    row_head = tl.where(row_ok, rows // TQ, -1)
    row_t = rows % TQ
    d = tl.arange(0, D)
    qpos = tl.load(qpos_ptr + b * sp_b + row_t * sp_t, mask=row_ok, other=-1).to(tl.int64)
    lse = tl.load(lse_ptr + b * R_PAD + rows)
    key_end = tl.minimum(tl.load(klen_ptr + b).to(tl.int64), S_CAP)
    out_end = tl.minimum(tl.load(ctx_ptr + b).to(tl.int64), key_end)
    for blk in range(pid, tl.cdiv(out_end, BLOCK_N), NUM_PROGS):
        j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < out_end
        s = _logits(q_ptr, k_ptr, kvh_ptr, b, j, j_ok, row_head, row_t, d,
                    sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, HS, R_PAD, BLOCK_N, IEEE)
        visible = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= qpos[:, None])
        p = tl.where(visible, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
        o_ptrs = out_ptr + b * so_b + j
        tl.store(o_ptrs, tl.load(o_ptrs, mask=j_ok, other=0.0) + tl.sum(p, 0), mask=j_ok)


def attention_scores(q_sel, k_cache, kv_heads, key_lengths, query_positions, out, *, scale=None,
                     ctx_lengths=None, num_programs=None, block_n=None, num_warps=None, num_stages=None):
    """Accumulate the softmax mass of q_sel [B, Hs, Tq, D] (head h reads KV head kv_heads[h] of k_cache
    [B, Hkv, S_cap, D]) into out fp32 [B, S_cap] for j < ctx_lengths[b] (default key_lengths). Returns out.
    num_programs (per sequence) / block_n / num_warps / num_stages override the launch (for tuning)."""
    B, Hs, Tq, D = q_sel.shape
    S_cap = k_cache.shape[2]
    assert out.dtype == torch.float32 and out.shape[0] == B and out.shape[1] >= S_cap and out.stride(1) == 1
    assert q_sel.stride(-1) == 1 and k_cache.stride(-1) == 1 and D >= 16 and (D & (D - 1)) == 0
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    ctx_lengths = key_lengths if ctx_lengths is None else ctx_lengths
    query_positions = query_positions.expand(B, Tq) if query_positions.dim() == 2 else query_positions
    r_pad = max(16, triton.next_power_of_2(Hs * Tq))
    block_n = block_n or (64 if r_pad * D <= 64 * 128 else 32)
    if num_programs is None:
        # ~4 programs per SM over the whole batch (an H200 sweep found 2-8 within 5% of each other)
        num_programs = triton.cdiv(4 * _num_sms(q_sel.device), B)
    num_programs = max(1, min(num_programs, triton.cdiv(S_cap, block_n)))
    ml = torch.empty(B, num_programs, 2, r_pad, device=q_sel.device, dtype=torch.float32)
    lse = torch.empty(B, r_pad, device=q_sel.device, dtype=torch.float32)
    kv_heads = kv_heads.to(device=q_sel.device, dtype=torch.int32)
    ieee = q_sel.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    num_warps = num_warps or (4 if r_pad <= 32 else 8)
    common = {"HS": Hs, "TQ": Tq, "D": D, "NUM_PROGS": num_programs, "R_PAD": r_pad, "BLOCK_N": block_n,
              "IEEE": ieee, "num_warps": num_warps, "num_stages": num_stages or 2}
    strides = (*q_sel.stride()[:3], *k_cache.stride()[:3], *query_positions.stride())
    _score_pass1_kernel[(B, num_programs)](q_sel, k_cache, kv_heads, key_lengths, query_positions, ml,
                                           scale * _LOG2E, *strides, S_cap, **common)
    _score_combine_kernel[(B,)](ml, lse, NUM_PROGS=num_programs,
                                P_PAD=triton.next_power_of_2(num_programs), R_PAD=r_pad)
    _score_pass2_kernel[(B, num_programs)](q_sel, k_cache, kv_heads, key_lengths, ctx_lengths,
                                           query_positions, lse, out, scale * _LOG2E, *strides,
                                           out.stride(0), S_cap, **common)
    return out


def attention_scores_reference(q_sel, k_cache, kv_heads, key_lengths, query_positions, out, *, scale=None,
                               ctx_lengths=None):
    """Plain float32 PyTorch version of `attention_scores` (slow on purpose; defines the semantics)."""
    B, _, Tq, D = q_sel.shape
    S_cap = k_cache.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    ctx_lengths = key_lengths if ctx_lengths is None else ctx_lengths
    k = k_cache[:, kv_heads.long()].float()  # [B, Hs, S_cap, D]
    logits = torch.einsum("bhtd,bhsd->bhts", q_sel.float(), k) * scale
    j = torch.arange(S_cap, device=q_sel.device)
    visible = (j[None, None, :] <= query_positions.long().expand(B, Tq)[:, :, None]) & \
              (j[None, None, :] < key_lengths.long()[:, None, None])  # [B, Tq, S_cap]
    probs = logits.masked_fill(~visible[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    mass = probs.sum(dim=(1, 2)) * (j[None, :] < ctx_lengths.long()[:, None])
    out[:, :S_cap] += mass
    return out
