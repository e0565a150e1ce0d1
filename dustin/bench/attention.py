"""`dustin bench attention`: self-attention latency breakdown of ONE target layer's verify step (paper
Fig. 7/8/10), bf16 random data, k = 512, Γ = 4 (T = 5 queries), Qwen2.5-7B / 32B-shaped layers.

Rows, all per target layer (us):
- full: `verify_attention` over the whole cache (the FlashAttention-style baseline);
- dustin: sparse attention over the `select_dustin` set + estimation amortized per layer. The engine
  computes S_target (1 SRH x 1 query over one target layer's cache), S_draft (4 SRHs x Γ queries over
  3 Qwen2.5-0.5B draft layers, one multi-layer estimate) and one selection per verify step, shared by every
  target layer: per-layer estimation = (S_target + S_draft + selection) / n_target_layers;
- quest-16: per layer, page scoring of every KV head for the layer's verify queries + its top-k, and the
  sparse attention over the per-KV-head page lists;
- naive: the same sums over ALL heads of ALL target layers (1 query) and draft layers (Γ queries) +
  selection, amortized alike. Accumulated by `attention_scores` (cheaper than writing every head's map),
  one call per KV group: one call over all Hq heads multiplies the kernel's tensor-core work by Hq / G
  for the same bytes and takes ~30 s per kernel to compile at 40 heads.
Timing: CUDA-graph replay of 20 calls, each after a read-only 128 MB pass that evicts L2, minus the same
graph without the calls (the GPU time the engine sees under CUDA graphs, cold L2); median of 5 replays.
--smoke runs tiny shapes on the CPU through the Triton interpreter: it checks the plumbing, not the times.
"""
from __future__ import annotations

import json
import os
import statistics
import time

from dustin.bench.plots import attention_breakdown, ctx_label
from dustin.errors import InputError

MODELS = {"qwen2.5-32b": (40, 8, 128, 64), "qwen2.5-7b": (28, 4, 128, 28)}  # Hq, Hkv, D, layers
DRAFT = (14, 2, 64, 24)  # Qwen2.5-0.5B
SMOKE_MODELS = {"tiny": (8, 2, 32, 4)}
SMOKE_DRAFT = (4, 2, 16, 3)
SRH_DRAFT_HEADS, SRH_DRAFT_LAYERS = (0, 3, 7, 12), 3  # 4 draft SRHs on 3 draft layers, 1 target SRH


def add_arguments(p) -> None:
    p.add_argument("--models", default=",".join(MODELS), help="layer shapes: " + ", ".join(MODELS))
    p.add_argument("--contexts", default="8192,16384,32768")
    p.add_argument("--batches", default="8,16")
    p.add_argument("--k", type=int, default=512, help="KV budget of the sparse verify set")
    p.add_argument("--m", type=int, default=128, help="draft picks of the Dustin set")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--time-budget", type=float, default=190.0, help="skip the settings left after this many s")
    p.add_argument("--json-out", default=None, help="write the results JSON here (default: none)")
    p.add_argument("--plot-out", default=None, help="draw the breakdown plot here (default: none)")
    p.add_argument("--plot-from", default=None, help="only redraw the plot from a JSON this bench wrote")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1); no timing")


class _GraphTimer:
    """us per call: CUDA graph of n calls with L2 evicted before each, minus the eviction-only graph."""

    def __init__(self, n=20, reps=5):
        import torch

        self.n, self.reps = n, reps
        self.flush = torch.ones(32 << 20, device="cuda")  # 128 MB > the H200's 60 MB L2
        self.sink = torch.empty((), device="cuda")

    def _replay_us(self, graph):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def __call__(self, fn):
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graphs = []
        for with_calls in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(self.n):
                    torch.amax(self.flush, dim=0, out=self.sink)
                    if with_calls:
                        fn()
            graphs.append(g)
        return max(self._replay_us(graphs[0]) - self._replay_us(graphs[1]), 0.0) / self.n


def _cpu_timer(fn):
    fn()  # compile / first-call costs
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def copy_bandwidth_cpu(nbytes=16 << 20):
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return 2 * nbytes / (time.perf_counter() - t0)


def measure(name, shape, draft, ctx, B, args, timer, dev):
    import torch

    from dustin.kernels.quest import QuestPages, page_scores, quest_select
    from dustin.kernels.score_estimation import attention_scores, attention_scores_multi
    from dustin.kernels.selection import select_dustin
    from dustin.kernels.sparse_verify import sparse_verify_attention
    from dustin.kernels.verify_attention import verify_attention

    Hq, Hkv, D, n_layers = shape
    dHq, dHkv, dD, d_layers = draft
    T, gamma, bf = args.gamma + 1, args.gamma, torch.bfloat16
    S = ctx + T + 59  # a few stale rows past the new tokens, as in a real cache
    g = torch.Generator(device=dev).manual_seed(ctx + B)
    rnd = lambda *s, dtype=bf: torch.randn(*s, device=dev, generator=g, dtype=dtype)  # noqa: E731
    k, v, q = rnd(B, Hkv, S, D), rnd(B, Hkv, S, D), rnd(B, Hq, T, D)
    out = torch.empty_like(q)
    L = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    kv_of = lambda heads, H, Hk: torch.tensor([h // (H // Hk) for h in heads], dtype=torch.int32, device=dev)  # noqa
    r = {"model": name, "context": ctx, "batch": B}
    r["full_us"] = timer(lambda: verify_attention(q, k, v, L, max_len=ctx + T, out=out))
    r["full_bytes"] = B * Hkv * (ctx + T) * D * 2 * 2 + 2 * q.numel() * 2

    # dustin: the per-step estimation, shared by all target layers, made as the engine's estimators make it
    # (dustin/selection/estimators.py): one multi-layer estimate for S_target and one for S_draft
    acc_t, acc_d = torch.zeros(B, S, device=dev), torch.zeros(B, S, device=dev)
    q_t, last = rnd(B, 1, 1, 1, D), (L.long() - 1)[:, None]  # the last committed token's query
    # index tensors are built here, not in the timed lambdas: a host->device copy cannot be graph-captured
    kv_t, L_d = kv_of([1], Hq, Hkv)[None], L + gamma
    r["s_target_us"] = timer(lambda: attention_scores_multi(q_t, k[None], None, kv_t, L, None, acc_t,
                                                            accumulate=False))
    n_d = min(SRH_DRAFT_LAYERS, d_layers)
    kd = rnd(n_d, B, dHkv, S, dD)  # the configured draft layers' K caches
    srh_d = [h % dHq for h in SRH_DRAFT_HEADS]
    q_d, qpos = rnd(B, n_d, len(srh_d), gamma, dD), L.long()[:, None] + torch.arange(gamma, device=dev)[None]
    kv_d = kv_of(srh_d, dHq, dHkv)[None].expand(n_d, -1).contiguous()
    r["s_draft_us"] = timer(lambda: attention_scores_multi(q_d, kd, None, kv_d, None, qpos, acc_d, ctx_lengths=L,
                                                           accumulate=False))
    st, sd = torch.rand(B, S, device=dev, generator=g), torch.rand(B, S, device=dev, generator=g)
    r["select_us"] = timer(lambda: select_dustin(st, sd, L, k=args.k, m=args.m))
    idx, cnt = select_dustin(st, sd, L, k=args.k, m=args.m)
    r["dustin_sparse_us"] = timer(lambda: sparse_verify_attention(q, k, v, L, idx, cnt, out=out))
    r["dustin_est_step_us"] = r["s_target_us"] + r["s_draft_us"] + r["select_us"]
    r["dustin_est_layer_us"] = r["dustin_est_step_us"] / n_layers

    def quest():  # quest-16: per layer, all KV heads, this layer's verify queries
        pages = QuestPages(1, B, Hkv, D, S, bf, dev)
        pages.build(0, k, L)
        mn, mx = pages.kmin[0], pages.kmax[0]
        buf = torch.empty(B, Hkv, mn.shape[2], device=dev)
        r["quest_score_us"] = timer(lambda: page_scores(q, mn, mx, L, out=buf))
        r["quest_est_us"] = timer(lambda: quest_select(q, mn, mx, L, args.k))
        qidx, qcnt = quest_select(q, mn, mx, L, args.k)
        r["quest_sparse_us"] = timer(lambda: sparse_verify_attention(q, k, v, L, qidx, qcnt, out=out))

    def naive():  # every head of every layer (timed on one layer of each model, times the layer count)
        def all_heads(q_all, cache, n_kv, key_len, pos, acc):
            G = q_all.shape[1] // n_kv
            for h in range(n_kv):  # one call per KV group (see the module docstring)
                attention_scores(q_all[:, h * G:(h + 1) * G], cache, kvh[h], key_len, pos, acc, ctx_lengths=L)

        kvh = [torch.full((max(Hq // Hkv, dHq // dHkv),), h, dtype=torch.int32, device=dev)
               for h in range(max(Hkv, dHkv))]
        q_all, q_alld = rnd(B, Hq, 1, D), rnd(B, dHq, gamma, dD)
        r["naive_target_layer_us"] = timer(lambda: all_heads(q_all, k, Hkv, L, last, acc_t))
        r["naive_draft_layer_us"] = timer(lambda: all_heads(q_alld, kd[0], dHkv, L_d, qpos, acc_d))
        r["naive_est_step_us"] = (n_layers * r["naive_target_layer_us"] + d_layers * r["naive_draft_layer_us"]
                                  + r["select_us"])
        r["naive_est_layer_us"] = r["naive_est_step_us"] / n_layers

    for part in (quest, naive):  # a baseline that fails is reported, and the Dustin rows still come out
        try:
            part()
        except Exception as e:  # noqa: BLE001
            r.setdefault("errors", {})[part.__name__] = repr(e)[:300]
            print(f"<!-- {name} {ctx} {B}: {part.__name__} failed: {e!r} -->", flush=True)
    return r


def derive(r, bw):
    nan = float("nan")
    for key in ("quest_score_us", "quest_est_us", "quest_sparse_us", "naive_target_layer_us",
                "naive_draft_layer_us", "naive_est_step_us", "naive_est_layer_us"):
        r.setdefault(key, nan)  # a baseline that failed (see measure)
    full = r["full_us"]
    r["full_frac_copy_bw"] = r["full_bytes"] / (full * 1e-6) / bw
    r["dustin_layer_us"] = r["dustin_sparse_us"] + r["dustin_est_layer_us"]
    r["quest_layer_us"] = r["quest_sparse_us"] + r["quest_est_us"]
    r["speedup_dustin"] = full / r["dustin_layer_us"]
    r["speedup_dustin_sparse_only"] = full / r["dustin_sparse_us"]
    r["speedup_quest"] = full / r["quest_layer_us"]
    for est in ("dustin_est_layer", "quest_est", "naive_est_layer"):
        r[f"{est}_pct_of_full"] = 100 * r[f"{est}_us"] / full
    return r


def goals(rows, smoke):
    if smoke:
        return {"note": "smoke run: CPU interpreter times, goals not evaluated"}
    long = [r for r in rows if r["context"] >= 16384]
    key = [r for r in rows if r["model"] == "qwen2.5-32b" and r["context"] == 32768 and r["batch"] == 16]
    return {"estimation_le_1pct_at_16k_32k": bool(long) and all(r["dustin_est_layer_pct_of_full"] <= 1 for r in long),
            "full_ge_80pct_copy_bw": bool(rows) and all(r["full_frac_copy_bw"] >= 0.8 for r in rows),
            "speedup_ge_25x_32b_32k_b16": bool(key) and key[0]["speedup_dustin"] >= 25,
            "speedup_32b_32k_b16": key[0]["speedup_dustin"] if key else None}


def print_row(r):
    print(f"| {r['model']} | {ctx_label(r['context'])} | {r['batch']} | {r['full_us']:.1f} | "
          f"{100 * r['full_frac_copy_bw']:.0f}% | {r['dustin_sparse_us']:.1f} | {r['dustin_est_step_us']:.1f} | "
          f"{r['dustin_est_layer_us']:.2f} ({r['dustin_est_layer_pct_of_full']:.2f}%) | "
          f"**{r['speedup_dustin']:.1f}x** ({r['speedup_dustin_sparse_only']:.1f}x) | "
          f"{r['quest_est_us']:.1f} ({r['quest_est_pct_of_full']:.1f}%) | {r['quest_sparse_us']:.1f} | "
          f"{r['speedup_quest']:.1f}x | {r['naive_est_layer_us']:.1f} ({r['naive_est_layer_pct_of_full']:.0f}%) |",
          flush=True)


def run(args) -> int:
    import torch

    if args.plot_from:
        with open(args.plot_from) as f:
            return 0 if attention_breakdown(json.load(f), args.plot_out or "bench_attention.png") else 1
    if args.smoke:  # must be set before the kernel modules (imported lazily below) define their kernels
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dev, timer, bw = "cpu", _cpu_timer, copy_bandwidth_cpu()
        models, draft = SMOKE_MODELS, SMOKE_DRAFT
        contexts, batches = [160, 300], [2]
        args.k, args.m = min(args.k, 64), min(args.m, 16)
    else:
        if not torch.cuda.is_available():
            raise InputError("dustin bench attention needs a CUDA GPU (or --smoke)")
        from dustin.bench.decode import copy_bandwidth
        dev, timer, bw = "cuda", _GraphTimer(), copy_bandwidth()
        unknown = set(args.models.split(",")) - set(MODELS)
        if unknown:
            raise InputError(f"unknown model shapes {sorted(unknown)}; choose from {list(MODELS)}")
        models, draft = {m: MODELS[m] for m in args.models.split(",")}, DRAFT
        contexts, batches = [int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")]
    t0 = time.perf_counter()
    json_path, plot_path = args.json_out, args.plot_out
    import triton
    try:
        checks = check_kernels_on_device(dev)  # the Quest and per-head sparse kernels on the timed device
    except Exception as e:  # noqa: BLE001  (report it, and still time)
        checks = {"ok": False, "error": repr(e)[:500]}
    dev_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"# attention breakdown | {dev_name} | torch {torch.__version__} | triton {triton.__version__} | "
          f"copy {bw / 1e12:.2f} TB/s | k {args.k} | Γ {args.gamma} | checks {'OK' if checks['ok'] else 'FAILED'}")
    print("| model | ctx | B | full us | % copy BW | dustin sparse us | dustin est/step us | dustin est/layer us "
          "(% full) | dustin speedup (sparse only) | quest-16 est us (% full) | quest sparse us | quest speedup "
          "| naive est/layer us (% full) |")
    print("|" + "---|" * 13)
    res = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__, "copy_bandwidth_Bps": bw,
           "smoke": bool(args.smoke), "k": args.k, "m": args.m, "gamma": args.gamma, "models": models,
           "draft": draft, "checks": checks, "rows": [], "skipped": []}
    for name, shape in models.items():
        for ctx in contexts:
            for B in batches:
                if time.perf_counter() - t0 > args.time_budget:
                    res["skipped"].append([name, ctx, B])
                    continue
                try:
                    r = derive(measure(name, shape, draft, ctx, B, args, timer, dev), bw)
                except Exception as e:  # noqa: BLE001  (e.g. out of memory: keep the other settings)
                    res["skipped"].append([name, ctx, B, repr(e)[:300]])
                    print(f"<!-- {name} {ctx} {B} failed: {e!r} -->", flush=True)
                    continue
                res["rows"].append(r)
                print_row(r)
                res["goals"] = goals(res["rows"], args.smoke)
                if json_path:  # after every setting: a run cut short keeps what it measured
                    with open(json_path, "w") as f:
                        json.dump(res, f, indent=1)
                if dev == "cuda":
                    torch.cuda.empty_cache()
    res["goals"], res["elapsed_s"] = goals(res["rows"], args.smoke), time.perf_counter() - t0
    print("goals:", json.dumps(res["goals"]), f"| skipped {res['skipped']} | {res['elapsed_s']:.0f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    if plot_path:
        attention_breakdown(res, plot_path)
    return 0 if checks["ok"] else 1


def check_kernels_on_device(dev) -> dict:
    """Small bf16 check of the Quest and per-head sparse kernels on `dev` against the fp32 references (run before
    timing, since the tests only run the CPU interpreter): exactness flags and relative errors. It lives with the
    benchmark, its one caller, above both the kernels and the references of dustin/attention."""
    import torch

    from dustin.attention.reference import sparse_verify_attention_reference as ref
    from dustin.kernels.quest import (
        page_minmax,
        page_minmax_reference,
        page_scores,
        page_scores_reference,
        select_pages,
    )
    from dustin.kernels.sparse_verify import sparse_verify_attention

    g = torch.Generator(device=dev).manual_seed(0)
    B, Hq, Hkv, T, D, cap = 3, 28, 4, 5, 128, 700
    L = torch.tensor([650, 77, 300], dtype=torch.int32, device=dev)
    k, v = (torch.randn(B, Hkv, cap, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(B, Hq, T, D, device=dev, generator=g, dtype=torch.bfloat16)
    mn, mx = (torch.zeros(B, Hkv, cap // 16 + 1, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    page_minmax(k, L - 40, mn, mx)
    page_minmax(k, L, mn, mx, lengths_before=L - 40, max_new=40)
    want_mn, want_mx = page_minmax_reference(k, L, n_pages=mn.shape[2])
    s = page_scores(q, mn, mx, L)
    s_ref = page_scores_reference(q, want_mn, want_mx, L)
    fin = torch.isfinite(s_ref)
    idx, cnt = select_pages(s, L, 128)
    out = sparse_verify_attention(q, k, v, L, idx, cnt)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    res = {"quest_minmax_exact": bool(torch.equal(mn, want_mn) and torch.equal(mx, want_mx)),
           "quest_inf_marks_exact": bool(torch.equal(torch.isinf(s), torch.isinf(s_ref))),
           "quest_scores_rel_err": rel(s[fin], s_ref[fin]),
           "quest_newest_position_selected": bool(all(int(L[b]) - 1 in idx[b, h, : cnt[b, h]].tolist()
                                                      for b in range(B) for h in range(Hkv))),
           "per_head_sparse_rel_err": rel(out, ref(q, k, v, L, idx, cnt))}
    res["ok"] = (res["quest_minmax_exact"] and res["quest_inf_marks_exact"] and res["quest_newest_position_selected"]
                 and res["quest_scores_rel_err"] < 1e-3 and res["per_head_sparse_rel_err"] < 1e-2)
    return res
