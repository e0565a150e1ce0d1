"""GPU check and timing of the packed chunked prefill (dustin/kernels/prefill_attention.py, Session.prefill).

1. The kernel against its fp32 reference at the real pair's head layouts (bf16), and bit-equality of a row's
   output whether its prompt comes in one chunk or several, beside other rows.
2. Attention alone: the kernel vs torch SDPA (flash) on one fresh 16k prompt, 1.5B layout (TFLOP/s).
3. The engine's prefill (target + draft, random weights of the pair's shapes, bf16) over 16 prompts of 8,000-19,250
   tokens, for several per-step token budgets (`prefill_tokens`), against the whole-batch session's one-prompt-per-
   forward prefill (SDPA flash): prompt tokens/s.

    PYTHONPATH=. python3 scripts/gpu_prefill_check.py --out $OUT/prefill_check.json
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F


def _bench(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def kernel_checks() -> dict:
    from dustin.attention.context import PrefillPlan
    from dustin.kernels.prefill_attention import prefill_attention, prefill_attention_reference

    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for hq, hkv, d in ((12, 2, 128), (14, 2, 64)):
        B, S = 3, 3000
        k = torch.randn(B, hkv, S, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(B, hkv, S, d, device="cuda", generator=g, dtype=torch.bfloat16)
        chunks = [(0, 0, 1000), (2, 1777, 513), (1, 64, 1)]
        plan = PrefillPlan.build(chunks, "cuda")
        q = torch.randn(hq, 1514, d, device="cuda", generator=g, dtype=torch.bfloat16)
        err = (prefill_attention(q, k, v, plan).float() - prefill_attention_reference(q, k, v, plan).float()).abs()
        whole = prefill_attention(q[:, :1000], k, v, PrefillPlan.build([(0, 0, 1000)], "cuda"))
        parts = [prefill_attention(torch.cat([q[:, 1000:1100], q[:, a:a + n]], 1), k, v,
                                   PrefillPlan.build([(2, 0, 100), (0, a, n)], "cuda"))[:, 100:]
                 for a, n in ((0, 333), (333, 1), (334, 666))]
        out[f"{hq}x{hkv}x{d}"] = {"max_abs_err_vs_ref": float(err.max()),
                                  "chunked_bit_equal": bool(torch.equal(torch.cat(parts, 1), whole))}
    return out


def attention_timing(n=16384) -> dict:
    from dustin.attention.context import PrefillPlan
    from dustin.kernels.prefill_attention import prefill_attention

    hq, hkv, d = 12, 2, 128
    q = torch.randn(hq, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    plan = PrefillPlan.build([(0, 0, n)], "cuda")
    flops = 4 * hq * d * n * n / 2
    t_ours = _bench(lambda: prefill_attention(q, k, v, plan))
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    t_sdpa = _bench(lambda: F.scaled_dot_product_attention(q[None], kr, vr, is_causal=True))
    return {"tokens": n, "ours_ms": round(1e3 * t_ours, 3), "sdpa_ms": round(1e3 * t_sdpa, 3),
            "ours_tflops": round(flops / t_ours / 1e12, 1), "sdpa_tflops": round(flops / t_sdpa / 1e12, 1)}


def engine_prefill(budgets) -> dict:
    from dustin.bench.e2e import build_engine
    from dustin.engine.config import GenerationConfig
    from dustin.engine.session import Session, cache_capacity
    from dustin.models.args import named_config

    eng = build_engine(named_config("qwen2.5-1.5b"), named_config("qwen2.5-0.5b"), "cuda", dtype="bf16")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 150000) for _ in range(rng.randint(8000, 19250))] for _ in range(16)]
    n_tok = sum(map(len, prompts))
    cfg = GenerationConfig(method="dustin", max_new_tokens=64, stop_at_eos=False)
    res = {"prompt_tokens": n_tok}
    # the whole-batch session: one SDPA-flash prefill forward per prompt (target and draft)
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s = eng.session(prompts, cfg)
        torch.cuda.synchronize()
        res["per_prompt_sdpa_s"] = round(time.perf_counter() - t0, 3)
        del s
    res["per_prompt_sdpa_tok_per_s"] = round(n_tok / res["per_prompt_sdpa_s"])
    cap = cache_capacity([len(p) for p in prompts], [64] * 16, cfg.gamma)
    policy = eng.make_policy(cfg)
    s = Session(eng.target, eng.draft, [], cfg, eng.eos_ids, eng.vocab_limit, policy, slots=16, capacity=cap)
    for budget in budgets:
        times = []
        for _ in range(2):
            for r, p in enumerate(prompts):
                s.release(r)
                s.admit(r, p, 64)
            left = {r: len(p) for r, p in enumerate(prompts)}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while left:
                room, pieces = budget, []
                for r in sorted(left):
                    take = min(room, left[r])
                    if take:
                        pieces.append((r, take))
                        room -= take
                        left[r] -= take
                        if not left[r]:
                            del left[r]
                    if not room:
                        break
                s.prefill(pieces, pad_to=budget)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res[f"packed_{budget}_s"] = round(min(times), 3)
        res[f"packed_{budget}_tok_per_s"] = round(n_tok / min(times))
        print(budget, res[f"packed_{budget}_s"], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budgets", default="2048,4096,8192,16384")
    a = ap.parse_args()
    rep = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    rep["kernel"] = kernel_checks()
    print(rep["kernel"], flush=True)
    rep["attention_16k"] = attention_timing()
    print(rep["attention_16k"], flush=True)
    rep["engine_prefill"] = engine_prefill([int(x) for x in a.budgets.split(",")])
    print(rep["engine_prefill"], flush=True)
    with open(a.out, "w") as f:
        json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
