"""Decode-layer GEMMs whose programs hold their WHOLE weight slice in registers, loaded before the PDL wait.

    PYTHONPATH=. python3 scripts/experiments/resident_weights.py [--layers 24] [--batch 16]
    PYTHONPATH=. python3 scripts/experiments/resident_weights.py --compile-only   # no GPU: sm_90 shared memory

Why: `launch_floor.py` (H200, 2026-12-03) prices a PDL stage whose programs load their weight slice into registers
before the grid-dependency wait at its bytes + 0-0.6 us (16 KiB a program: 1.10 us against 2.17 us launched
plainly), while the engine's decode kernels cost ~4 us each besides their bytes. The read-ahead variant of the
engine's kernels (commit 8a477d8, reverted) could hold only one K tile of a program's 57-393 KiB ahead and was
slower. This tries the other end: tiles narrow enough (BN = 16 weight rows, K in one block of <= 1024) that a
program's whole slice fits in registers, so nothing is left to stream after the wait but the activations (from
L2). Split K (down_proj) merges by the last program to arrive, as the engine's kernels do.

It times the draft's four projections (q/k/v, o, gate/up, down; no attention, norms, RoPE or SiLU: each reads the
previous one's output) over `--layers` layers of distinct random weights in one CUDA graph: µs per layer, with
the weights loaded before the wait (`ahead`) or after it (`after`), PDL on and off; and, as the reference, the
engine's own kernels on the same chain (`pdl_coresidency.Draft`, which also runs those epilogues). Results are
checked against torch (bf16 matmuls of the same chain). Writes $OUT/resident_weights.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dustin.kernels.arrival import arrival_counters  # noqa: E402
from dustin.kernels.decode_linear import _split_sum  # noqa: E402
from dustin.kernels.launch import pdl_start  # noqa: E402

DIM, NQKV, INTER = 896, 1152, 4864  # Qwen2.5-0.5B: hidden, q|k|v columns (14 + 2 + 2 heads of 64), MLP


@triton.jit
def _resident_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, sx_m, so_m,
                     BN: tl.constexpr, BM: tl.constexpr, KC: tl.constexpr, SPLIT: tl.constexpr,
                     AHEAD: tl.constexpr, F32DOT: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = x[m, :K] . W[n, :K] for a program's BN weight rows and its split's KC columns of K, the whole
    [BN, KC] slice loaded in one go (before the PDL wait when AHEAD). Grid (N / BN, SPLIT)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    kk = pid_s * KC + tl.arange(0, KC)
    w_mask = (n < N)[:, None] & (kk < K)[None, :]
    if AHEAD:  # weights are never written by a step: safe to read before the predecessor is done
        w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=w_mask, other=0.0)
    pdl_start(PDL)
    if not AHEAD:
        w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=w_mask, other=0.0)
    rows = tl.arange(0, BM)
    x = tl.load(x_ptr + rows[None, :] * sx_m + kk[:, None], mask=(rows < M)[None, :] & (kk < K)[:, None],
                other=0.0)  # [KC, BM]
    if F32DOT:
        acc = tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(w, x)
    o_ptrs = out_ptr + rows[None, :] * so_m + n[:, None]
    o_mask = (n < N)[:, None] & (rows < M)[None, :]
    if SPLIT == 1:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        last, acc, _ = _split_sum(acc, acc, ws_ptr, cnt_ptr, pid_n, pid_s, tl.num_programs(0), SPLIT, 1, BN, BM)
        if last:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def resident_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, bn: int = 16, kc: int = 1024,
                    ahead: bool = True, pdl: bool = False, warps: int = 4) -> torch.Tensor:
    """out[:M, :N] = x[:M, :K] @ w.T (x, out: row-major with any row stride; w [N, K] contiguous)."""
    M, K = x.shape[0], w.shape[1]
    N = w.shape[0]
    split = triton.cdiv(K, kc)
    bm = max(16, triton.next_power_of_2(M))
    tiles = triton.cdiv(N, bn)
    ws = torch.empty(split * tiles * bn * bm if split > 1 else 1, dtype=torch.float32, device=x.device)
    cnt = arrival_counters(x.device, tiles) if split > 1 else ws
    f32 = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _resident_kernel[(tiles, split)](x, w, out, ws, cnt, M, N, K, x.stride(0), out.stride(0), BN=bn, BM=bm,
                                     KC=kc, SPLIT=split, AHEAD=ahead, F32DOT=f32, PDL=pdl, num_warps=warps,
                                     num_stages=1, launch_pdl=pdl)
    return out


class Chain:
    """`layers` x (q/k/v, o, gate/up, down) of the draft's shapes, random bf16 weights; each GEMM reads the
    previous one's output (o reads q|k|v's first DIM columns, down the first INTER of gate/up's)."""

    def __init__(self, layers: int, batch: int, device: torch.device, dtype=torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(0)

        def rnd(*shape, scale):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        self.w = [{"qkv": rnd(NQKV, DIM, scale=DIM ** -0.5), "o": rnd(DIM, DIM, scale=DIM ** -0.5),
                   "gu": rnd(2 * INTER, DIM, scale=DIM ** -0.5), "down": rnd(DIM, INTER, scale=INTER ** -0.5)}
                  for _ in range(layers)]
        self.x = rnd(batch, DIM, scale=1.0)
        self.qkv = torch.empty(batch, NQKV, dtype=dtype, device=device)
        self.h = torch.empty(batch, DIM, dtype=dtype, device=device)
        self.gu = torch.empty(batch, 2 * INTER, dtype=dtype, device=device)
        self.y = torch.empty(batch, DIM, dtype=dtype, device=device)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w[0].values())

    def forward(self, **kw) -> torch.Tensor:
        x = self.x
        for w in self.w:
            resident_linear(x, w["qkv"], self.qkv, **kw)
            resident_linear(self.qkv[:, :DIM], w["o"], self.h, **kw)
            resident_linear(self.h, w["gu"], self.gu, **kw)
            resident_linear(self.gu[:, :INTER], w["down"], self.y, **kw)
            x = self.y
        return self.y

    def reference(self) -> torch.Tensor:
        x = self.x
        for w in self.w:
            qkv = x @ w["qkv"].T
            h = qkv[:, :DIM] @ w["o"].T
            gu = h @ w["gu"].T
            x = gu[:, :INTER] @ w["down"].T
        return x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16, help="rows of a draft pass (one token per sequence)")
    ap.add_argument("--compile-only", action="store_true", help="compile every launch for sm_90, run nothing")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args)
    from dustin.bench.decode import copy_bandwidth
    from scripts.experiments.launch_floor import _time
    from scripts.experiments.pdl_coresidency import Draft, set_pdl

    dev = torch.device("cuda")
    chain = Chain(args.layers, args.batch, dev)
    bw = copy_bandwidth()
    floor = chain.weight_bytes() / bw * 1e6
    report = {"device": torch.cuda.get_device_name(dev), "layers": args.layers, "batch": args.batch,
              "copy_bw_TBps": round(bw / 1e12, 3), "weight_us_per_layer": round(floor, 2), "runs": []}
    ref = chain.reference().float()
    for name, kw in [("ahead", dict(ahead=True)), ("after", dict(ahead=False)),
                     ("ahead_kc512", dict(ahead=True, kc=512)), ("ahead_bn32_8w", dict(ahead=True, bn=32, warps=8))]:
        for pdl in (False, True):
            out = chain.forward(pdl=pdl, **kw).float()
            torch.cuda.synchronize()
            err = float((out - ref).abs().max() / ref.abs().max())
            us = _time(lambda kw=kw, pdl=pdl: chain.forward(pdl=pdl, **kw), args.layers)
            run = {"kernels": name, "pdl": pdl, "us_per_layer": round(us, 2),
                   "pct_of_weight_roofline": round(100 * floor / us, 1), "rel_err_vs_torch": round(err, 4)}
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
    engine = Draft(args.layers, args.batch, dev)  # the engine's kernels, with their norm/RoPE/residual epilogues
    for pdl in (False, True):
        set_pdl(pdl)
        engine.forward()
        torch.cuda.synchronize()
        us = _time(lambda: engine.forward(), args.layers)
        run = {"kernels": "engine", "pdl": pdl, "us_per_layer": round(us, 2),
               "pct_of_weight_roofline": round(100 * floor / us, 1)}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    set_pdl(False)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "resident_weights.json").write_text(json.dumps(report, indent=1))
    return 0


def compile_only(args) -> int:
    """Every launch of one layer compiled for sm_90 with PDL on, on CPU tensors: kernel, shared bytes."""
    from tests.triton_compile import compile_launches

    chain = Chain(1, args.batch, torch.device("cpu"))
    for kw in (dict(ahead=True), dict(ahead=True, kc=512), dict(ahead=True, bn=32, warps=8)):
        done: list = []
        with compile_launches(done):
            chain.forward(pdl=True, **kw)
        for c in done:
            print(kw, c.name, c.shared, c.constexprs, c.pdl_order, sep="\t")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
