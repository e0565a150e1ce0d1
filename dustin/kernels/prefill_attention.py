"""Chunked, batched prefill attention in Triton: several sequences' prompt chunks in one launch, each chunk
attending causally over its own row's cached prefix and itself.

Layout (FlashInfer-style: the host plans once per forward, the kernel runs over explicit index metadata):
- q: [Hq, N, D], the N packed new tokens of every chunk (chunk c holds tokens q_start[c] .. q_start[c] + len[c]);
- k_cache, v_cache: one layer's [B, Hkv, S_cap, D]; chunk c's keys and values are row[c]'s positions
  0 .. pos0[c] + len[c] - 1 (the chunk's own K/V already written there);
- the query at packed index q_start[c] + i sits at position pos0[c] + i and sees keys j <= pos0[c] + i.
`PrefillPlan` (prefill_plan.py) holds the per-chunk arrays and a tile list (chunk, query block) that sizes
the grid exactly, so ragged chunks cost only their own tiles and no [N, S] mask is ever built.

Why this design:
- Prefill is compute-bound (a query block reuses each K/V tile BLOCK_M times), so it is a FlashAttention-2
  forward: one program per (query block of one chunk, query head), online softmax over key blocks of BLOCK_N.
- Batch invariance: the key blocks are anchored at absolute position 0 and the block sizes are fixed (no
  autotuning), so a query's result depends only on its own row's keys and values, never on where its chunk
  starts, how long it is or what else shares the launch. Key blocks that lie wholly past a query are fully
  masked, and an online-softmax update with an all-masked block leaves (m, l, acc) bit-for-bit unchanged
  (alpha = 1, p = 0). So a prompt prefilled in one piece or in chunks, alone or beside other requests, gets
  the same K/V cache and the same first token: the basis of the server's batch-invariant greedy output.
- GQA: query head h reads KV head h // G; the G programs of one KV head re-read its tiles from L2.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dustin.kernels.dispatch import interpreting
from dustin.kernels.launch import watched
from dustin.kernels.prefill_plan import PrefillPlan

BLOCK_N = 64  # keys per inner step (also the anchor of the batch-invariant key blocking)


@watched
@triton.jit
def _prefill_attention_kernel(
        Q, K, V, Out, Rows, QStart, Lens, Pos0, TileChunk, TileBlock,
        sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, so_h, so_t, so_d,
        qk_scale_log2,
        G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    chunk = tl.load(TileChunk + tile)
    block = tl.load(TileBlock + tile)
    row = tl.load(Rows + chunk).to(tl.int64)
    q0 = tl.load(QStart + chunk).to(tl.int64)
    n = tl.load(Lens + chunk)
    p0 = tl.load(Pos0 + chunk)
    kv_head = head // G

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n
    qpos = p0 + offs_m  # absolute query positions
    dims = tl.arange(0, D)
    q = tl.load(Q + head * sq_h + (q0 + offs_m)[:, None] * sq_t + dims[None, :] * sq_d, mask=row_ok[:, None],
                other=0.0)
    if UPCAST_DOT:  # Triton's CPU interpreter multiplies bf16 bit patterns as integers: use fp32 there
        q = q.to(tl.float32)
    p_dtype: tl.constexpr = V.dtype.element_ty
    k_base = K + row * sk_b + kv_head * sk_h
    v_base = V + row * sv_b + kv_head * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    last_q = p0 + tl.minimum(block * BLOCK_M + BLOCK_M, n) - 1
    # One loop, the causal mask applied to every key block: the same instruction sequence for every (query, key
    # block) pair wherever the tile starts (an unmasked fast loop for the blocks below the diagonal measured
    # bit-different on the H200 for D 64, where the compiler fused the scale into exp2 differently in the two
    # loops). Blocks wholly past a row leave its state unchanged.
    for k0 in range(0, last_q + 1, BLOCK_N):
        kpos = k0 + tl.arange(0, BLOCK_N)
        k_ok = kpos <= last_q
        k = tl.load(k_base + kpos[:, None] * sk_s + dims[None, :] * sk_d, mask=k_ok[:, None], other=0.0)
        v = tl.load(v_base + kpos[:, None] * sv_s + dims[None, :] * sv_d, mask=k_ok[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + head * so_h + (q0 + offs_m)[:, None] * so_t + dims[None, :] * so_d,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan,
                      scale: float | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, block_n: int = BLOCK_N) -> torch.Tensor:
    """q [Hq, Np, D] (Np >= plan.n_tokens; rows past it are padding and come out zero) -> [Hq, Np, D]. The query
    block is the plan's (`PrefillPlan.build(block_m=...)`); num_warps / num_stages override the defaults."""
    Hq, Np, D = q.shape
    Hkv = k_cache.shape[1]
    if Hq % Hkv or D & (D - 1) or D < 16:
        raise ValueError(f"prefill attention needs Hq % Hkv == 0 and a power-of-two head_dim >= 16, got "
                         f"Hq={Hq}, Hkv={Hkv}, D={D}")
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros_like(q)
    interpret = interpreting()
    fp32 = q.dtype == torch.float32
    grid = (plan.tile_chunk.numel(), Hq)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, plan.rows, plan.q_start, plan.lengths, plan.pos0, plan.tile_chunk,
        plan.tile_block, *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        scale * 1.4426950408889634,
        G=Hq // Hkv, D=D, BLOCK_M=plan.block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if fp32 else "tf32", UPCAST_DOT=interpret and not fp32,
        num_warps=num_warps or 4, num_stages=num_stages or (2 if interpret else 3))
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                plan: PrefillPlan, scale: float | None = None) -> torch.Tensor:
    """fp32 PyTorch semantics of `prefill_attention`, one chunk at a time (slow on purpose)."""
    Hq, Np, D = q.shape
    G = Hq // k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros_like(q)
    start = 0
    for row, p0, n in plan.host:
        qs = q[:, start:start + n].float()
        k = k_cache[row, :, :p0 + n].float().repeat_interleave(G, dim=0)
        v = v_cache[row, :, :p0 + n].float().repeat_interleave(G, dim=0)
        s = torch.einsum("htd,hsd->hts", qs, k) * scale
        qpos = torch.arange(p0, p0 + n, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(p0 + n, device=q.device)[None, :] > qpos, float("-inf"))
        out[:, start:start + n] = torch.einsum("hts,hsd->htd", s.softmax(-1), v).to(q.dtype)
        start += n
    return out


def prefill_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           plan: PrefillPlan) -> torch.Tensor:
    """The CPU path: PyTorch SDPA per chunk, GQA folded without repeating K/V. A chunk with no cached prefix
    uses SDPA's own causal mask; a later chunk gets a [len, pos0 + len] boolean mask (host memory, a few MB)."""
    import torch.nn.functional as F

    Hq, Np, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    out = torch.zeros_like(q)
    start = 0
    for row, p0, n in plan.host:
        qs = q[:, start:start + n].reshape(Hkv, G, n, D)
        k, v = k_cache[row, :, :p0 + n][:, None], v_cache[row, :, :p0 + n][:, None]
        if p0 == 0:
            o = F.scaled_dot_product_attention(qs, k.expand(Hkv, G, n, D), v.expand(Hkv, G, n, D), is_causal=True)
        else:
            j = torch.arange(p0 + n, device=q.device)
            mask = j[None, :] <= torch.arange(p0, p0 + n, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
        out[:, start:start + n] = o.reshape(Hq, n, D)
        start += n
    return out
