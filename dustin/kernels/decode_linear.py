"""Linear layers of a decode or verify forward (a few rows) with their neighbours fused in: three kernels and
the attention make one decoder layer.

Why: a decode pass has B * T <= 32 rows (T = 1 or 2 for a draft pass or vanilla). Each GEMM then
reads a weight matrix of a few MB once, in a few µs, and each elementwise kernel around it (RMSNorm, RoPE, the
KV-cache write, SiLU·up, the residual add, a split-K reduction) costs a launch of its own: ~11 kernels per layer,
~1,700 per speculative step. These kernels fold that work into the GEMM that needs it:

- `qkv_rope`: RMSNorm as the prologue of the q/k/v projection, bias, RoPE of q and k, and the write of k and v
  into the KV cache in its epilogue (one program per head and slice of half-dims, so RoPE's pairs (d, d + D/2)
  are two accumulators of one program);
- `decode_linear`: o_proj and down_proj with the residual add in the epilogue, optionally split over K, the
  partial sums reduced by the program that finishes last, in a fixed order (deterministic: no atomic adds of
  values, the result does not depend on which program finished when);
- `gate_up_silu`: RMSNorm prologue, the gate and up halves as two accumulators, SiLU(gate)·up in the epilogue.

The layout is "swap AB": a program multiplies a [BN, BK] tile of the weight ([N, K], nn.Linear's layout, K
contiguous) by the [BK, BM] transposed activations, so the MMA's large side is the weight and BM (the rows,
padded to a power of two >= 16) is its small side.

RMSNorm before a projection uses norm(x) @ W^T = rstd * ((x * g) @ W^T): the kernel that writes x (the residual
add's epilogue) also writes x * g and one partial sum of squares per row and output tile (`RowNorm`); the
projection's K loop then streams x * g into the MMA untouched (as a plain GEMM does) and scales the product by
rstd. Measured on the H200: a sum of squares reduced inside the K loop made these kernels 2-3x slower, and x * g
computed there ~30% slower. Rounding therefore differs from
`dustin.models.transformer.rms_norm` (which rounds x * rstd before the weight): in fp32 by the last bits, in
bf16 by up to one ulp of the normalized input; everything after the GEMM rounds where the PyTorch ops it replaces
round (the projection's output to the activation dtype, then RoPE / SiLU·up / the residual add in fp32).
fp32 inputs use IEEE fp32 dot products (no TF32).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dustin.kernels.arrival import arrival_counters, last_to_arrive
from dustin.kernels.dispatch import interpreting
from dustin.kernels.launch import H200_NUM_SMS, pdl_options, pdl_start, watched

MAX_ROWS = 32  # decode passes (vanilla, the draft); a verify's B * (Γ + 1) rows take cuBLAS, faster there
_FLAT = 1 << 30  # "no head structure" for the column index of x (k // _FLAT == 0)


@triton.jit
def _load_x(x_ptr, xrow, row_ok, kk, k_ok, sx_h, HD: tl.constexpr):
    """The [BK, BM] tile of x transposed: rows at offsets xrow, column k at (k // HD) * sx_h + k % HD (an
    attention output [B, H, T, D] is read in place as [B * T, H * D])."""
    cols = (kk // HD) * sx_h + kk % HD
    return tl.load(x_ptr + xrow[None, :] + cols[:, None], mask=row_ok[None, :] & k_ok[:, None], other=0.0)


@triton.jit
def _wdot(acc, w_ptr, wrow, w_ok, kk, k_ok, x, K, F32DOT: tl.constexpr):
    """acc + W[wrow, kk] @ x. F32DOT: an IEEE fp32 product (fp32 models; and the CPU interpreter, whose bf16
    tl.dot multiplies raw bit patterns)."""
    w = tl.load(w_ptr + wrow[:, None] * K + kk[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
    if F32DOT:
        return tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _rows(T, sx_b, sx_t, M, BM: tl.constexpr):
    rows = tl.arange(0, BM)
    return rows, rows < M, (rows // T) * sx_b + (rows % T) * sx_t


@triton.jit
def _scaled(acc, ss_ptr, NT, M, rows, row_ok, K, eps, HAS_NORM: tl.constexpr, NT_PAD: tl.constexpr):
    """acc * rstd per row. The rows' sums of squares come as NT partial sums [NT, M] (written by the kernel
    that produced x: one per N tile of its epilogue), added here in tile order."""
    if HAS_NORM:
        t = tl.arange(0, NT_PAD)
        ss = tl.sum(tl.load(ss_ptr + t[:, None] * M + rows[None, :], mask=(t < NT)[:, None] & row_ok[None, :],
                            other=0.0), 0)
        acc = acc * (1.0 / tl.sqrt(ss / K + eps))[None, :]
    return acc


@triton.jit
def _linear_out(acc, ss_ptr, NT, M, rows, row_ok, n, n_ok, b_ptr, r_ptr, out_ptr, g_ptr, xg_ptr, sso_ptr, pid_n,
                sr_m, so_m, K, eps, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
                NT_PAD: tl.constexpr, EMIT_NORM: tl.constexpr):
    acc = _scaled(acc, ss_ptr, NT, M, rows, row_ok, K, eps, HAS_NORM, NT_PAD)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = acc.to(out_ptr.dtype.element_ty)  # the projection's output, rounded as a separate GEMM would round it
    ok = n_ok[:, None] & row_ok[None, :]
    if HAS_RES:  # residual + y in fp32, rounded once (as the add of the residual stream rounds)
        r = tl.load(r_ptr + rows[None, :] * sr_m + n[:, None], mask=ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + r).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[None, :] * so_m + n[:, None], y, mask=ok)
    if EMIT_NORM:  # the next RMSNorm's input: out * g, and this tile's share of each row's sum of squares
        yf = tl.where(ok, y.to(tl.float32), 0.0)
        g = tl.load(g_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(xg_ptr + rows[None, :] * so_m + n[:, None], (yf * g[:, None]).to(out_ptr.dtype.element_ty),
                 mask=ok)
        tl.store(sso_ptr + pid_n * M + rows, tl.sum(yf * yf, 0), mask=row_ok)


@triton.jit
def _split_sum(acc1, acc2, ws_ptr, cnt_ptr, tile, pid_s, tiles, SPLIT: tl.constexpr, NACC: tl.constexpr,
               BN: tl.constexpr, BM: tl.constexpr):
    """Split-K over SPLIT programs of one output tile: each stores its NACC (1 or 2) partial [BN, BM] accumulators
    to the workspace; the last to arrive (dustin/kernels/arrival.py) gets (True, the sums over the splits in split
    order: deterministic); the others get False."""
    offs = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
    base = ws_ptr + (pid_s * tiles + tile) * (NACC * BN * BM)
    tl.store(base + offs, acc1)
    if NACC == 2:
        tl.store(base + BN * BM + offs, acc2)
    last = last_to_arrive(cnt_ptr, tile, SPLIT)
    if last:
        acc1 = tl.zeros([BN, BM], dtype=tl.float32)
        acc2 = tl.zeros([BN, BM], dtype=tl.float32)
        for s in range(SPLIT):
            part = ws_ptr + (s * tiles + tile) * (NACC * BN * BM)
            acc1 += tl.load(part + offs, cache_modifier=".cg")
            if NACC == 2:
                acc2 += tl.load(part + BN * BM + offs, cache_modifier=".cg")
    return last, acc1, acc2


@watched
@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, ss_ptr, out_ptr, g_ptr, xg_ptr, sso_ptr, ws_ptr, cnt_ptr,
                   M, N, K, T, NT, sx_b, sx_t, sx_h, sr_m, so_m, eps,
                   HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, NT_PAD: tl.constexpr,
                   EMIT_NORM: tl.constexpr, F32DOT: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = [residual +] [bias +] [rstd[m] *] x[m] . W[n] (HAS_NORM: x is already scaled by the norm's
    weight; EMIT_NORM: also out * g and the tile's partial sums of squares of out's rows, the next norm's
    input). Grid (N tiles, SPLIT)."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows, row_ok, xrow = _rows(T, sx_b, sx_t, M, BM)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    k_lo, k_hi = _k_range(pid_s, K, SPLIT, BK)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < k_hi
        x = _load_x(x_ptr, xrow, row_ok, kk, k_ok, sx_h, HD)
        acc = _wdot(acc, w_ptr, n, n_ok, kk, k_ok, x, K, F32DOT)
    if SPLIT == 1:
        _linear_out(acc, ss_ptr, NT, M, rows, row_ok, n, n_ok, b_ptr, r_ptr, out_ptr, g_ptr, xg_ptr, sso_ptr, pid_n,
                    sr_m, so_m, K, eps, HAS_BIAS, HAS_RES, HAS_NORM, NT_PAD, EMIT_NORM)
    else:
        last, acc, _ = _split_sum(acc, acc, ws_ptr, cnt_ptr, pid_n, pid_s, tl.num_programs(0), SPLIT, 1, BN, BM)
        if last:  # the last split of this tile, with the sum of all partials in split order
            _linear_out(acc, ss_ptr, NT, M, rows, row_ok, n, n_ok, b_ptr, r_ptr, out_ptr, g_ptr, xg_ptr, sso_ptr,
                        pid_n, sr_m, so_m, K, eps, HAS_BIAS, HAS_RES, HAS_NORM, NT_PAD, EMIT_NORM)


@triton.jit
def _two_tiles(x_ptr, xrow, row_ok, w_ptr, w1, w2, w_ok, k_lo, k_hi, K,
               BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, F32DOT: tl.constexpr):
    """W[w1, k_lo:k_hi] @ x[:, k_lo:k_hi]^T and the same of W[w2] ([BN, BM] each) in one pass: two weight tiles share
    each activation tile (gate and up; the two halves of RoPE's pairs)."""
    acc1 = tl.zeros([BN, BM], dtype=tl.float32)
    acc2 = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < k_hi
        x = _load_x(x_ptr, xrow, row_ok, kk, k_ok, 0, 1 << 30)
        acc1 = _wdot(acc1, w_ptr, w1, w_ok, kk, k_ok, x, K, F32DOT)
        acc2 = _wdot(acc2, w_ptr, w2, w_ok, kk, k_ok, x, K, F32DOT)
    return acc1, acc2


@triton.jit
def _k_range(pid_s, K, SPLIT: tl.constexpr, BK: tl.constexpr):
    """This split's [k_lo, k_hi) of K: SPLIT parts in whole BK tiles."""
    k_per = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
    k_lo = pid_s * k_per
    return k_lo, tl.minimum(k_lo + k_per, K)


@watched
@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ss_ptr, out_ptr, M, INTER, K, T, NT, sx_b, sx_t, so_m, eps,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    HAS_NORM: tl.constexpr, NT_PAD: tl.constexpr, F32DOT: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = silu(gate[m, n]) * up[m, n]; gate = x . W[n], up = x . W[INTER + n] (W = [gate; up]). Not
    split over K: at the default pair's shapes 2 and 4 splits measured 35-80% slower on an H200
    (scripts/gpu_split_merge.py at commit 91e0610)."""
    pdl_start(PDL)
    rows, row_ok, xrow = _rows(T, sx_b, sx_t, M, BM)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < INTER
    acc_g, acc_u = _two_tiles(x_ptr, xrow, row_ok, w_ptr, n, INTER + n, n_ok, 0, K, K, BN, BM, BK, F32DOT)
    dt = out_ptr.dtype.element_ty
    g = _scaled(acc_g, ss_ptr, NT, M, rows, row_ok, K, eps, HAS_NORM, NT_PAD).to(dt).to(tl.float32)
    u = _scaled(acc_u, ss_ptr, NT, M, rows, row_ok, K, eps, HAS_NORM, NT_PAD).to(dt).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # as dustin.kernels.fused_ops.silu_mul: fp32, rounded once
    tl.store(out_ptr + rows[None, :] * so_m + n[:, None], y.to(dt), mask=n_ok[:, None] & row_ok[None, :])


@watched
@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, ss_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, ws_ptr, cnt_ptr,
                     M, K, T, NT, sx_b, sx_t, sc_b, sc_t, sp_b, sp_t, s_row, s_head, s_pos, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, DB: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, NT_PAD: tl.constexpr, F32DOT: tl.constexpr,
                     PDL: tl.constexpr = False):
    """One program per (head of [q | k | v], DB of the HALF half-dims) and split of K: the head's dims j and
    HALF + j (j in [d0, d0 + DB)) as two accumulators; q heads are rotated into q [B, HQ, T, 2 HALF], k heads
    rotated and v heads as they are written into the KV cache at each token's position. Grid (tiles, SPLIT)."""
    pdl_start(PDL)
    pid, pid_s = tl.program_id(0), tl.program_id(1)
    h = pid // (HALF // DB)
    j = (pid % (HALF // DB)) * DB + tl.arange(0, DB)
    rows, row_ok, xrow = _rows(T, sx_b, sx_t, M, BM)
    w1 = h * (2 * HALF) + j
    w_ok = j < HALF
    k_lo, k_hi = _k_range(pid_s, K, SPLIT, BK)
    acc1, acc2 = _two_tiles(x_ptr, xrow, row_ok, w_ptr, w1, w1 + HALF, w_ok, k_lo, k_hi, K, DB, BM, BK, F32DOT)
    last = True
    if SPLIT > 1:
        last, acc1, acc2 = _split_sum(acc1, acc2, ws_ptr, cnt_ptr, pid, pid_s, tl.num_programs(0), SPLIT, 2, DB, BM)
    if last:
        acc1 = _scaled(acc1, ss_ptr, NT, M, rows, row_ok, K, eps, HAS_NORM, NT_PAD)
        acc2 = _scaled(acc2, ss_ptr, NT, M, rows, row_ok, K, eps, HAS_NORM, NT_PAD)
        _qkv_rope_out(acc1, acc2, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, h, j, w1, rows, row_ok, T,
                      sc_b, sc_t, sp_b, sp_t, s_row, s_head, s_pos, HQ, HKV, HALF, HAS_BIAS)


@triton.jit
def _qkv_rope_out(acc1, acc2, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, h, j, w1, rows, row_ok, T,
                  sc_b, sc_t, sp_b, sp_t, s_row, s_head, s_pos, HQ: tl.constexpr, HKV: tl.constexpr,
                  HALF: tl.constexpr, HAS_BIAS: tl.constexpr):
    """qkv_rope's epilogue: bias, RoPE of q and k heads, q stored, k and v written into the cache."""
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + w1).to(tl.float32)[:, None]
        acc2 += tl.load(b_ptr + w1 + HALF).to(tl.float32)[:, None]
    dt = q_ptr.dtype.element_ty
    y1 = acc1.to(dt).to(tl.float32)  # the projection's output as the separate GEMM rounds it
    y2 = acc2.to(dt).to(tl.float32)
    b = rows // T
    t = rows % T
    ok = row_ok[None, :]
    if h < HQ + HKV:  # RoPE as dustin.kernels.fused_ops.rope_qk computes it
        cs = (b * sc_b + t * sc_t)[None, :] + j[:, None]
        c1 = tl.load(cos_ptr + cs, mask=ok, other=0.0)
        c2 = tl.load(cos_ptr + cs + HALF, mask=ok, other=0.0)
        s1 = tl.load(sin_ptr + cs, mask=ok, other=0.0)
        s2 = tl.load(sin_ptr + cs + HALF, mask=ok, other=0.0)
        y1, y2 = y1 * c1 - y2 * s1, y2 * c2 + y1 * s2
    if h < HQ:
        dst = q_ptr + ((b * HQ + h) * T + t)[None, :] * (2 * HALF) + j[:, None]
        tl.store(dst, y1.to(dt), mask=ok)
        tl.store(dst + HALF, y2.to(dt), mask=ok)
    else:
        pos = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=row_ok, other=0).to(tl.int64)
        hk = h - HQ
        cache = kc_ptr
        if hk >= HKV:
            hk -= HKV
            cache = vc_ptr
        dst = cache + (b.to(tl.int64) * s_row + hk * s_head + pos * s_pos)[None, :] + j[:, None]
        tl.store(dst, y1.to(cache.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, y2.to(cache.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one projection: BN weight rows (per half for gate_up / RoPE pairs) and BK of K per
    iteration, `split` programs along K, warps and pipeline stages."""
    bn: int
    bk: int
    split: int = 1
    warps: int = 4
    stages: int = 4




def _block_rows(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


_SHARED_BUDGET = 200 * 1024  # of the 227 KiB per block on sm_90, for the pipeline's weight + activation tiles


def _fit(weight_rows: int, m: int, K: int, dtype: torch.dtype, bn: int, split: int = 1, bk: int = 256,
         stages: int = 4) -> Tiles:
    """The tiles, with BK and the pipeline's stages cut to the shared-memory budget for a program that streams
    `weight_rows` weight rows against m activation rows (fp32 or many rows: BK <= 128)."""
    bm, size = _block_rows(m), dtype.itemsize
    bk = min(bk if bm <= 32 and size <= 2 else min(bk, 128), max(16, triton.next_power_of_2(K)))
    stages = max(1, min(stages, _SHARED_BUDGET // ((weight_rows + bm) * bk * size)))
    while stages < 2 and bk > 32:
        bk //= 2
        stages = max(1, min(4, _SHARED_BUDGET // ((weight_rows + bm) * bk * size)))
    return Tiles(bn, bk, split, 4, stages)


def linear_tiles(M: int, N: int, K: int, dtype: torch.dtype, *, splittable: bool, halves: int = 1) -> Tiles:
    """Tiles for a projection of N outputs (per half: gate_up programs compute `halves` = 2 tiles of BN rows).
    64 weight rows a program (narrower tiles re-read the activations more often than they gain), then K split
    while the programs still fit in one wave on an H200's SMs (a shape rule: the tiles do not depend on the
    device, so CPU tests run the GPU's launches) and each part keeps >= 1024 of K. Two tiles a program
    (gate_up) stream BK = 128 through 3-4 stages. Measured on an H200 at the default pair's shapes
    (scripts/gpu_decode_layers.py --sweep / --pipeline, at commit 51d7b06)."""
    bn, split = 64, 1
    if splittable:
        while split < 8 and triton.cdiv(N, bn) * split * 2 <= H200_NUM_SMS and K // (split * 2) >= 1024:
            split *= 2
    if halves == 2:
        return _fit(2 * bn, M, K, dtype, bn, split, bk=128, stages=4 if K <= 1024 else 3)
    return _fit(bn, M, K, dtype, bn, split)


QKV_TILES = Tiles(bn=16, bk=64, split=1, warps=4, stages=6)  # 16 of the half-dims a program (measured)


def qkv_tiles(M: int, n_heads: int, half: int, K: int, dtype: torch.dtype) -> Tiles:
    """qkv_rope's tiles: QKV_TILES, K split (up to 4 ways) while the programs stay within two per SM and each part
    keeps >= 128 of K. Its grid is small (one program per head and 16 half-dims: 36 for the 0.5B draft, 64 for the
    1.5B target); on an H200 at 16 rows split K took the draft's 6.32 -> 5.38 us (4 ways) and the target's
    8.01 -> 7.40 us (4; 2: 7.34) (scripts/gpu_split_merge.py at commit 91e0610)."""
    q = QKV_TILES
    n_tiles, split = n_heads * (half // q.bn), 1
    while split < 4 and n_tiles * split * 2 <= 2 * H200_NUM_SMS and K // (split * 2) >= 128:
        split *= 2
    return _fit(2 * q.bn, M, K, dtype, q.bn, split, bk=q.bk, stages=q.stages)


def _f32dot(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 or interpreting()


def _check_rows(x2_rows: int, K: int, w: torch.Tensor) -> None:
    if not 0 < x2_rows <= MAX_ROWS:
        raise ValueError(f"decode kernels take 1..{MAX_ROWS} rows, got {x2_rows}")
    if w.dim() != 2 or w.shape[1] != K or w.stride(1) != 1 or w.stride(0) != K:
        raise ValueError(f"weight must be a contiguous [N, {K}] matrix, got {tuple(w.shape)}")


def _split_workspace(t: Tiles, tiles: int, bm: int, accs: int, dummy: torch.Tensor):
    """(fp32 workspace for the split-K partials, arrival counters) of a launch of `tiles` output tiles split
    t.split ways, `accs` accumulators of [t.bn, bm] each; unsplit, (dummy, dummy): the kernel never touches them,
    so nothing is allocated."""
    if t.split == 1:
        return dummy, dummy
    ws = torch.empty(t.split * tiles * accs * t.bn * bm, dtype=torch.float32, device=dummy.device)
    return ws, arrival_counters(dummy.device, tiles)


class RowNorm(NamedTuple):
    """Rows ready for an RMSNorm prologue: `scaled` = x * g (the norm's weight, rounded to x's dtype), the GEMM
    input; `sumsq` = x's rows' sums of squares as [NT, M] fp32 partials (one per output tile of the kernel that
    wrote x, `decode_linear(next_norm=...)`); rstd is applied to the product. norm(x) @ W^T = rstd * (x g) @ W^T."""
    scaled: torch.Tensor
    sumsq: torch.Tensor
    eps: float


def row_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> RowNorm:
    """The RowNorm of rows that no decode kernel wrote (the embedding output of the first layer), by PyTorch."""
    xf = x.float()
    return RowNorm((xf * weight.float()).to(x.dtype), xf.pow(2).sum(-1).reshape(1, -1), eps)


def _input(x: torch.Tensor | RowNorm) -> tuple[torch.Tensor, RowNorm | None]:
    return (x.scaled, x) if isinstance(x, RowNorm) else (x, None)


def _norm_args(norm: RowNorm | None, M: int, dummy: torch.Tensor):
    """(sumsq, NT, NT_PAD, eps) kernel arguments of an optional RowNorm."""
    if norm is None:
        return dummy, 1, 1, 0.0
    nt = norm.sumsq.shape[0]
    assert norm.sumsq.shape == (nt, M) and norm.sumsq.dtype == torch.float32 and norm.sumsq.is_contiguous()
    return norm.sumsq, nt, triton.next_power_of_2(nt), norm.eps


def decode_linear(x: torch.Tensor | RowNorm, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, next_norm: tuple[torch.Tensor, float] | None = None,
                  heads: int | None = None, tiles: Tiles | None = None):
    """[residual +] [bias +] x @ weight.T (x a RowNorm: norm(x)) for <= MAX_ROWS rows; returns out [B, T, N] in
    x's dtype, or with next_norm = (g, eps) (out, RowNorm of out for that norm), the next kernel's input.

    x: [B, T, K] (last dim contiguous), or with `heads` an attention output [B, heads, T, D] read in place as
    [B, T, heads * D]. residual: [B, T, N] (last dim contiguous)."""
    x, norm = _input(x)
    if heads is not None:
        B, H, T, D = x.shape
        assert H == heads and x.stride(-1) == 1
        sx_b, sx_t, sx_h, hd, K = x.stride(0), x.stride(2), x.stride(1), D, H * D
    else:
        B, T, K = x.shape
        assert x.stride(-1) == 1
        sx_b, sx_t, sx_h, hd = x.stride(0), x.stride(1), 0, _FLAT
    M, N = B * T, weight.shape[0]
    _check_rows(M, K, weight)
    out = torch.empty(B, T, N, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == out.shape and residual.stride(-1) == 1 and residual.stride(0) == T * residual.stride(1)
    t = tiles or linear_tiles(M, N, K, x.dtype, splittable=True)
    grid_n, bm = triton.cdiv(N, t.bn), _block_rows(M)
    ws, counters = _split_workspace(t, grid_n, bm, 1, out)
    if next_norm is not None:
        g, next_eps = next_norm
        assert g.shape == (N,)
        xg, sso = torch.empty_like(out), torch.empty(grid_n, M, dtype=torch.float32, device=x.device)
    else:
        g, xg, sso = out, out, out
    ss, nt, nt_pad, eps = _norm_args(norm, M, out)
    _linear_kernel[(grid_n, t.split)](
        x, weight, bias if bias is not None else out, residual if residual is not None else out, ss, out, g, xg,
        sso, ws, counters,
        M, N, K, T, nt, sx_b, sx_t, sx_h, residual.stride(1) if residual is not None else 0, N, eps,
        HD=hd, BM=bm, BN=t.bn, BK=t.bk, SPLIT=t.split, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, HAS_NORM=norm is not None, NT_PAD=nt_pad, EMIT_NORM=next_norm is not None,
        F32DOT=_f32dot(x), num_warps=t.warps, num_stages=t.stages, **pdl_options(x.device))
    return (out, RowNorm(xg, sso, next_eps)) if next_norm is not None else out


def gate_up_silu(x: torch.Tensor | RowNorm, weight: torch.Tensor, *, tiles: Tiles | None = None) -> torch.Tensor:
    """silu(gate) * up of x (a RowNorm: of norm(x)) with weight = [gate; up] ([2I, K]): [B, T, I] in x's dtype."""
    x, norm = _input(x)
    B, T, K = x.shape
    assert x.stride(-1) == 1 and weight.shape[0] % 2 == 0
    M, inter = B * T, weight.shape[0] // 2
    _check_rows(M, K, weight)
    t = tiles or linear_tiles(M, inter, K, x.dtype, splittable=False, halves=2)
    if t.split != 1:
        raise ValueError("gate_up_silu does not split K")
    out = torch.empty(B, T, inter, dtype=x.dtype, device=x.device)
    ss, nt, nt_pad, eps = _norm_args(norm, M, out)
    _gate_up_kernel[(triton.cdiv(inter, t.bn),)](
        x, weight, ss, out, M, inter, K, T, nt, x.stride(0), x.stride(1), inter, eps,
        BM=_block_rows(M), BN=t.bn, BK=t.bk, HAS_NORM=norm is not None, NT_PAD=nt_pad,
        F32DOT=_f32dot(x), num_warps=t.warps, num_stages=t.stages, **pdl_options(x.device))
    return out


def qkv_rope(x: torch.Tensor | RowNorm, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
             n_heads: int, n_kv_heads: int, tiles: Tiles | None = None) -> torch.Tensor:
    """The attention's input half of a decoder layer in one launch: q, k, v = x @ weight.T (+ bias) (x a
    RowNorm: norm(x)) with
    weight = [q; k; v] ([(Hq + 2 Hkv) D, K]), RoPE (cos/sin [B, T, D] fp32) on q and k, k and v written into
    the caches ([B, Hkv, S, D] views of one layer, same strides) at `positions` [B, T]. Returns the rotated q
    [B, Hq, T, D] (contiguous), as `dustin.kernels.fused_ops.rope_qk` does for a decode step."""
    x, norm = _input(x)
    B, T, K = x.shape
    M = B * T
    D = weight.shape[0] // (n_heads + 2 * n_kv_heads)
    half = D // 2
    assert D * (n_heads + 2 * n_kv_heads) == weight.shape[0] and half & (half - 1) == 0 and half >= 16
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride() and cos.shape[-1] == D
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and positions.shape == (B, T)
    assert k_cache.shape[0] == B and k_cache.shape[1] == n_kv_heads
    _check_rows(M, K, weight)
    t = tiles or qkv_tiles(M, n_heads + 2 * n_kv_heads, half, K, x.dtype)
    q = torch.empty(B, n_heads, T, D, dtype=x.dtype, device=x.device)
    ss, nt, nt_pad, eps = _norm_args(norm, M, q)
    n_tiles, bm = (n_heads + 2 * n_kv_heads) * (half // t.bn), _block_rows(M)
    ws, counters = _split_workspace(t, n_tiles, bm, 2, q)
    _qkv_rope_kernel[(n_tiles, t.split)](
        x, weight, bias if bias is not None else q, ss, cos, sin, positions, q, k_cache, v_cache, ws, counters,
        M, K, T, nt, x.stride(0), x.stride(1), cos.stride(0), cos.stride(1), positions.stride(0), positions.stride(1),
        *k_cache.stride()[:3], eps, HQ=n_heads, HKV=n_kv_heads, HALF=half, DB=t.bn, BM=bm, BK=t.bk, SPLIT=t.split,
        HAS_BIAS=bias is not None, HAS_NORM=norm is not None, NT_PAD=nt_pad, F32DOT=_f32dot(x),
        num_warps=t.warps, num_stages=t.stages, **pdl_options(x.device))
    return q
