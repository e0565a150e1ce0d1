"""Launch configurations of the packed prefill attention kernel on the GPU: time per config (one fresh 16k prompt,
and a server-like step of 4 chunks of 2,048 tokens at prefixes 0-14k), error against the fp32 reference, and
whether a row's output is bit-equal under re-chunking (the batch invariance the engine relies on), for the real
pair's two head layouts.

    PYTHONPATH=. python3 scripts/gpu_prefill_kernel_sweep.py --out $OUT/prefill_sweep.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from dustin.attention.context import PrefillPlan
from dustin.kernels.prefill_attention import prefill_attention, prefill_attention_reference

CONFIGS = [(bm, bn, w, st) for bm, bn, w, st in [
    (64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 3),
    (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4)]]


def bench(fn, *args, reps=10, **kw):
    fn(*args, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args, **kw)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for hq, hkv, d in ((12, 2, 128), (14, 2, 64)):
        n = 16384
        q = torch.randn(hq, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(4, hkv, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flops = 4 * hq * d * n * n / 2
        kr, vr = k[:1].repeat_interleave(hq // hkv, 1), v[:1].repeat_interleave(hq // hkv, 1)
        t_sdpa = bench(F.scaled_dot_product_attention, q[None], kr, vr, is_causal=True)
        res["rows"].append({"layout": f"{hq}x{hkv}x{d}", "config": "sdpa", "ms_16k": round(1e3 * t_sdpa, 3),
                            "tflops_16k": round(flops / t_sdpa / 1e12, 1)})
        mix = [(0, 0, 2048), (1, 4000, 2048), (2, 9000, 2048), (3, 14000, 2048)]
        mix_flops = sum(4 * hq * d * c * (p + c / 2) for _, p, c in mix)
        for bm, bn, w, st in CONFIGS:
            try:
                plan = PrefillPlan.build([(0, 0, n)], "cuda", block_m=bm)
                t = bench(prefill_attention, q, k, v, plan, num_warps=w, num_stages=st, block_n=bn)
                pm = PrefillPlan.build(mix, "cuda", block_m=bm)
                qm = q[:, :8192]
                tm = bench(prefill_attention, qm, k, v, pm, num_warps=w, num_stages=st, block_n=bn)
                small = PrefillPlan.build([(0, 0, 1500), (2, 700, 300)], "cuda", block_m=bm)
                qs = q[:, :1800]
                err = (prefill_attention(qs, k, v, small, num_warps=w, num_stages=st, block_n=bn).float()
                       - prefill_attention_reference(qs, k, v, small).float()).abs().max().item()
                whole = prefill_attention(q[:, :1500], k, v, PrefillPlan.build([(0, 0, 1500)], "cuda", block_m=bm),
                                          num_warps=w, num_stages=st, block_n=bn)
                parts = [prefill_attention(torch.cat([q[:, 1500:1600], q[:, s0:s0 + c]], 1), k, v,
                                           PrefillPlan.build([(3, 0, 100), (0, s0, c)], "cuda", block_m=bm),
                                           num_warps=w, num_stages=st, block_n=bn)[:, 100:]
                         for s0, c in ((0, 517), (517, 1), (518, 982))]
                row = {"layout": f"{hq}x{hkv}x{d}", "config": f"bm{bm} bn{bn} w{w} s{st}",
                       "ms_16k": round(1e3 * t, 3), "tflops_16k": round(flops / t / 1e12, 1),
                       "mix_ms": round(1e3 * tm, 3), "mix_tflops": round(mix_flops / tm / 1e12, 1),
                       "max_err": err, "bit_equal": bool(torch.equal(torch.cat(parts, 1), whole))}
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is reported
                row = {"layout": f"{hq}x{hkv}x{d}", "config": f"bm{bm} bn{bn} w{w} s{st}", "error": str(e)[:200]}
            res["rows"].append(row)
            print(row, flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
