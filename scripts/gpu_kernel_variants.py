"""Check and time the estimation and sparse-verify kernels, and the in-kernel merge experiment, on one GPU.

    PYTHONPATH=. python3 scripts/gpu_kernel_variants.py [--quick]

(Its 2026-11-30 run, docs/results/kernel_variants_h200.json, also timed the separate combine launch and the
two-pass estimation, since deleted from dustin/kernels/score_estimation.py: both were slower.)
1. Correctness in bf16 against the float32 references (relative Frobenius error, must be < 1e-2):
   multi-layer score estimation (draft- and target-shaped), the estimators' one-launch path, and sparse
   verify with the in-kernel merge (`sparse_verify_attention(merge=True)`; per-sequence and per-KV-head
   lists, 2-4 splits, called twice so a counter left non-zero would show).
2. Timings (us, CUDA-graph replay with L2 evicted before each call: dustin.bench.attention._GraphTimer) at
   Qwen2.5-32B target layers (Hq 40, Hkv 8, D 128) / Qwen2.5-0.5B draft (Hq 14, Hkv 2, D 64), contexts
   8k/16k/32k x batch 8/16, k 512, Γ 4:
   - S_target, 1 head x 1 query: `attention_scores_multi`; plus TargetHistoricalScores.compute;
   - S_draft, heads (0, 3, 7, 12) x Γ queries on 3 draft layers: 3 one-layer calls against one multi-layer
     call; plus DraftLookaheadScores.compute;
   - selection (`select_dustin`, k 512, m 128);
   - sparse verify: merge "launch" (a combine kernel) vs "kernel" (in the launch, the engine's default) at
     splits 1/2/4 (1 split: identical, no merge);
   - est/step = S_target + S_draft + selection (per-layer S_draft calls, the multi-layer call, the
     estimators' compute), and (best sparse + est/step / 64).
Every variant is wrapped so one failure is reported and the rest still run. Writes $OUT/kernel_variants.json
when OUT is set (after every setting). Exit status 1 if a correctness check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import torch
import triton

from dustin.attention.reference import sparse_verify_attention_reference
from dustin.bench.attention import _GraphTimer
from dustin.kernels import score_estimation as se
from dustin.kernels.selection import select_dustin
from dustin.kernels.sparse_verify import sparse_verify_attention
from dustin.selection.config import ScoreHeads
from dustin.selection.estimators import DraftLookaheadScores, TargetHistoricalScores

DEV, BF = "cuda", torch.bfloat16
TARGET = (40, 8, 128, 64)  # Hq, Hkv, D, layers (Qwen2.5-32B)
DRAFT = (14, 2, 64)  # Qwen2.5-0.5B
DRAFT_HEADS, DRAFT_LAYERS, TARGET_HEAD = (0, 3, 7, 12), (5, 11, 17), 1
K_SEL, M_DRAFT, GAMMA = 512, 128, 4
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def attempt(res, key, fn):
    """res[key] = fn(), or the error text: one failing variant does not lose the others."""
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001
        res[key] = f"ERROR {e!r}"[:400]
        log(f"{key} failed: {e!r}"[:400])
    return res[key]


def _ctx(positions):
    return types.SimpleNamespace(fresh=False, prompt=False, positions=positions, rows=None)


def draft_inputs(B, ctx_lengths, S, gen, n_layers=None):
    """A draft-shaped whole cache holding DRAFT_LAYERS, the Γ lookahead queries per layer and positions."""
    Hq, Hkv, D = DRAFT
    L_total = n_layers or max(DRAFT_LAYERS) + 1
    k_all = torch.randn(L_total, B, Hkv, S, D, device=DEV, generator=gen, dtype=BF) * 2
    layers = list(range(L_total - len(DRAFT_LAYERS), L_total)) if n_layers else list(DRAFT_LAYERS)
    q = torch.randn(B, len(layers), len(DRAFT_HEADS), GAMMA, D, device=DEV, generator=gen, dtype=BF)
    kvh = torch.tensor([[h // (Hq // Hkv) for h in DRAFT_HEADS]] * len(layers), dtype=torch.int32, device=DEV)
    qpos = ctx_lengths.long()[:, None] + torch.arange(GAMMA, device=DEV)[None]
    return q, k_all, torch.tensor(layers, dtype=torch.int32, device=DEV), kvh, qpos


def check_correctness(gen):
    res = {}
    B, S = 4, 4200
    L = torch.tensor([4000, 1533, 3333, 701], dtype=torch.int32, device=DEV)
    q, k_all, lay, kvh, qpos = draft_inputs(B, L, S, gen)
    want = se.attention_scores_multi_reference(q, k_all, lay, kvh, L + GAMMA, qpos,
                                               torch.zeros(B, S, device=DEV), ctx_lengths=L)
    attempt(res, "scores_draft_rel_err", lambda: rel_err(se.attention_scores_multi(
        q, k_all, lay, kvh, None, qpos, torch.full((B, S), float("nan"), device=DEV), ctx_lengths=L,
        accumulate=False), want))
    Hq, Hkv, D, _ = TARGET
    kt = torch.randn(2, B, Hkv, S, D, device=DEV, generator=gen, dtype=BF)
    qt = torch.randn(B, 2, 1, 1, D, device=DEV, generator=gen, dtype=BF)
    kvt = torch.tensor([[TARGET_HEAD // (Hq // Hkv)], [3]], dtype=torch.int32, device=DEV)
    want_t = se.attention_scores_multi_reference(qt, kt, None, kvt, L, None, torch.zeros(B, S, device=DEV))
    attempt(res, "scores_target_rel_err", lambda: rel_err(se.attention_scores_multi(
        qt, kt, None, kvt, L, None, torch.zeros(B, S, device=DEV)), want_t))
    attempt(res, "draft_estimator_rel_err", lambda: _estimator_err(q, k_all, lay, L, qpos, want))
    _check_sparse(res, gen)
    bad = [k for k, v in res.items() if not isinstance(v, float) or not v < 1e-2]
    return res, not bad


def _estimator_err(q, k_all, lay, L, qpos, want):
    """DraftLookaheadScores fed the same queries (as full-head q of the draft) through its one-launch path."""
    Hq = DRAFT[0]
    B = q.shape[0]
    est = DraftLookaheadScores(tuple(ScoreHeads(int(x), DRAFT_HEADS) for x in lay.tolist()), Hq // DRAFT[1], B,
                               k_all.shape[3], DEV, GAMMA)
    est.begin_step(qpos[:, 0])
    for t in range(GAMMA):
        for i, layer in enumerate(lay.tolist()):
            full = torch.zeros(B, Hq, 1, q.shape[-1], device=DEV, dtype=BF)
            full[:, list(DRAFT_HEADS)] = q[:, i, :, t:t + 1]
            est(layer, full, k_all[layer], _ctx(qpos[:, t:t + 1]))
    return rel_err(est.compute({x: k_all[x] for x in lay.tolist()}, L), want)


def _check_sparse(res, gen):
    Hq, Hkv, D, _ = TARGET
    B, T, S = 4, GAMMA + 1, 4200
    L = torch.tensor([4000, 1500, 3333, 700], dtype=torch.int32, device=DEV)
    q = torch.randn(B, Hq, T, D, device=DEV, generator=gen, dtype=BF)
    k, v = (torch.randn(B, Hkv, S, D, device=DEV, generator=gen, dtype=BF) for _ in range(2))
    idx = torch.rand(B, S, device=DEV, generator=gen).masked_fill(torch.arange(S, device=DEV)[None] >= L[:, None], -1)
    idx = idx.topk(K_SEL, dim=1).indices.sort(dim=1).values.to(torch.int32)
    cnt = torch.tensor([512, 300, 17, 0], dtype=torch.int32, device=DEV)
    idx_h = idx[:, None].expand(B, Hkv, K_SEL).contiguous()
    cnt_h = (cnt[:, None] - torch.arange(Hkv, device=DEV, dtype=torch.int32)[None] * 7).clamp_min(0)
    for name, (ix, cn) in (("seq", (idx, cnt)), ("per_head", (idx_h, cnt_h))):
        want = sparse_verify_attention_reference(q, k, v, L, ix, cn)
        for s in (2, 3, 4):
            def run(ix=ix, cn=cn, s=s, want=want):
                errs = [rel_err(sparse_verify_attention(q, k, v, L, ix, cn, num_splits=s, merge=True), want)
                        for _ in range(3)]  # repeated: a counter left non-zero would break the next call
                return max(errs)
            attempt(res, f"sparse_{name}_merge_kernel_s{s}_rel_err", run)


def time_setting(ctx, B, gen, timer, quick):
    Hq, Hkv, D, n_layers = TARGET
    dHq, dHkv, dD = DRAFT
    S = ctx + 64
    L = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    r = {"ctx": ctx, "B": B}
    acc = torch.zeros(B, S, device=DEV)
    # S_target: 1 head x 1 query over one layer of the target cache
    kt = torch.randn(1, B, Hkv, S, D, device=DEV, generator=gen, dtype=BF)
    qt = torch.randn(B, 1, 1, 1, D, device=DEV, generator=gen, dtype=BF)
    kvt = torch.tensor([[TARGET_HEAD // (Hq // Hkv)]], dtype=torch.int32, device=DEV)
    attempt(r, "s_target", lambda: timer(lambda: se.attention_scores_multi(qt, kt, None, kvt, L, None, acc,
                                                                           accumulate=False)))
    tgt = TargetHistoricalScores((ScoreHeads(0, (TARGET_HEAD,)),), Hq // Hkv, B, S, DEV)
    tgt._last_q[0] = torch.randn(B, 1, 1, D, device=DEV, generator=gen, dtype=BF)
    attempt(r, "s_target_compute", lambda: timer(lambda: tgt.compute({0: kt[0]}, L)))
    kt = None  # free it before the draft-shaped tensors
    # S_draft: 4 heads x Γ queries on each of 3 draft layers
    q, k_all, lay, kvh, qpos = draft_inputs(B, L, S, gen, n_layers=len(DRAFT_LAYERS))
    L_d = L + GAMMA

    def draft_per_layer():
        for i in range(q.shape[1]):
            se.attention_scores(q[:, i], k_all[i], kvh[i], L_d, qpos, acc, ctx_lengths=L)
    attempt(r, "s_draft_3calls", lambda: timer(draft_per_layer))
    attempt(r, "s_draft_one_layer", lambda: timer(lambda: se.attention_scores(
        q[:, 0], k_all[0], kvh[0], L_d, qpos, acc, ctx_lengths=L)))
    attempt(r, "s_draft_multi", lambda: timer(lambda: se.attention_scores_multi(
        q, k_all, lay, kvh, None, qpos, acc, ctx_lengths=L, accumulate=False)))
    est = DraftLookaheadScores(tuple(ScoreHeads(i, DRAFT_HEADS) for i in range(q.shape[1])), dHq // dHkv, B, S, DEV,
                               GAMMA)
    est.begin_step(qpos[:, 0])
    for t in range(GAMMA):  # the draft forwards' queries, as the observer receives them (full-head q)
        for i in range(q.shape[1]):
            full = torch.zeros(B, dHq, 1, dD, device=DEV, dtype=BF)
            full[:, list(DRAFT_HEADS)] = q[:, i, :, t:t + 1]
            est(i, full, k_all[i], _ctx(qpos[:, t:t + 1]))
    views = {i: k_all[i] for i in range(q.shape[1])}
    attempt(r, "s_draft_compute", lambda: timer(lambda: est.compute(views, L)))
    k_all = None
    st, sd = torch.rand(B, S, device=DEV, generator=gen), torch.rand(B, S, device=DEV, generator=gen)
    attempt(r, "select", lambda: timer(lambda: select_dustin(st, sd, L, k=K_SEL, m=M_DRAFT)))
    # sparse verify at the target shape
    T = GAMMA + 1
    k, v = (torch.randn(B, Hkv, S, D, device=DEV, generator=gen, dtype=BF) for _ in range(2))
    qv = torch.randn(B, Hq, T, D, device=DEV, generator=gen, dtype=BF)
    out = torch.empty_like(qv)
    idx, cnt = select_dustin(st, sd, L, k=K_SEL, m=M_DRAFT)
    for s in (1, 2, 4):
        for merge in ("launch", "kernel"):
            if s > 1 or merge == "launch":
                attempt(r, f"sparse_s{s}_{merge}", lambda s=s, merge=merge: timer(lambda: sparse_verify_attention(
                    qv, k, v, L, idx, cnt, out=out, num_splits=s, merge=merge == "kernel")))
    attempt(r, "sparse_default", lambda: timer(lambda: sparse_verify_attention(qv, k, v, L, idx, cnt, out=out)))
    _derive(r, n_layers)
    return r


def _num(r, keys):
    vals = [r[k] for k in keys if isinstance(r.get(k), float)]
    return min(vals) if vals else float("nan")


def _derive(r, n_layers):
    r["est_step_per_layer_calls"] = _num(r, ["s_target"]) + _num(r, ["s_draft_3calls"]) + _num(r, ["select"])
    r["est_step_kernels"] = _num(r, ["s_target"]) + _num(r, ["s_draft_multi"]) + _num(r, ["select"])
    r["est_step_compute"] = _num(r, ["s_target_compute"]) + _num(r, ["s_draft_compute"]) + _num(r, ["select"])
    r["sparse_best"] = _num(r, [k for k in r if k.startswith("sparse_s")])
    r["sparse_plus_est_per_layer"] = r["sparse_best"] + r["est_step_kernels"] / n_layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only 8k x 8 and 32k x 16")
    ap.add_argument("--time-budget", type=float, default=200.0, help="skip settings left after this many s")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    gen = torch.Generator(device=DEV).manual_seed(0)
    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "rows": [], "skipped": []}
    out_dir = os.environ.get("OUT")

    def save():
        if out_dir:
            with open(os.path.join(out_dir, "kernel_variants.json"), "w") as f:
                json.dump(res, f, indent=1)
    try:
        res["correctness"], res["ok"] = check_correctness(gen)
    except Exception as e:  # noqa: BLE001
        res["correctness"], res["ok"] = {"error": repr(e)[:500]}, False
    log("correctness:", json.dumps(res["correctness"]), "OK" if res["ok"] else "FAILED <<<<<<<<<<<<<<<<")
    save()
    timer = _GraphTimer()
    # the goal setting (32k x 16) first: a run cut short by --time-budget still has it
    settings = [(32768, 16), (8192, 8)] + ([] if args.quick else [(16384, 16), (32768, 8), (16384, 8), (8192, 16)])
    for ctx, B in settings:
        if time.perf_counter() - T0 > args.time_budget:
            res["skipped"].append([ctx, B])
            continue
        try:
            r = time_setting(ctx, B, gen, timer, args.quick)
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: keep the other settings)
            res["skipped"].append([ctx, B, repr(e)[:300]])
            log(f"{ctx} x {B} failed: {e!r}")
            continue
        res["rows"].append(r)
        log(f"ctx {ctx} B {B}: " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in r.items() if k not in ("ctx", "B")))
        save()
        torch.cuda.empty_cache()
    res["elapsed_s"] = time.perf_counter() - T0
    save()
    log("done", "OK" if res["ok"] else "CORRECTNESS FAILED", f"skipped {res['skipped']}")
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
