"""GPU check and timing of the streaming draft's attention: one split written in place (DIRECT, no combine
launch; the default for short key ranges) against the split + combine launches the heuristic chose before.

Run on the device: PYTHONPATH=. python3 scripts/gpu_draft_attention.py. Shapes: the drafts' layers (Qwen2.5-0.5B:
14 query heads on 2 KV heads; Llama-3.2-1B: 32 on 8; D 64, bf16) at 16 x 32k, sinks 4 + window 508, the first
draft forward (T 2) and the later ones (T 1); each path checked against the fp32 reference, then timed per call
(`dustin bench attention`'s timer: a CUDA graph of 20 calls, L2 flushed before each). Writes
$OUT/draft_attention.json.
"""
from __future__ import annotations

import json
import os

import torch

from dustin.attention.reference import verify_attention_reference
from dustin.bench.attention import _GraphTimer
from dustin.kernels.verify_attention import default_num_splits, key_upper_bound, verify_attention

SHAPES = {"qwen2.5-0.5b": (14, 2), "llama-3.2-1b": (32, 8)}


def main() -> int:
    dev, D, B, ctx, sinks, window = "cuda", 64, 16, 32768, 4, 508
    g = torch.Generator(device=dev).manual_seed(0)
    timer, rows, ok = _GraphTimer(), [], True
    for name, (hq, hkv) in SHAPES.items():
        cap = ctx + 64
        k = torch.randn(B, hkv, cap, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        L = torch.randint(ctx - 300, ctx, (B,), device=dev, dtype=torch.int32, generator=g)
        for T in (2, 1):
            q = torch.randn(B, hq, T, D, device=dev, dtype=torch.bfloat16, generator=g)
            split = default_num_splits(B * hkv, key_upper_bound(cap, T, sinks, window), 64)  # the old choice
            want = verify_attention_reference(q.float(), k.float(), v.float(), L, sinks=sinks, window=window)
            row = {"draft": name, "B": B, "ctx": ctx, "T": T, "old_splits": split}
            for label, n in (("direct", 1), ("split", split)):
                def fn(n=n, q=q, k=k, v=v, L=L, cap=cap):  # binds this iteration's inputs
                    return verify_attention(q, k, v, L, sinks=sinks, window=window, max_len=cap, num_splits=n)
                err = ((fn().float() - want).norm() / want.norm()).item()
                ok &= err < 1e-2
                row[f"{label}_rel_err"] = err
                row[f"{label}_us"] = round(timer(fn), 2)
            rows.append(row)
            print(row, flush=True)
    res = {"device": torch.cuda.get_device_name(), "ok": ok, "rows": rows}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "draft_attention.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
