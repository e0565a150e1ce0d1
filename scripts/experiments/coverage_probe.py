"""Experiment: is the loss that no k recovers (RULER fwe, niah_multikey_3) visible in Dustin's own estimate?

The 20-sample RULER run (docs/accuracy.md) lost ~2-3 points to vanilla at every k from 1024 to 4096 and with the
oracle set too, nearly all of it on fwe (the most frequent words of the whole context) and niah_multikey_3. If
the estimated attention mass of those rows is spread out, a rule could send such (row, step) pairs to full
verification. This probe measures, per task, the share of the estimated mass (S_target and S_draft, normalised
and averaged as `--budget auto` does) that the top n positions hold, for n = the free budget at k_max, and how
each task's greedy answer compares with vanilla's. It wraps `adaptive_budgets` to read the scores each step sees.

    PYTHONPATH=. python3 scripts/experiments/coverage_probe.py --context 4096 --samples 4 --k-max 512

First result (2026-12-01, our 2-core CPU, bf16, the real pair, 4 samples per task at 4k, k_max 512: 12% of the
context; cwe not reached): share of the estimated mass the top 492 positions hold, mean / 10th percentile over
(row, step), and the score of vanilla / dustin k = 512 / auto p = 0.95:
    fwe              0.80 / 0.66   0.67 / 0.50 / 0.50
    niah_multikey_3  0.85 / 0.78   0.75 / 0.75 / 0.75
    niah_single_1    0.88 / 0.86   1.00 / 1.00 / 1.00
The task that loses has the most spread-out estimate, but the separation is modest (a coverage threshold near 0.7
would catch fwe's low tail without the needle tasks); whether full verification for such steps recovers fwe at
16k-32k is for a GPU run.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import dustin.selection.policies as policies
from dustin.engine.config import GenerationConfig
from dustin.engine.engine import Engine
from dustin.engine.session import PrefillCache
from dustin.selection.adaptive import _normalised
from dustin.tasks.catalog import get_tasks

TASKS = "fwe,niah_multikey_3,niah_single_1,cwe"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--k-max", type=int, default=512)
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    seen: list[torch.Tensor] = []
    original = policies.adaptive_budgets

    def spy(s_target, s_draft, lengths, rule, *, sinks, window, m_share):
        ref = s_target if s_target is not None else s_draft
        S = ref.shape[1]
        L = lengths.to(ref.device).long()[:, None]
        j = torch.arange(S, device=ref.device)[None, :]
        pickable = (j >= sinks) & (j < L - window)
        parts = [_normalised(s, pickable) for s in (s_target, s_draft) if s is not None]
        mass = parts[0] if len(parts) == 1 else (parts[0] + parts[1]) / 2
        n = max(rule.k_max - sinks - window, 1)
        seen.append(mass.topk(min(n, S), dim=-1).values.sum(-1).float().cpu())  # of a total of 1 per row
        return original(s_target, s_draft, lengths, rule, sinks=sinks, window=window, m_share=m_share)

    policies.adaptive_budgets = spy
    engine = Engine.from_pretrained("default", "default", device=a.device, dtype=a.dtype)
    report = {}
    for task in get_tasks(a.tasks):
        samples = task.samples(engine.tokenizer, a.context, a.samples, 0)
        ids = [s.prompt_ids for s in samples]
        limit = max(s.max_new_tokens for s in samples)
        scores, shared = {}, PrefillCache()  # one prefill for the three rows
        for name, cfg in (("vanilla", GenerationConfig(method="vanilla", max_new_tokens=limit)),
                          ("dustin", GenerationConfig(method="dustin", max_new_tokens=limit, budget=a.k_max)),
                          ("auto", GenerationConfig(method="dustin", max_new_tokens=limit, budget="auto",
                                                    budget_p=0.95, budget_min=128, budget_max=a.k_max))):
            seen.clear()
            r = engine.generate(ids, cfg, prefill_cache=shared)
            scores[name] = statistics.mean(task.score(q.text or "", s.references) for q, s in zip(r.sequences, samples,
                                                                                                   strict=True))
            if name == "auto":
                cov = torch.cat(seen) if seen else torch.zeros(1)
        report[task.name] = {"scores": scores, "coverage_mean": round(float(cov.mean()), 3),
                             "coverage_p10": round(float(cov.quantile(0.1)), 3), "steps": int(cov.numel())}
        print(task.name, json.dumps(report[task.name]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"settings": vars(a), "tasks": report}, f, indent=1)


if __name__ == "__main__":
    main()
