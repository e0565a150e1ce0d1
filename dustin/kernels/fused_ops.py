"""Fused elementwise kernels for decode-sized forwards: residual add + RMSNorm, RoPE on q and k at once, the
SwiGLU epilogue SiLU(gate) * up, and the capture of a few heads' queries for the lookahead scores.

Why: a decode or verify step has B * (Γ+1) <= 128 rows, so every elementwise op is a tiny kernel whose cost is
its launch (~3-5 us even inside a CUDA graph), not its bytes. In eager PyTorch an RMSNorm is ~7 kernels and
RoPE ~7 per tensor: ~30 of the ~45 kernels of a layer. These two kernels do the same math in one launch each
(a 24-layer draft forward drops from ~1050 kernels to ~450). Numerics follow the PyTorch ops they replace
(`dustin.models.transformer.rms_norm`, `dustin.models.rope.apply_rope`): fp32 statistics, the same rounding points to
the activation dtype;
Triton may fuse a multiply-add where PyTorch rounds twice, so results can differ in the last fp32 bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dustin.kernels.dispatch import triton_ok
from dustin.kernels.launch import pdl_options, pdl_start, watched


@watched
@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
    if HAS_RES:  # residual stream += x, rounded to the activation dtype as a PyTorch add would
        x = (x.to(tl.float32) + tl.load(res_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x, or of residual + x (then also returns that sum: the new residual stream).

    Returns normed, or (new_residual, normed) when `residual` is given. x [..., N] contiguous."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    assert x2.is_contiguous() and weight.dtype == x.dtype, "contiguous activations and a weight of their dtype"
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, N) if residual is not None else x2
    block = triton.next_power_of_2(N)
    _add_rms_norm_kernel[(x2.shape[0],)](x2, res, weight, out, total, N, eps, HAS_RES=residual is not None,
                                         BLOCK=block, num_warps=min(16, max(1, block // 512)), **pdl_options(x.device))
    if residual is None:
        return out.view_as(x)
    return total.view_as(x), out.view_as(x)


@watched
@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, pos_ptr, T, HKV,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sc_b, sc_t,
                 sc_row, sc_head, sc_pos, sp_b, sp_t,
                 HQ: tl.constexpr, HALF: tl.constexpr, K_OUT: tl.constexpr, STORE: tl.constexpr,
                 PDL: tl.constexpr = False):
    """One program per (b * T + t, head): q heads [0, HQ) are rotated into qo; k heads [HQ, HQ + HKV) are
    rotated into ko (K_OUT) and/or written into the K cache at the token's position (STORE); with STORE, heads
    [HQ + HKV, HQ + 2 HKV) copy v into the V cache. T is a runtime value, so prompts of every length share one
    compiled kernel."""
    pdl_start(PDL)
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b, t = bt // T, bt % T
    d = tl.arange(0, HALF)
    pos = bt * 0  # an int64 scalar on every path (the compiler types both branches of the runtime `if`s below)
    if STORE:
        pos = tl.load(pos_ptr + b * sp_b + t * sp_t).to(tl.int64)
    if h >= HQ + HKV:  # STORE only: v goes into the cache unchanged
        hv = h - HQ - HKV
        src = v_ptr + b * sv_b + hv * sv_h + t * sv_t
        dst = vc_ptr + b * sc_row + hv * sc_head + pos * sc_pos
        tl.store(dst + d, tl.load(src + d).to(vc_ptr.dtype.element_ty))
        tl.store(dst + HALF + d, tl.load(src + HALF + d).to(vc_ptr.dtype.element_ty))
        return
    c1 = tl.load(cos_ptr + b * sc_b + t * sc_t + d)
    c2 = tl.load(cos_ptr + b * sc_b + t * sc_t + HALF + d)
    s1 = tl.load(sin_ptr + b * sc_b + t * sc_t + d)
    s2 = tl.load(sin_ptr + b * sc_b + t * sc_t + HALF + d)
    if h < HQ:
        src = q_ptr + b * sq_b + h * sq_h + t * sq_t
    else:
        src = k_ptr + b * sk_b + (h - HQ) * sk_h + t * sk_t
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    y1 = (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty)
    y2 = (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty)
    if h < HQ:
        dst = qo_ptr + ((b * HQ + h) * T + t) * (2 * HALF)
        tl.store(dst + d, y1)
        tl.store(dst + HALF + d, y2)
    else:
        if K_OUT:
            dst = ko_ptr + ((b * HKV + (h - HQ)) * T + t) * (2 * HALF)
            tl.store(dst + d, y1)
            tl.store(dst + HALF + d, y2)
        if STORE:
            dst = kc_ptr + b * sc_row + (h - HQ) * sc_head + pos * sc_pos
            tl.store(dst + d, y1.to(kc_ptr.dtype.element_ty))
            tl.store(dst + HALF + d, y2.to(kc_ptr.dtype.element_ty))


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, v: torch.Tensor | None = None,
            k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
            positions: torch.Tensor | None = None, k_out: bool = True):
    """RoPE of q [B, Hq, T, D] and k [B, Hkv, T, D] (any strides, last dim contiguous) in one launch; returns
    contiguous rotated copies (qo, ko). cos/sin [B, T, D] fp32 (contiguous last dim).

    With k_cache / v_cache ([B, Hkv, S, D] views of one layer's cache, same strides), v and positions [B, T]:
    the same launch also writes the rotated k and v into the caches at `positions` (`KVCache.write`'s job, which
    otherwise costs two scatter launches per layer). k_out=False then skips the rotated copy of k (ko is None):
    a decode or verify step reads k from the cache only; a fresh prefill also attends over ko."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    assert D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0, "head_dim / 2 must be a power of two"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    store = k_cache is not None
    qo = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(B, Hkv, T, D, dtype=k.dtype, device=k.device) if k_out or not store else None
    if store:
        assert v is not None and v_cache is not None and positions is not None and positions.shape == (B, T)
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and v.stride(-1) == 1
        assert k_cache.shape[0] == B and k_cache.shape[1] == Hkv
        kc, vc, pos, vv = k_cache, v_cache, positions, v
        cstr, pstr, vstr = k_cache.stride()[:3], positions.stride(), v.stride()[:3]
    else:
        kc, vc, pos, vv = q, q, q, q  # unused pointers
        cstr, pstr, vstr = (0, 0, 0), (0, 0), (0, 0, 0)
    heads = Hq + Hkv + (Hkv if store else 0)
    _rope_kernel[(B * T, heads)](q, k, vv, cos, sin, qo, ko if ko is not None else qo, kc, vc, pos, T, Hkv,
                                 q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                 *vstr, cos.stride(0), cos.stride(1), *cstr, *pstr,
                                 HQ=Hq, HALF=D // 2, K_OUT=ko is not None, STORE=store, num_warps=1,
                                 **pdl_options(q.device))
    return qo, ko


@watched
@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, sg_row, su_row, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (row, BLOCK columns): out = silu(g) * u, in fp32, rounded once to out's dtype."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(g_ptr + row * sg_row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su_row + cols, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


SILU_MUL_BLOCK = 1024


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in one launch instead of two (the SwiGLU MLP's epilogue); a contiguous result of their dtype.

    gate, up [..., N] of one shape and dtype, last dim contiguous, rows at any stride: the two halves of the fused
    gate_up projection (`torch.split` views of one [..., 2N] tensor) are read in place, without a copy.
    Rounding: PyTorch rounds silu(gate) to the activation dtype and then the product; this kernel keeps silu(gate)
    in fp32 and rounds once. In bf16/fp16 the result can thus differ from `F.silu(gate) * up` by one ulp (it is the
    one nearer the exact value); in fp32 the rounding points are the same, and only Triton's exp and division
    may differ from PyTorch's in the last bit."""
    assert gate.shape == up.shape and gate.dtype == up.dtype, "gate and up of one shape and dtype"
    N = gate.shape[-1]
    g2, u2 = gate.reshape(-1, N), up.reshape(-1, N)  # views for split halves of a contiguous tensor
    assert g2.stride(-1) == 1 and u2.stride(-1) == 1, "the last dim must be contiguous"
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    rows = g2.shape[0]
    if rows and N:
        _silu_mul_kernel[(rows, triton.cdiv(N, SILU_MUL_BLOCK))](g2, u2, out, N, g2.stride(0), u2.stride(0),
                                                                BLOCK=SILU_MUL_BLOCK, num_warps=4,
                                                                **pdl_options(gate.device))
    return out.view(gate.shape)


@watched
@triton.jit
def _capture_query_kernel(q_ptr, heads_ptr, pos_ptr, base_ptr, buf_ptr, pbuf_ptr, T, GAMMA,
                          sq_b, sq_h, sq_t, sp_b, sp_t, sb_b, sb_h, sb_g, spb_b,
                          D: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (row b, captured head h): q[b, heads[h], T - 1] into buf[b, h, slot]; h == 0 also writes
    the position into pbuf[b, slot]. slot = clamp(position - base[b], 0, GAMMA - 1)."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + b * sp_b + (T - 1) * sp_t).to(tl.int64)
    slot = tl.minimum(tl.maximum(pos - tl.load(base_ptr + b).to(tl.int64), 0), GAMMA - 1)
    head = tl.load(heads_ptr + h).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(q_ptr + b * sq_b + head * sq_h + (T - 1) * sq_t + d)
    tl.store(buf_ptr + b * sb_b + h * sb_h + slot * sb_g + d, x.to(buf_ptr.dtype.element_ty))
    if h == 0:
        tl.store(pbuf_ptr + b * spb_b + slot, pos.to(pbuf_ptr.dtype.element_ty))


def capture_query_reference(q: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor, base: torch.Tensor,
                            buf: torch.Tensor, pos_buf: torch.Tensor) -> None:
    """`capture_query` in PyTorch ops (CPU tensors; the kernel's reference)."""
    gamma, Hs, D = buf.shape[2], heads.shape[0], q.shape[-1]
    pos = positions[:, -1]
    slot = (pos - base).clamp(0, gamma - 1)
    buf.scatter_(2, slot[:, None, None, None].expand(-1, Hs, 1, D), q[:, heads, -1:].to(buf.dtype))
    pos_buf.scatter_(1, slot[:, None], pos[:, None].to(pos_buf.dtype))


def capture_query_any(q: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor, base: torch.Tensor,
                      buf: torch.Tensor, pos_buf: torch.Tensor) -> None:
    """`capture_query` where the kernel runs (`triton_ok`), else its reference."""
    fn = capture_query if triton_ok(q) else capture_query_reference
    fn(q, heads, positions, base, buf, pos_buf)


def capture_query(q: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor, base: torch.Tensor,
                  buf: torch.Tensor, pos_buf: torch.Tensor) -> None:
    """Keep the last token's query of some heads in a slot per row: with p = positions[b, -1] and
    slot = clamp(p - base[b], 0, Γ - 1), buf[b, :, slot] = q[b, heads, -1] and pos_buf[b, slot] = p.

    q [B, Hq, T, D] (last dim contiguous, D a power of two), heads [Hs] head indices, positions [B, T], base [B],
    buf [B, Hs, Γ, D] (last dim contiguous, other strides free: a view into a larger buffer), pos_buf [B, Γ]. The
    draft's lookahead scores (`DraftLookaheadScores`) call this once per observed layer of every draft forward:
    one launch instead of the five small ones of `capture_query_reference` (index, slot arithmetic, clamp, two
    scatters), which made ~170 of a step's kernels with 11 score layers."""
    B, _, T, D = q.shape
    Hs, gamma = heads.shape[0], buf.shape[2]
    assert buf.shape == (B, Hs, gamma, D) and pos_buf.shape == (B, gamma) and positions.shape == (B, T)
    assert D & (D - 1) == 0 and q.stride(-1) == 1 and buf.stride(-1) == 1 and pos_buf.stride(-1) == 1
    _capture_query_kernel[(B, Hs)](q, heads, positions, base, buf, pos_buf, T, gamma, q.stride(0), q.stride(1),
                                   q.stride(2), positions.stride(0), positions.stride(1), buf.stride(0),
                                   buf.stride(1), buf.stride(2), pos_buf.stride(0), D=D, num_warps=1,
                                   **pdl_options(q.device))
