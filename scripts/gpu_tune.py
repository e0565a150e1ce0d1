"""One GPU call that checks the radix selection, sweeps the launch configurations of the verify-step kernels,
and runs `dustin bench attention` with the fastest ones (this session had ~5 minutes of device time: one call).

    PYTHONPATH=. python3 scripts/gpu_tune.py [--bench-budget 120]

1. The radix selection (scripts/experiments/select_radix.py) on the GPU against the Python reference (ties,
   short rows) and against the engine's select_dustin at B 16 x 32k (distinct scores: same sets).
2. Timings (us, CUDA-graph replay with L2 evicted before each call, as `dustin bench attention`):
   selection radix vs topk; sparse verify launch configurations at Qwen2.5-32B / 7B layers, 32k x 16, k 512,
   Γ 4 (each checked against the default configuration's output; "merge": "kernel" merges the splits in the
   same launch, "launch" in a second, combine launch: `sparse_verify_attention(merge=...)`); S_draft / S_target
   launch variants.
3. `dustin bench attention` in this process with the fastest sparse / estimation configurations patched in
   (recorded under "chosen" in $OUT/gpu_tune.json) and the faster selection swapped in; its table,
   JSON and PNG go to $OUT. Every part is wrapped: one failure is reported and the rest still run.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import time

import torch

import dustin.kernels.score_estimation as se
import dustin.kernels.selection as sel
import dustin.kernels.sparse_verify as sv
from dustin.bench.attention import _GraphTimer
from scripts.experiments.select_radix import select_dustin_radix

DEV, BF = "cuda", torch.bfloat16
OUT = os.environ.get("OUT", ".")
T0 = time.perf_counter()
RES: dict = {"torch": torch.__version__}
# Shapes: (B, ctx) of the selection timings and sweeps, and the long-row checks; --smoke shrinks them so that
# the whole script can be tried on the CPU (TRITON_INTERPRET=1) before it spends device time.
SEL_SETTINGS = ((8, 8192), (16, 16384), (8, 32768), (16, 32768))
SWEEP_SETTINGS = ((32768, 16), (8192, 8))
CHECK_SHAPES = ((4, 9000), (16, 32832))
SPARSE_CONFIGS = [
    {"num_splits": 1, "block_n": 128, "num_warps": 4, "num_stages": 3},
    {"num_splits": 1, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"num_splits": 1, "block_n": 64, "num_warps": 4, "num_stages": 4},
    {"num_splits": 1, "block_n": 128, "num_warps": 8, "num_stages": 2},
    {"num_splits": 2, "block_n": 64, "num_warps": 4, "num_stages": 2, "merge": "kernel"},
    {"num_splits": 2, "block_n": 64, "num_warps": 4, "num_stages": 3, "merge": "kernel"},
    {"num_splits": 4, "block_n": 64, "num_warps": 4, "num_stages": 2, "merge": "kernel"},
    {"num_splits": 4, "block_n": 32, "num_warps": 2, "num_stages": 3, "merge": "kernel"},
    {"num_splits": 4, "block_n": 32, "num_warps": 4, "num_stages": 2, "merge": "kernel"},
    {"num_splits": 8, "block_n": 32, "num_warps": 2, "num_stages": 2, "merge": "kernel"},
    {"num_splits": 8, "block_n": 64, "num_warps": 4, "num_stages": 1, "merge": "kernel"},
    {"num_splits": 4, "block_n": 64, "num_warps": 4, "num_stages": 2, "merge": "launch"},
]
SCORE_CONFIGS = [{}, {"block_n": 128}, {"num_stages": 3}, {"num_stages": 4}, {"num_warps": 8},
                 {"block_n": 128, "num_warps": 8}, {"num_programs": 16}, {"num_programs": 64}, {"block_n": 32}]


SELECT_IMPLS = {"radix": select_dustin_radix, "topk": sel.select_dustin}


def sparse_config(q, k, v, L, idx, cnt, merge="launch", **cfg):
    """sparse verify with a SPARSE_CONFIGS entry: merge "kernel" (in the launch) or "launch" (a combine kernel)."""
    return sv.sparse_verify_attention(q, k, v, L, idx, cnt, merge=merge == "kernel", **cfg)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def save():
    with open(os.path.join(OUT, "gpu_tune.json"), "w") as f:
        json.dump(RES, f, indent=1)


def part(fn):
    @functools.wraps(fn)
    def wrapped(*a, **kw):
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001
            RES.setdefault("errors", {})[fn.__name__] = repr(e)[:500]
            log(f"{fn.__name__} FAILED: {e!r}")
        finally:
            save()
    return wrapped


@part
def check_selection():
    g = torch.Generator(device=DEV).manual_seed(0)
    out = {}
    B, S = CHECK_SHAPES[0]
    L = torch.tensor([S, S // 2, 400, S - 1], dtype=torch.int32, device=DEV)
    for name, st in (("distinct", torch.rand(B, S, device=DEV, generator=g)),
                     ("ties", (torch.rand(B, S, device=DEV, generator=g) * 3).floor())):
        sd = torch.rand(B, S, device=DEV, generator=g).pow(6)
        for m in (0, 128):
            got = select_dustin_radix(st, sd, L, k=512, m=m)
            want = sel.select_dustin_reference(st.cpu(), sd.cpu(), L.cpu(), k=512, m=m)
            out[f"{name}_m{m}_equal_reference"] = bool(torch.equal(got[0].cpu(), want[0]) and
                                                       torch.equal(got[1].cpu(), want[1]))
    B, S = CHECK_SHAPES[1]
    st = torch.randperm(B * S, device=DEV, generator=g).float().view(B, S)
    sd = torch.randperm(B * S, device=DEV, generator=g).float().view(B, S)
    L = torch.full((B,), S - 64, dtype=torch.int32, device=DEV) - torch.arange(B, dtype=torch.int32, device=DEV)
    for m in (0, 128):
        a = select_dustin_radix(st, sd, L, k=512, m=m)
        b = sel.select_dustin(st, sd, L, k=512, m=m)
        out[f"32k_m{m}_radix_equal_topk"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    RES["selection_checks"] = out
    log("selection checks", out)


@part
def time_selection(timer):
    rows = []
    for B, ctx in SEL_SETTINGS:
        S = ctx + 64
        g = torch.Generator(device=DEV).manual_seed(ctx + B)
        st, sd = torch.rand(B, S, device=DEV, generator=g), torch.rand(B, S, device=DEV, generator=g)
        L = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        r = {"B": B, "ctx": ctx}
        for impl, fn in SELECT_IMPLS.items():
            r[impl] = timer(lambda fn=fn, st=st, sd=sd, L=L: fn(st, sd, L, k=512, m=128))
        rows.append(r)
        log("select", r)
    RES["selection_us"] = rows


def _cache(Hq, Hkv, D, ctx, B, T=5):
    g = torch.Generator(device=DEV).manual_seed(1)
    S = ctx + T + 59
    k, v = (torch.randn(B, Hkv, S, D, device=DEV, dtype=BF, generator=g) for _ in range(2))
    q = torch.randn(B, Hq, T, D, device=DEV, dtype=BF, generator=g)
    L = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    st, sd = torch.rand(B, S, device=DEV, generator=g), torch.rand(B, S, device=DEV, generator=g)
    idx, cnt = sel.select_dustin(st, sd, L, k=512, m=128)
    return q, k, v, L, idx, cnt


@part
def sweep_sparse(timer):
    RES["sparse_us"] = {}
    for name, (Hq, Hkv, D) in (("qwen2.5-32b", (40, 8, 128)), ("qwen2.5-7b", (28, 4, 128))):
        for ctx, B in SWEEP_SETTINGS:
            q, k, v, L, idx, cnt = _cache(Hq, Hkv, D, ctx, B)
            want = sv.sparse_verify_attention(q, k, v, L, idx, cnt).float()
            rows = [{"default": True, "us": timer(lambda q=q, k=k, v=v, L=L, idx=idx, cnt=cnt:
                                                   sv.sparse_verify_attention(q, k, v, L, idx, cnt))}]
            for cfg in SPARSE_CONFIGS:
                row = dict(cfg)
                try:
                    got = sparse_config(q, k, v, L, idx, cnt, **cfg).float()
                    row["rel_err"] = ((got - want).norm() / want.norm()).item()
                    row["us"] = timer(lambda cfg=cfg, q=q, k=k, v=v, L=L, idx=idx, cnt=cnt:
                                      sparse_config(q, k, v, L, idx, cnt, **cfg))
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:200]
                rows.append(row)
            RES["sparse_us"][f"{name}_{ctx}x{B}"] = rows
            best = min((r for r in rows if r.get("rel_err", 0) < 1e-2 and "us" in r), key=lambda r: r["us"])
            log("sparse", name, ctx, B, "default", round(rows[0]["us"], 1), "best", best)
            save()


@part
def sweep_scores(timer):
    ctx, B = SWEEP_SETTINGS[0]
    S = ctx + 64
    g = torch.Generator(device=DEV).manual_seed(2)
    L = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    acc = torch.zeros(B, S, device=DEV)
    kd = torch.randn(3, B, 2, S, 64, device=DEV, dtype=BF, generator=g)
    qd = torch.randn(B, 3, 4, 4, 64, device=DEV, dtype=BF, generator=g)
    kvd = torch.tensor([[0, 0, 1, 1]] * 3, dtype=torch.int32, device=DEV)
    qpos = L.long()[:, None] + torch.arange(4, device=DEV)[None]
    kt = torch.randn(1, B, 8, S, 128, device=DEV, dtype=BF, generator=g)
    qt = torch.randn(B, 1, 1, 1, 128, device=DEV, dtype=BF, generator=g)
    kvt = torch.tensor([[0]], dtype=torch.int32, device=DEV)
    calls = {"s_draft": lambda **kw: se.attention_scores_multi(qd, kd, None, kvd, None, qpos, acc, ctx_lengths=L,
                                                               accumulate=False, **kw),
             "s_target": lambda **kw: se.attention_scores_multi(qt, kt, None, kvt, L, None, acc, accumulate=False,
                                                                **kw)}
    RES["scores_us"] = {}
    for name, call in calls.items():
        want = call().clone()
        rows = []
        for cfg in SCORE_CONFIGS:
            row = dict(cfg)
            try:
                row["rel_err"] = ((call(**cfg) - want).norm() / want.norm()).item()
                row["us"] = timer(lambda cfg=cfg, call=call: call(**cfg))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:200]
            rows.append(row)
        RES["scores_us"][name] = rows
        log("scores", name, [(r.get("us"), {k: v for k, v in r.items() if k not in ("us", "rel_err")}) for r in rows])
        save()


def _best(rows, default_index=0):
    ok = [r for r in rows if "us" in r and r.get("rel_err", 0) < 1e-2]
    best = min(ok, key=lambda r: r["us"]) if ok else rows[default_index]
    return {k: v for k, v in best.items() if k not in ("us", "rel_err", "default")}


@part
def bench(budget, smoke=False):
    chosen = {"sparse": {}, "scores": {}}
    for key, rows in RES.get("sparse_us", {}).items():
        if key.endswith(f"{SWEEP_SETTINGS[0][0]}x{SWEEP_SETTINGS[0][1]}"):
            chosen["sparse"][key.split("_")[0]] = _best(rows)
    for key, rows in RES.get("scores_us", {}).items():
        chosen["scores"][key] = _best(rows)
    sel_rows = RES.get("selection_us", [])
    checks = RES.get("selection_checks", {})
    radix_ok = bool(checks) and all(checks.values())
    faster = sum(r["radix"] < r["topk"] for r in sel_rows) > len(sel_rows) / 2
    chosen["select_impl"] = "radix" if radix_ok and faster else "topk"
    RES["chosen"] = chosen
    # The benchmark imports these functions when it runs: patching the module attributes swaps them in.
    sel.select_dustin = SELECT_IMPLS[chosen["select_impl"]]
    sparse_orig, scores_orig = sv.sparse_verify_attention, se.attention_scores_multi
    by_group = {5: chosen["sparse"].get("qwen2.5-32b", {}), 7: chosen["sparse"].get("qwen2.5-7b", {})}

    def sparse(q, k, v, L, idx, cnt, **kw):  # the per-sequence (Dustin) lists of the two benchmark shapes
        cfg = by_group.get(q.shape[1] // k.shape[1], {}) if idx.dim() == 2 and not kw.keys() - {"out"} else {}
        cfg = {**cfg, **kw}
        return sparse_orig(q, k, v, L, idx, cnt, merge=cfg.pop("merge", "kernel") == "kernel", **cfg)

    def scores(q, k_all, *a, **kw):
        B, NL, Hs, Tq, D = q.shape
        which = "s_draft" if NL > 1 else "s_target" if Hs == 1 and Tq == 1 else None
        return scores_orig(q, k_all, *a, **{**chosen["scores"].get(which, {}), **kw})

    sv.sparse_verify_attention, se.attention_scores_multi = sparse, scores
    log("bench attention with", chosen)
    save()
    from dustin.cli.main import main
    buf = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, s):
            buf.write(s)
            return os.sys.__stdout__.write(s)

    with contextlib.redirect_stdout(Tee()):
        rc = main(["bench", "attention", "--time-budget", str(budget), *(["--smoke"] if smoke else []),
                   "--json-out", os.path.join(OUT, "bench_attention.json"),
                   "--plot-out", os.path.join(OUT, "bench_attention.png")])
    with open(os.path.join(OUT, "bench_attention.txt"), "w") as f:
        f.write(buf.getvalue())
    RES["bench_rc"] = rc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench-budget", type=float, default=120.0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args()
    global DEV, SEL_SETTINGS, SWEEP_SETTINGS, CHECK_SHAPES, SPARSE_CONFIGS, SCORE_CONFIGS
    if args.smoke:
        from dustin.bench.attention import _cpu_timer as timer
        DEV, SEL_SETTINGS, SWEEP_SETTINGS, CHECK_SHAPES = "cpu", ((2, 700),), ((700, 2),), ((3, 900), (2, 1300))
        SPARSE_CONFIGS, SCORE_CONFIGS = SPARSE_CONFIGS[3:5], SCORE_CONFIGS[:2]
    else:
        timer = _GraphTimer()
    RES["device"] = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    check_selection()
    time_selection(timer)
    sweep_sparse(timer)
    sweep_scores(timer)
    if not args.smoke:
        bench(args.bench_budget)
    RES["elapsed_s"] = time.perf_counter() - T0
    save()
    log("done")


if __name__ == "__main__":
    main()
