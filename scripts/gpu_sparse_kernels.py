"""Check and time the sparse-verification kernels on a GPU.

    PYTHONPATH=. python3 scripts/gpu_sparse_kernels.py [--quick]

1. Correctness in bf16 against the float32 references (relative Frobenius error; selection exactly).
2. Timings per layer at Qwen2.5-7B shape
   (Hq 28, Hkv 4, D 128) and Qwen2.5-32B shape (Hq 40, Hkv 8, D 128), contexts 8k/16k/32k, batch 8/16,
   k = 512, gamma = 4 (T = 5):
   - sparse attention: our kernel (default splits, and the best of a small split sweep), its GB/s on
     the bytes it must move, and torch.gather of the 512 rows + SDPA for comparison;
   - score estimation: 1 target head x 1 query over the target cache, and 4 draft heads x 4 queries over
     a Qwen2.5-0.5B-shaped draft cache (Hq 14, Hkv 2, D 64), both over the full context;
   - Dustin selection (k 512, m 128) from [B, ctx] scores.
   Two numbers per entry, "eager/graph" us: eager = triton.testing.do_bench median (host launch cost
   included: it dominates small kernels, and do_bench's L2 flush is a zero_() whose dirty lines the
   timed kernel must write back); graph = CUDA-graph replay of 20 calls, each after a read-only pass over
   128 MB that evicts L2, minus the same graph without the calls: the GPU time the engine sees under
   CUDA graphs with a cold L2. GB/s uses the graph time.
Writes $OUT/sparse_kernels.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from dustin.attention.reference import sparse_verify_attention_reference
from dustin.kernels.score_estimation import attention_scores, attention_scores_reference
from dustin.kernels.selection import select_dustin, select_dustin_reference
from dustin.kernels.sparse_verify import sparse_verify_attention

DEV = "cuda"
K_SEL, GAMMA, M_DRAFT = 512, 4, 128
MODELS = {"qwen7b": (28, 4, 128), "qwen32b": (40, 8, 128)}
DRAFT = (14, 2, 64)  # Qwen2.5-0.5B: Hq, Hkv, D
TARGET_HEAD, DRAFT_HEADS = [1], [0, 3, 7, 12]  # illustrative SRH choices (query-head ids)


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def random_indices(B, lengths, k, gen):
    """k distinct sorted positions < lengths[b] per row (all lengths here exceed k)."""
    scores = torch.rand(B, int(lengths.max()), device=DEV, generator=gen)
    scores = scores.masked_fill(torch.arange(scores.shape[1], device=DEV)[None] >= lengths[:, None], -1)
    idx = scores.topk(k, dim=1).indices.sort(dim=1).values.to(torch.int32)
    return idx, torch.full((B,), k, dtype=torch.int32, device=DEV)


def check_correctness(gen):
    res = {}
    B, (Hq, Hkv, D), T = 4, MODELS["qwen7b"], GAMMA + 1
    lengths = torch.tensor([4000, 1500, 3333, 700], dtype=torch.int32, device=DEV)
    S = 4100
    q = torch.randn(B, Hq, T, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    idx, cnt = random_indices(B, lengths, K_SEL, gen)
    cnt = torch.tensor([512, 300, 17, 0], dtype=torch.int32, device=DEV)  # ragged, incl. empty
    want = sparse_verify_attention_reference(q, k, v, lengths, idx, cnt)
    res["sparse_attention_rel_err"] = max(rel_err(sparse_verify_attention(q, k, v, lengths, idx, cnt,
                                                                          num_splits=s), want)
                                          for s in (None, 1, 3, 8))
    # Score estimation: draft-style (4 heads sharing 2 KV heads, 4 queries), D 64.
    dHq, dHkv, dD = DRAFT
    qs = torch.randn(B, 4, GAMMA, dD, device=DEV, generator=gen, dtype=torch.bfloat16)
    ks = torch.randn(B, dHkv, S, dD, device=DEV, generator=gen, dtype=torch.bfloat16) * 2
    kvh = torch.tensor([h // (dHq // dHkv) for h in DRAFT_HEADS], dtype=torch.int32, device=DEV)
    qpos = lengths.long()[:, None] + torch.arange(GAMMA, device=DEV)[None]
    got = attention_scores(qs, ks, kvh, lengths + GAMMA, qpos, torch.zeros(B, S, device=DEV),
                           ctx_lengths=lengths)
    want = attention_scores_reference(qs, ks, kvh, lengths + GAMMA, qpos, torch.zeros(B, S, device=DEV),
                                      ctx_lengths=lengths)
    res["scores_rel_err"] = rel_err(got, want)
    # Selection: distinct scores -> must match the reference exactly.
    st = torch.randperm(B * S, device=DEV, generator=gen).float().view(B, S)
    sd = torch.randperm(B * S, device=DEV, generator=gen).float().view(B, S)
    sel_len = torch.tensor([4000, 400, 512, 3000], dtype=torch.int32, device=DEV)
    got = select_dustin(st, sd, sel_len, k=K_SEL, m=M_DRAFT)
    want = select_dustin_reference(st.cpu(), sd.cpu(), sel_len.cpu(), k=K_SEL, m=M_DRAFT)
    res["selection_exact"] = bool(torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]))
    return res


def gather_sdpa(q, k, v, lengths, idx):
    """Baseline: copy the selected rows out with torch.gather, append the new tokens, run SDPA."""
    B, _, T, D = q.shape
    Hkv = k.shape[1]
    gi = idx.long()[:, None, :, None].expand(B, Hkv, idx.shape[1], D)
    new = (lengths.long()[:, None] + torch.arange(T, device=DEV)[None])[:, None, :, None].expand(B, Hkv, T, D)
    ks = torch.cat([k.gather(2, gi), k.gather(2, new)], dim=2)
    vs = torch.cat([v.gather(2, gi), v.gather(2, new)], dim=2)
    n = idx.shape[1]
    mask = torch.ones(T, n + T, dtype=torch.bool, device=DEV)
    mask[:, n:] = torch.ones(T, T, dtype=torch.bool, device=DEV).tril()
    return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=True)


_FLUSH = {}


def _replay_us(graph, reps=5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


def graph_us(fn, n=20):
    """GPU time per call: CUDA-graph replay, L2 evicted by a read-only pass before each call."""
    flush = _FLUSH.setdefault("buf", torch.ones(32 << 20, device=DEV))  # 128 MB > 60 MB of L2
    sink = torch.empty((), device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, allocator) outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with_calls, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(with_calls):
        for _ in range(n):
            torch.amax(flush, dim=0, out=sink)
            fn()
    with torch.cuda.graph(flush_only):
        for _ in range(n):
            torch.amax(flush, dim=0, out=sink)
    return max(_replay_us(with_calls) - _replay_us(flush_only), 0.0) / n


def bench(fn):
    """(eager do_bench median, graph time), both in us."""
    eager = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
    return eager, graph_us(fn)


def time_config(model, ctx, B, gen, quick):
    Hq, Hkv, D = MODELS[model]
    T, S = GAMMA + 1, ctx + 64
    k = torch.randn(B, Hkv, S, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, Hq, T, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    lengths = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    idx, cnt = random_indices(B, lengths, K_SEL, gen)
    out = torch.empty_like(q)
    row = {"model": model, "ctx": ctx, "B": B}
    nbytes = B * Hkv * (K_SEL + T) * D * 2 * 2 + 2 * q.numel() * 2
    row["sparse_us"] = bench(lambda: sparse_verify_attention(q, k, v, lengths, idx, cnt, out=out))
    row["sparse_GBps"] = nbytes / row["sparse_us"][1] / 1e3
    sweep = {s: graph_us(lambda s=s: sparse_verify_attention(q, k, v, lengths, idx, cnt, out=out, num_splits=s))
             for s in ((1, 2, 4, 8) if not quick else (1, 4))}
    row["best_splits"], row["best_sparse_graph_us"] = min(sweep.items(), key=lambda kv: kv[1])
    row["gather_sdpa_us"] = bench(lambda: gather_sdpa(q, k, v, lengths, idx))
    # Score estimation, target: 1 SRH, 1 query (the last committed token), keys of the target cache.
    scores = torch.zeros(B, S, device=DEV)
    qt = torch.randn(B, len(TARGET_HEAD), 1, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    kvt = torch.tensor([h // (Hq // Hkv) for h in TARGET_HEAD], dtype=torch.int32, device=DEV)
    row["score_target_us"] = bench(lambda: attention_scores(qt, k, kvt, lengths, (lengths.long() - 1)[:, None],
                                                            scores))
    # Score estimation, draft: 4 SRHs x gamma queries over a draft-shaped cache holding the draft tokens.
    dHq, dHkv, dD = DRAFT
    kd = torch.randn(B, dHkv, S, dD, device=DEV, generator=gen, dtype=torch.bfloat16)
    qd = torch.randn(B, len(DRAFT_HEADS), GAMMA, dD, device=DEV, generator=gen, dtype=torch.bfloat16)
    kvd = torch.tensor([h // (dHq // dHkv) for h in DRAFT_HEADS], dtype=torch.int32, device=DEV)
    qpos = lengths.long()[:, None] + torch.arange(GAMMA, device=DEV)[None]
    row["score_draft_us"] = bench(lambda: attention_scores(qd, kd, kvd, lengths + GAMMA, qpos, scores,
                                                           ctx_lengths=lengths))
    st, sd = torch.rand(B, S, device=DEV, generator=gen), torch.rand(B, S, device=DEV, generator=gen)
    row["select_us"] = bench(lambda: select_dustin(st, sd, lengths, k=K_SEL, m=M_DRAFT))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer configs and no split sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    gen = torch.Generator(device=DEV).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    correctness = check_correctness(gen)
    ok = (correctness["sparse_attention_rel_err"] < 1e-2 and correctness["scores_rel_err"] < 1e-2
          and correctness["selection_exact"])
    print("correctness:", json.dumps(correctness), "OK" if ok else "FAILED")
    rows = []
    hdr = (f"{'model':8} {'ctx':>6} {'B':>3} | {'sparse':>11} {'GB/s':>5} {'best(splits)':>12} | "
           f"{'gather+sdpa':>11} | {'scoreT':>11} {'scoreD':>11} | {'select':>11}")
    print("us as eager/graph (see the module docstring)")
    print(hdr)

    def fmt(pair):
        return f"{pair[0]:5.1f}/{pair[1]:5.1f}"

    ctxs = (8192, 32768) if args.quick else (8192, 16384, 32768)
    for model in MODELS:
        for ctx in ctxs:
            for B in (8, 16):
                r = time_config(model, ctx, B, gen, args.quick)
                rows.append(r)
                print(f"{model:8} {ctx:>6} {B:>3} | {fmt(r['sparse_us'])} {r['sparse_GBps']:5.0f} "
                      f"{r['best_sparse_graph_us']:8.1f}({r['best_splits']}) | {fmt(r['gather_sdpa_us'])} | "
                      f"{fmt(r['score_target_us'])} {fmt(r['score_draft_us'])} | {fmt(r['select_us'])}",
                      flush=True)
                torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "sparse_kernels.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "correctness": correctness, "ok": ok, "rows": rows}, f,
                      indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
