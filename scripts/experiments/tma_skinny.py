"""Skinny GEMMs (16 rows) with the weight tiles brought in by TMA instead of cp.async: per-SM bandwidth.

    PYTHONPATH=. python3 scripts/experiments/tma_skinny.py           # H100/H200
    PYTHONPATH=. python3 scripts/experiments/tma_skinny.py --check   # CPU: the kernel against torch (interpreter)

Why: Nsight Compute on the draft's decode kernels (H200, 2026-12-03, `docs/results/skinny_gemm/h200_ncu_*.csv`)
shows o_proj (14 programs) reading its 1.6 MB in 5.5 us, down_proj (56 programs) 8.7 MB in 7.9 us and gate/up
(76 programs) 17.4 MB in 8.0 us: 25-35 GB/s per SM, where the device streams 4.2 TB/s over 132 SMs (32 GB/s an SM
only when every SM streams). A kernel whose grid covers a fraction of the SMs is held to that fraction of the
bandwidth when each SM moves ~30 GB/s. Hopper's tensor memory accelerator (TMA) moves a tile with one instruction
and no per-thread address work; if a program's weight stream through TMA runs several times faster, the skinny
GEMMs can approach the copy bandwidth at the grids they have.

This times, at each projection shape of the default pair (16 rows, 24 rotating weight copies so that L2 holds
none, one CUDA graph of 24 launches, us per launch): the engine's `decode_linear` (plain, no residual or norm),
the same kernel with narrower tiles (more programs), and `_tma_linear_kernel` below (the same swap-AB product,
weights by TMA) unsplit and split over K (partials added with fp32 atomics: timing only, not deterministic).
Writes $OUT/tma_skinny.json when OUT is set.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dustin.kernels import decode_linear as dl  # noqa: E402

# (name, N, K): the 0.5B draft's and the 1.5B target's projections (gate/up as one [2I, K] matrix)
SHAPES = [("draft qkv", 1152, 896), ("draft o", 896, 896), ("draft gate_up", 9728, 896), ("draft down", 896, 4864),
          ("target qkv", 2048, 1536), ("target o", 1536, 1536), ("target gate_up", 17920, 1536),
          ("target down", 1536, 8960)]


@triton.jit
def _tma_linear_kernel(x_ptr, w_desc, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       SPLIT: tl.constexpr, F32DOT: tl.constexpr):
    """out[m, n] (+)= x[m] . W[n] over this program's split of K; W's [BN, BK] tiles by TMA (`w_desc`), x's
    [BK, BM] by plain loads. SPLIT > 1: fp32 atomic adds into a zeroed out."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BM)
    row_ok = rows < M
    k_per = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
    k_lo = pid_s * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        w = w_desc.load([pid_n * BN, k0])
        kk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[None, :] * K + kk[:, None], mask=row_ok[None, :] & (kk < k_hi)[:, None], other=0.0)
        if F32DOT:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
    n = pid_n * BN + tl.arange(0, BN)
    ok = (n < N)[:, None] & row_ok[None, :]
    ptrs = out_ptr + rows[None, :] * N + n[:, None]
    if SPLIT == 1:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(ptrs, acc, mask=ok)


def tma_linear(x: torch.Tensor, w: torch.Tensor, bn: int = 64, bk: int = 128, split: int = 1, stages: int = 4,
               warps: int = 4) -> torch.Tensor:
    """x [M, K] @ w.T ([N, K]); split > 1 returns fp32."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = w.shape[0]
    out = (torch.empty if split == 1 else torch.zeros)(M, N, dtype=x.dtype if split == 1 else torch.float32,
                                                        device=x.device)
    desc = TensorDescriptor.from_tensor(w, [bn, bk])
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    f32 = interp or x.dtype == torch.float32
    _tma_linear_kernel[(triton.cdiv(N, bn), split)](x, desc, out, M, N, K, BM=max(16, triton.next_power_of_2(M)),
                                                    BN=bn, BK=bk, SPLIT=split, F32DOT=f32, num_warps=warps,
                                                    num_stages=stages)
    return out


def check() -> int:
    torch.manual_seed(0)
    for M, N, K, split in ((16, 200, 384, 1), (3, 130, 520, 3), (16, 64, 128, 2)):
        x, w = torch.randn(M, K), torch.randn(N, K)
        y = tma_linear(x, w, bn=64, bk=128, split=split)
        err = (y.float() - x @ w.T).abs().max().item()
        print(M, N, K, split, err)
        assert err < 1e-3
    return 0


def variants_of(x: torch.Tensor, N: int, K: int) -> dict:
    """name -> fn(weight): the engine's kernel with its tiles and narrower ones, the TMA kernel's settings."""
    base = dl.linear_tiles(x.shape[1], N, K, x.dtype, splittable=True)
    out = {}
    for bn in (None, 32, 16):
        t = base if bn is None else replace(base, bn=bn)
        out["engine" if bn is None else f"engine bn {bn}"] = functools.partial(_engine, x, tiles=t)
    for bn, bk, split, stages in ((64, 128, 1, 4), (64, 128, 2, 4), (64, 128, 4, 4), (32, 128, 1, 6),
                                  (128, 128, 1, 3), (64, 256, 1, 3)):
        if K // split >= bk:
            out[f"tma bn {bn} bk {bk} split {split} stages {stages}"] = functools.partial(
                _tma, x[0], bn=bn, bk=bk, split=split, stages=stages)
    return out


def _engine(x, w, tiles):
    return dl.decode_linear(x, w, tiles=tiles)


def _tma(x, w, **kw):
    return tma_linear(x, w, **kw)


def time_shape(name: str, N: int, K: int, rows: int, bw: float, copies: int = 24) -> list[dict]:
    """Every variant at one projection shape: us per launch over `copies` rotating weights, error vs fp32."""
    from scripts.experiments.launch_floor import _time

    dev, bf = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1, rows, K, device=dev, dtype=bf)
    ws = [torch.randn(N, K, device=dev, dtype=bf) * 0.02 for _ in range(copies)]
    ref = x[0].float() @ ws[0].float().T
    floor = N * K * 2 / bw * 1e6
    rows_out = []
    for vname, fn in variants_of(x, N, K).items():
        try:
            y = fn(ws[0])
            err = float((y.float().reshape(ref.shape) - ref).abs().max() / ref.abs().max())
            us = _time(functools.partial(_all, fn, ws), copies)
        except Exception as e:  # noqa: BLE001  (a variant that does not compile or launch: say so, go on)
            print(json.dumps({"shape": name, "variant": vname, "error": str(e)[:300]}), flush=True)
            continue
        row = {"shape": name, "N": N, "K": K, "variant": vname, "us": round(us, 2),
               "weight_us": round(floor, 2), "pct_of_bw": round(100 * floor / us, 1), "rel_err": round(err, 5)}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


def _all(fn, ws):
    return [fn(w) for w in ws]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        return check()
    from dustin.bench.decode import copy_bandwidth

    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "rows": args.rows, "copy_bw_TBps": round(bw / 1e12, 3),
           "rows_out": []}
    for name, N, K in SHAPES:
        res["rows_out"] += time_shape(name, N, K, args.rows, bw)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "tma_skinny.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
