"""Split work merged by the program that finishes last (dustin/kernels/arrival.py) against a second, combine launch,
and split K for the decode layers' skinny q/k/v and gate/up projections, on one GPU at the default pair's shapes.

1. attention (us per call, `dustin bench attention`'s timer: a CUDA graph of 20 calls, L2 evicted before each):
   - the 0.5B draft's streaming attention (16 x 32k, 4 sinks + 508 recent, 14 query heads on 2 KV heads, D 64,
     T 2 and 1): one split written in place against 2 / 4 / 8 splits merged in the launch, 4 with a combine launch;
   - the 1.5B target's full verify attention (vanilla; 12 on 2, D 128, T 1) at 16k and 32k: the default splits
     merged in the launch against a combine launch;
   - its sparse verify (T 5, k 512 per sequence): the default splits, merged either way, and 2 / 4 / 8 merged.
   Each variant is checked against the default path's output (relative error).
2. projections (us per launch over 24 rotating weight copies, as in scripts/gpu_decode_layers.py --sweep):
   qkv_rope and gate_up of the draft and the target at 16 rows (a decode pass of batch 16), split K 1 / 2 / 4.

    PYTHONPATH=. python3 scripts/gpu_split_merge.py     # writes $OUT/split_merge.json when OUT is set
Random data (timing does not depend on values).
"""
from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dustin.bench.attention import _GraphTimer  # noqa: E402
from dustin.kernels.sparse_verify import sparse_verify_attention  # noqa: E402
from dustin.kernels.verify_attention import verify_attention  # noqa: E402

ROWS: list[dict] = []


def emit(row: dict) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def attention(timer: _GraphTimer) -> None:
    dev, bf, B = "cuda", torch.bfloat16, 16
    g = torch.Generator(device=dev).manual_seed(0)
    # the draft: streaming window over a 32k context
    hq, hkv, D, ctx, sinks, window = 14, 2, 64, 32768, 4, 508
    cap = ctx + 64
    k = torch.randn(B, hkv, cap, D, device=dev, dtype=bf, generator=g)
    v = torch.randn_like(k)
    L = torch.randint(ctx - 300, ctx, (B,), device=dev, dtype=torch.int32, generator=g)
    for T in (2, 1):
        q = torch.randn(B, hq, T, D, device=dev, dtype=bf, generator=g)
        base = verify_attention(q, k, v, L, sinks=sinks, window=window, max_len=cap)
        for n, merge in ((1, True), (2, True), (4, True), (8, True), (4, False), (None, True)):
            fn = partial(verify_attention, q, k, v, L, sinks=sinks, window=window, max_len=cap, num_splits=n,
                         merge=merge)
            emit({"part": "draft_attention", "T": T, "splits": n or "default", "merge": merge,
                  "rel_err_vs_default": rel(fn(), base), "us": round(timer(fn), 2)})
    # the target: full verify attention (vanilla's decode), then the sparse verify of a dustin step
    hq, hkv, D = 12, 2, 128
    for ctx in (16384, 32768):
        cap = ctx + 64
        k = torch.randn(B, hkv, cap, D, device=dev, dtype=bf, generator=g)
        v = torch.randn_like(k)
        L = torch.randint(ctx - 300, ctx, (B,), device=dev, dtype=torch.int32, generator=g)
        q = torch.randn(B, hq, 1, D, device=dev, dtype=bf, generator=g)
        base = verify_attention(q, k, v, L, max_len=cap)
        for merge in (True, False):
            fn = partial(verify_attention, q, k, v, L, max_len=cap, merge=merge)
            us = timer(fn)
            emit({"part": "target_attention", "ctx": ctx, "merge": merge, "rel_err_vs_default": rel(fn(), base),
                  "us": round(us, 2), "GB_per_s": round(2 * B * hkv * ctx * D * 2 / us / 1e3, 1)})
        q5 = torch.randn(B, hq, 5, D, device=dev, dtype=bf, generator=g)
        idx = torch.stack([torch.randperm(ctx - 400, device=dev)[:512] for _ in range(B)]).int()
        cnt = torch.full((B,), 512, device=dev, dtype=torch.int32)
        base = sparse_verify_attention(q5, k, v, L, idx, cnt)
        for n, merge in ((None, True), (None, False), (1, True), (2, True), (4, True), (8, True)):
            fn = partial(sparse_verify_attention, q5, k, v, L, idx, cnt, num_splits=n, merge=merge)
            emit({"part": "sparse_verify", "ctx": ctx, "splits": n or "default", "merge": merge,
                  "rel_err_vs_default": rel(fn(), base), "us": round(timer(fn), 2)})


def projections(bw: float) -> None:
    from dustin.kernels.decode_linear import QKV_TILES, RowNorm, Tiles, _fit, linear_tiles
    from dustin.models.args import named_config
    from scripts.gpu_decode_layers import _each, _gu, _qkv, graph_us

    bf, copies, m = torch.bfloat16, 24, 16
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        a = named_config(name)
        D, hq, hkv, dim, inter = a.head_dim, a.n_heads, a.n_kv_heads, a.dim, a.intermediate_size
        x = torch.randn(16, 1, dim, device="cuda", dtype=bf)
        pos = 1000 + torch.zeros(16, 1, dtype=torch.long, device="cuda")
        cos = torch.randn(16, 1, D, device="cuda")
        kc = torch.zeros(16, hkv, 2048, D, device="cuda", dtype=bf)
        norm = RowNorm(x, torch.ones(dim // 64, m, device="cuda"), 1e-6)
        q_default = _fit(2 * QKV_TILES.bn, m, dim, bf, QKV_TILES.bn, bk=QKV_TILES.bk, stages=QKV_TILES.stages)
        g_default = linear_tiles(m, inter, dim, bf, splittable=False, halves=2)
        cands = {
            "qkv_rope": ((hq + 2 * hkv) * D, partial(_qkv, x, cos, pos, kc, hq, hkv, norm),
                         [q_default] + [Tiles(16, bk, s, 4, st) for s in (2, 4) for bk, st in ((64, 6), (32, 8))]),
            "gate_up": (2 * inter, partial(_gu, x, norm),
                        [g_default] + [Tiles(bn, bk, s, 4, st) for s in (2, 4) for bn, bk, st in
                                       ((64, 128, 4), (64, 64, 6), (32, 64, 6))]),
        }
        for proj, (n, run, tiles) in cands.items():
            ws = [torch.randn(n, dim, device="cuda", dtype=bf) * 0.02 for _ in range(copies)]
            for t in tiles:
                try:
                    us = graph_us(_each, run, ws, t, iters=20) / copies
                except Exception as e:  # a tile that does not compile or fit: report and go on
                    emit({"part": "projection", "model": name, "proj": proj, "tiles": str(t), "error": str(e)[:200]})
                    continue
                emit({"part": "projection", "model": name, "proj": proj, "default": t is tiles[0],
                      "tiles": [t.bn, t.bk, t.split, t.warps, t.stages], "us": round(us, 2),
                      "pct_of_bw": round(100 * n * dim * 2 / bw / (us * 1e-6), 1)})
            del ws


def main() -> int:
    from dustin.bench.decode import copy_bandwidth

    bw = copy_bandwidth()
    emit({"part": "env", "device": torch.cuda.get_device_name(), "copy_bw_TBps": round(bw / 1e12, 3),
          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")})
    for part in (lambda: attention(_GraphTimer()), lambda: projections(bw)):
        try:
            part()
        except Exception as e:  # report and go on to the next part
            emit({"part": "error", "error": repr(e)[:500]})
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "split_merge.json").write_text(json.dumps(ROWS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
