"""GPU check and benchmark of the verify-attention paths (run on the H200: `PYTHONPATH=. python3 scripts/...`).

1. Correctness of the Triton split-K kernel and the SDPA path against the fp32 reference (bf16, ragged
   batches, GQA ratios 1/4/7/8, streaming), plus a CUDA-graph replay with lengths changed in place.
2. Timing (triton.testing.do_bench, median) for Llama-3.1-8B (Hq 32 / Hkv 8) and Qwen2.5-7B (28 / 4)
   attention shapes, D 128, contexts 8k/16k/32k, batch 8/16, T 5 and 1: Triton split-K, SDPA with
   enable_gqa on the un-folded query, SDPA on the folded query; plus streaming (sinks 4, window 508).
   Achieved TB/s counts the K+V bytes that must be read; it is compared with a measured D2D copy.
Writes $OUT/verify_attention.json when $OUT is set. Budget: well under 3 minutes.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from dustin.attention.reference import verify_attention_reference, verify_mask
from dustin.attention.sdpa import verify_attention_sdpa
from dustin.kernels.verify_attention import key_upper_bound, verify_attention

DEVICE = "cuda"
DTYPE = torch.bfloat16
MODELS = {"llama3.1-8b": (32, 8), "qwen2.5-7b": (28, 4)}
HEAD_DIM = 128
PATHS = ("triton", "triton_graph", "sdpa_gqa", "sdpa_folded")  # table columns: us, TB/s, % of copy BW


def make_inputs(B, Hq, Hkv, T, D, lengths, dtype=DTYPE, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    capacity = int(lengths.max()) + T + 37  # stale rows past every sequence's end, as in the real cache
    k = torch.randn(B, Hkv, capacity, D, generator=gen, device=DEVICE, dtype=dtype)
    v = torch.randn(B, Hkv, capacity, D, generator=gen, device=DEVICE, dtype=dtype)
    q = torch.randn(B, Hq, T, D, generator=gen, device=DEVICE, dtype=dtype)
    return q, k, v, lengths


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check_correctness():
    cases = [  # (B, Hq, Hkv, T, D, lengths, sinks, window, dtype)
        (3, 32, 8, 5, 128, [1, 1000, 4097], 0, 0, DTYPE),
        (2, 14, 2, 5, 64, [333, 2048], 0, 0, DTYPE),
        (2, 28, 4, 1, 128, [8191, 17], 0, 0, DTYPE),
        (2, 8, 8, 16, 128, [100, 3000], 0, 0, DTYPE),
        (3, 32, 8, 5, 128, [100, 5000, 20000], 4, 508, DTYPE),
        (2, 28, 4, 4, 128, [3, 700], 4, 64, DTYPE),
        (2, 14, 2, 3, 64, [333, 1500], 0, 0, torch.float32),
    ]
    rows, ok = [], True
    for B, Hq, Hkv, T, D, lens, sinks, window, dtype in cases:
        q, k, v, lengths = make_inputs(B, Hq, Hkv, T, D, lens, dtype)
        ref = verify_attention_reference(q, k, v, lengths, sinks=sinks, window=window)
        max_len = max(lens) + T
        errs = {
            "triton": rel_err(verify_attention(q, k, v, lengths, sinks=sinks, window=window), ref),
            "triton_max_len": rel_err(verify_attention(q, k, v, lengths, sinks=sinks, window=window,
                                                       max_len=max_len), ref),
            "sdpa": rel_err(verify_attention_sdpa(q, k, v, lengths, sinks=sinks, window=window,
                                                  max_len=max_len), ref),
        }
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        passed = all(e < tol for e in errs.values())
        ok &= passed
        rows.append({"shape": [B, Hq, Hkv, T, D], "lengths": lens, "sinks": sinks, "window": window,
                     "dtype": str(dtype), "rel_err": errs, "pass": passed})
        print(f"check B{B} Hq{Hq}/Hkv{Hkv} T{T} D{D} lens {lens} sinks {sinks} win {window} {dtype}: "
              + " ".join(f"{n}={e:.2e}" for n, e in errs.items()) + ("  ok" if passed else "  FAIL"))
    ok &= check_cuda_graph()
    return ok, rows


def check_cuda_graph():
    """Capture once, then change lengths in place: the replay must follow (no host sync inside)."""
    q, k, v, lengths = make_inputs(4, 32, 8, 5, 128, [1000, 3000, 17, 4000])
    out = torch.empty_like(q)
    verify_attention(q, k, v, lengths, max_len=4005, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_attention(q, k, v, lengths, max_len=4005, out=out)
    errs = []
    for new in ([1000, 3000, 17, 4000], [5, 3990, 2222, 1]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        errs.append(rel_err(out, verify_attention_reference(q, k, v, lengths)))
    passed = all(e < 1e-2 for e in errs)
    print(f"check cuda graph replay with new lengths: {['%.2e' % e for e in errs]}" + ("  ok" if passed else "  FAIL"))
    return passed


def graph_replay(fn):
    """A CUDA graph of fn's launches: times the kernels without Python launch overhead (as in the engine)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_copy_bandwidth():
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=100)
    return 2 * x.numel() / (ms * 1e-3) / 1e12  # bytes read + written


def kv_bytes(B, Hkv, keys, D, itemsize=2):
    return B * Hkv * keys * D * itemsize * 2  # K and V


def sdpa_paths(q, k, v, lengths, max_len, sinks=0, window=0):
    """The two SDPA variants with the mask built once outside (the engine builds it once per step)."""
    B, Hq, T, D = q.shape
    Hkv, G = k.shape[1], q.shape[1] // k.shape[1]
    kc, vc = k[:, :, :max_len], v[:, :, :max_len]
    mask = verify_mask(lengths, T, max_len, sinks, window)
    folded_mask = mask.expand(B, G, T, max_len).reshape(B, 1, G * T, max_len)
    folded_q = q.reshape(B, Hkv, G * T, D)
    gqa = lambda: F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)  # noqa: E731
    folded = lambda: F.scaled_dot_product_attention(folded_q, kc, vc, attn_mask=folded_mask)  # noqa: E731
    return {"sdpa_gqa": gqa, "sdpa_folded": folded}


def bench_shape(model, B, ctx, T, copy_tbs, sinks=0, window=0, include_sdpa=True):
    Hq, Hkv = MODELS[model]
    q, k, v, lengths = make_inputs(B, Hq, Hkv, T, HEAD_DIM, [ctx] * B)
    max_len = ctx + T
    keys = key_upper_bound(max_len, T, sinks, window)
    triton_call = lambda: verify_attention(q, k, v, lengths, sinks=sinks, window=window, max_len=max_len)  # noqa
    paths = {"triton": triton_call, "triton_graph": graph_replay(triton_call)}
    if include_sdpa:
        paths.update(sdpa_paths(q, k, v, lengths, max_len, sinks, window))
    rows = []
    for name, fn in paths.items():
        try:
            ms = do_bench(fn, warmup=10, rep=50)
        except torch.OutOfMemoryError:
            print(f"  {name}: out of memory")
            continue
        tbs = kv_bytes(B, Hkv, keys, HEAD_DIM) / (ms * 1e-3) / 1e12
        rows.append({"model": model, "B": B, "ctx": ctx, "T": T, "sinks": sinks, "window": window, "path": name,
                     "us": ms * 1e3, "tb_s": tbs, "frac_copy_bw": tbs / copy_tbs})
    del q, k, v
    torch.cuda.empty_cache()
    return rows


def main():
    start = time.time()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    ok, checks = check_correctness()
    copy_tbs = measure_copy_bandwidth()
    print(f"device-to-device copy: {copy_tbs:.2f} TB/s (read + write)")

    timings = []
    for model, ctx, B, T in itertools.product(MODELS, (8192, 16384, 32768), (8, 16), (5, 1)):
        timings += bench_shape(model, B, ctx, T, copy_tbs)
    for model, B in itertools.product(MODELS, (8, 16)):
        timings += bench_shape(model, B, 32768, 5, copy_tbs, sinks=4, window=508)
    print(f"timings done at {time.time() - start:.0f}s")

    print(f"\n{'model':12} {'B':>3} {'ctx':>6} {'T':>2} {'stream':>7} | "
          + " | ".join(f"{p:>22}" for p in PATHS))
    key = lambda r: (r["model"], r["B"], r["ctx"], r["T"], r["window"])  # noqa: E731
    for group_key, group in itertools.groupby(sorted(timings, key=key), key=key):
        by_path = {r["path"]: r for r in group}
        model, B, ctx, T, window = group_key
        cells = []
        for path in PATHS:
            r = by_path.get(path)
            cells.append(f"{r['us']:9.1f} {r['tb_s']:5.2f} {100 * r['frac_copy_bw']:4.0f}%" if r else f"{'-':>22}")
        print(f"{model:12} {B:3d} {ctx:6d} {T:2d} {'4+' + str(window) if window else '-':>7} | " + " | ".join(cells))
    print(f"\ncopy bandwidth {copy_tbs:.2f} TB/s; correctness {'PASS' if ok else 'FAIL'}; "
          f"total {time.time() - start:.0f}s")

    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "verify_attention.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "correct": ok, "checks": checks,
                       "copy_tb_s": copy_tbs, "timings": timings}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
