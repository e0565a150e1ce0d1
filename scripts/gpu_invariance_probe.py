"""Where does a row's result depend on the other rows? A GPU probe of the engine loop's batch invariance.

One request (row 5, a 13,000-token prompt) runs through a 16-slot `Session` alone, then beside 15 other prompts
(packed prefill of request-local 2,048-token chunks into 8,192-token forwards, the server's rule; random weights
of the 1.5B + 0.5B pair's shapes, bf16). Compared bit for bit: the row's target and draft K/V after prefill, its
first token, and each decode step's tokens (greedy). Then a torch.profiler table of one packed prefill forward.

    PYTHONPATH=. python3 scripts/gpu_invariance_probe.py --out $OUT/invariance_probe.json
"""
from __future__ import annotations

import argparse
import json
import random

import torch

ROW, CHUNK, BUDGET = 5, 2048, 8192


def _schedule(left: dict[int, int], done: dict[int, int]) -> list[tuple[int, int]]:
    room, out = BUDGET, []
    for r in sorted(left):
        while left[r]:
            n = min(CHUNK - done[r] % CHUNK, left[r])
            if n > room:
                return out
            out.append((r, n))
            room -= n
            left[r] -= n
            done[r] += n
    return out


def run(eng, method: str, prompts: dict[int, list[int]], steps: int = 12, graphs: bool = True):
    from dustin.engine.config import GenerationConfig
    from dustin.engine.session import Session

    cfg = GenerationConfig(method=method, max_new_tokens=4096, stop_at_eos=False, cuda_graphs=graphs)
    policy = eng.make_policy(cfg)
    trace: list[dict] = []
    if not graphs and cfg.spec.speculative:  # record what the step's pieces gave for ROW (eager only)
        inner = policy.plan

        def recording(state):
            plan = inner(state)
            rec = {"drafts": state.verify_input[ROW].clone()}
            if plan is not None:
                rec["indices"] = plan.indices[ROW].clone()
                rec["counts"] = plan.counts[ROW].clone()
                for name in ("_target_scores", "_draft_scores"):
                    est = getattr(policy, name, None)
                    if est is not None:
                        rec[name] = est.scores[ROW].clone()
            trace.append(rec)
            return plan

        policy.plan = recording
    s = Session(eng.target, eng.draft if cfg.spec.speculative else None, [], cfg, eng.eos_ids, eng.vocab_limit,
                policy, slots=16, capacity=24576)
    for r, p in prompts.items():
        s.admit(r, p, 4096)
    left, done = {r: len(p) for r, p in prompts.items()}, {r: 0 for r in prompts}
    while any(left.values()):
        s.prefill(_schedule(left, done), pad_to=BUDGET)
    n = len(prompts[ROW])
    snap = {"target_k": s.target_cache.k[:, ROW, :, :n].clone(), "target_v": s.target_cache.v[:, ROW, :, :n].clone(),
            "pending": int(s.pending[ROW])}
    if s.draft_cache is not None:
        snap["draft_k"] = s.draft_cache.k[:, ROW, :, :n].clone()
    for _ in range(steps):
        s.step()
    snap["tokens"] = list(s.outputs[ROW])
    snap["trace"] = trace
    return snap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from dustin.bench.e2e import build_engine
    from dustin.models.args import named_config

    eng = build_engine(named_config("qwen2.5-1.5b"), named_config("qwen2.5-0.5b"), "cuda", dtype="bf16")
    rng = random.Random(0)
    burst = {r: [rng.randrange(3, 150000) for _ in range(rng.randint(8000, 19250))] for r in range(16)}
    burst[ROW] = [rng.randrange(3, 150000) for _ in range(13000)]
    res = {}
    for method, graphs in (("vanilla", True), ("dustin", True), ("magicdec", True), ("dustin", False)):
        alone = run(eng, method, {ROW: burst[ROW]}, graphs=graphs)
        both = run(eng, method, burst, graphs=graphs)
        row = {}
        ta, tb = alone.pop("trace"), both.pop("trace")
        row["trace"] = [{k: bool(torch.equal(x[k], y[k])) for k in x} for x, y in zip(ta, tb, strict=False)]
        for key in alone:
            if isinstance(alone[key], torch.Tensor):
                diff = (alone[key].float() - both[key].float()).abs()
                row[key] = {"equal": bool(torch.equal(alone[key], both[key])), "max_abs_diff": float(diff.max()),
                            "first_diff_layer": int(diff.flatten(1).amax(1).nonzero()[0]) if diff.any() else None}
            else:
                row[key] = {"equal": alone[key] == both[key]}
        row["first_token_diff"] = next((i for i, (x, y) in enumerate(zip(alone["tokens"], both["tokens"], strict=False))
                                        if x != y), None)
        res[f"{method}{'' if graphs else '_eager'}"] = row
        print(method, graphs, row, flush=True)
    # profile one packed prefill forward (target), 4 chunks of 2,048 at prefixes 0-12k
    from torch.profiler import ProfilerActivity, profile

    from dustin.engine.model_runner import ModelRunner

    runner = ModelRunner(eng.target, 4, 16384, use_graphs=False)
    chunks = [(r, 4096 * r, [rng.randrange(3, 150000) for _ in range(2048)]) for r in range(4)]
    for _ in range(2):
        runner.prefill_packed(chunks, BUDGET, 16)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.prefill_packed(chunks, BUDGET, 16)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table, flush=True)
    res["profile"] = table
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
