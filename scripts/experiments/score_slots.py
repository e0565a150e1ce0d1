"""Time the importance-score estimate (dustin/kernels/score_estimation.py) at the shipped config's shapes, with a
K slot per head against a slot per KV head (`kv_slots`), over pipeline stages, warps and program counts.

    PYTHONPATH=. python3 scripts/experiments/score_slots.py [--contexts 16384,32768] [--batch 16]

Shapes (the default pair, the shipped config dustin/configs/...json): S_draft = its draft layers x 4 heads on the
0.5B's 2 KV heads x Γ = 4 lookahead queries, D 64; S_target = its target layer's 4 heads on the 1.5B's 2 KV
heads x 1 query, D 128. Each variant is checked against the fp32 reference (relative error < 1e-2) before it is
timed (us per call: CUDA-graph replay with L2 evicted before each call, dustin.bench.attention._GraphTimer), and
the bytes it must read (keys of the used KV heads up to each sequence's length) give its bandwidth. Writes
$OUT/score_slots.json when OUT is set.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import torch

from dustin.bench.attention import _GraphTimer
from dustin.kernels.score_estimation import attention_scores_multi, attention_scores_multi_reference

CONFIG = Path(__file__).resolve().parents[2] / "dustin/configs/" \
    "qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.json"
GAMMA = 4


def shapes(cfg: dict) -> dict:
    m = cfg["models"]
    out = {}
    for side, tq in (("draft", GAMMA), ("target", 1)):
        a = m[side]
        group = a["n_heads"] // a["n_kv_heads"]
        entries = cfg[side]
        out[side] = {"layers": [e["layer"] for e in entries], "kv": [[h // group for h in e["heads"]] for e in entries],
                     "L": a["n_layers"], "Hkv": a["n_kv_heads"], "D": a["head_dim"], "Tq": tq}
    return out


def inputs(s: dict, B: int, ctx: int, gen: torch.Generator):
    NL, hs = len(s["layers"]), max(len(k) for k in s["kv"])
    S = ctx + 64
    q = torch.randn(B, NL, hs, s["Tq"], s["D"], generator=gen).to("cuda", torch.bfloat16)
    k_all = torch.randn(s["L"], B, s["Hkv"], S, s["D"], generator=gen, dtype=torch.bfloat16).to("cuda")
    kvh = torch.tensor([k + [-1] * (hs - len(k)) for k in s["kv"]], dtype=torch.int32, device="cuda")
    lay = torch.tensor(s["layers"], dtype=torch.int32, device="cuda")
    lengths = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    lengths -= torch.arange(B, dtype=torch.int32, device="cuda") * 37  # ragged, as a real batch is
    qpos = (lengths.long() - s["Tq"])[:, None] + torch.arange(s["Tq"], device="cuda")[None, :]
    used = sum(len(set(k)) for k in s["kv"])
    nbytes = int(lengths.sum()) * used * s["D"] * 2 + int(lengths.sum()) * sum(len(k) for k in s["kv"]) * s["Tq"] * 8
    return q, k_all, lay, kvh, lengths, qpos, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="16384,32768")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--sides", default="draft,target", help="which estimates: draft, target")
    ap.add_argument("--quick", action="store_true", help="only the default and the slot-per-head 2-stage launch")
    args = ap.parse_args()
    timer, gen, rows = _GraphTimer(n=20, reps=5), torch.Generator().manual_seed(0), []
    out = os.environ.get("OUT")
    variants = [dict(kv_slots=s, num_stages=st, num_warps=w) for s in (False, True) for st in (2, 3, 4)
                for w in (4, 8)]
    variants += [dict(kv_slots=True, num_stages=3, num_warps=4, num_programs=p) for p in (4, 8, 16)]
    if args.quick:
        variants = [{}, dict(kv_slots=False, num_stages=2), dict(kv_slots=True, num_stages=2),
                    dict(kv_slots=True, num_stages=3)]
    for side, s in shapes(json.loads(CONFIG.read_text())).items():
        if side not in args.sides.split(","):
            continue
        for ctx in map(int, args.contexts.split(",")):
            rows += sweep(side, s, ctx, args.batch, variants, timer, gen, out, rows)
            torch.cuda.empty_cache()


def sweep(side, s, ctx, batch, variants, timer, gen, out, done) -> list[dict]:
    """Check and time each variant at one shape; rows printed and saved (with `done`) as they come."""
    q, k_all, lay, kvh, lengths, qpos, nbytes = inputs(s, batch, ctx, gen)
    want = attention_scores_multi_reference(q.float(), k_all.float(), lay, kvh, lengths, qpos,
                                            torch.zeros(batch, k_all.shape[3], device="cuda"))
    rows = []
    for v in variants:
        res = torch.zeros(batch, k_all.shape[3], device="cuda")
        call = functools.partial(attention_scores_multi, q, k_all, lay, kvh, lengths, qpos, res, accumulate=False,
                                 **v)
        row = {"side": side, "context": ctx, "batch": batch, **v}
        try:
            call()
            row["rel_err"] = ((res - want).norm() / want.norm()).item()
            if row["rel_err"] < 1e-2:
                row["us"] = timer(call)
                row["TBps"] = nbytes / row["us"] / 1e6
        except Exception as e:  # one failing variant (e.g. out of shared memory) must not end the sweep
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            Path(out, "score_slots.json").write_text(json.dumps(done + rows, indent=1))
    return rows

if __name__ == "__main__":
    main()
