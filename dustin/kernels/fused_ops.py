"""Fused elementwise kernels for decode-sized forwards: residual add + RMSNorm, and RoPE on q and k at once.

Why: a decode or verify step has B * (Γ+1) <= 128 rows, so every elementwise op is a tiny kernel whose cost is
its launch (~3-5 us even inside a CUDA graph), not its bytes. In eager PyTorch an RMSNorm is ~7 kernels and
RoPE ~7 per tensor: ~30 of the ~45 kernels of a layer. These two kernels do the same math in one launch each
(a 24-layer draft forward drops from ~1050 kernels to ~450). Numerics follow the PyTorch ops they replace
(`dustin.models.transformer.rms_norm`, `dustin.models.rope.apply_rope`): fp32 statistics, the same rounding points to the activation dtype;
Triton may fuse a multiply-add where PyTorch rounds twice, so results can differ in the last fp32 bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
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
                                         BLOCK=block, num_warps=min(16, max(1, block // 512)))
    if residual is None:
        return out.view_as(x)
    return total.view_as(x), out.view_as(x)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T, HKV,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sc_b, sc_t,
                 HQ: tl.constexpr, HALF: tl.constexpr):
    """One program per (b * T + t, head of q then of k): rotate one D-vector. T is a runtime value, so prompts
    of every length share one compiled kernel."""
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b, t = bt // T, bt % T
    d = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + b * sc_b + t * sc_t + d)
    c2 = tl.load(cos_ptr + b * sc_b + t * sc_t + HALF + d)
    s1 = tl.load(sin_ptr + b * sc_b + t * sc_t + d)
    s2 = tl.load(sin_ptr + b * sc_b + t * sc_t + HALF + d)
    if h < HQ:
        src = q_ptr + b * sq_b + h * sq_h + t * sq_t
        dst = qo_ptr + ((b * HQ + h) * T + t) * (2 * HALF)
    else:
        src = k_ptr + b * sk_b + (h - HQ) * sk_h + t * sk_t
        dst = ko_ptr + ((b * HKV + (h - HQ)) * T + t) * (2 * HALF)
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    tl.store(dst + d, (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty))
    tl.store(dst + HALF + d, (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty))


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE of q [B, Hq, T, D] and k [B, Hkv, T, D] (any strides, last dim contiguous) in one launch; returns
    contiguous rotated copies. cos/sin [B, T, D] fp32 (contiguous last dim)."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    assert D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0, "head_dim / 2 must be a power of two"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    qo = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(B, Hkv, T, D, dtype=k.dtype, device=k.device)
    _rope_kernel[(B * T, Hq + Hkv)](q, k, cos, sin, qo, ko, T, Hkv, q.stride(0), q.stride(1), q.stride(2),
                                    k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
                                    HQ=Hq, HALF=D // 2, num_warps=1)
    return qo, ko
