"""Does verifying against spans around the score peaks, instead of single top-k positions, keep multi-value answers?

    python3 scripts/experiments/span_selection.py [--tasks niah_multivalue,niah_multiquery] [--context 4096]
        [--samples 20] [--budget 128] [--radii 0,4,8] [--batch-size 20] [--device cpu]

Why: on RULER at 64k (docs/accuracy.md) the default (k = 512) loses most on niah_multivalue (77.5 -> 61.3) and
niah_multiquery (97.5 -> 80.0), and its wrong answers look alike: the first one or two values are right, the later
ones are cut short or spliced from two needles ("3512232" for 3,511,667 and 1,312,232). A value is 7 digit tokens
and the key naming it sits just before it; a set of single top-scored positions may hold some digits of several
needles without the words that tell them apart. Here the same estimated scores (S_target and S_draft, the shipped
config) are max-pooled over +-r positions before the same selection (`select_dustin`), so a peak pulls its
neighbours in: a set of spans at the same k. r = 0 is the shipped policy. Every row answers the same prompts over
one shared prefill; scores are the tasks' own metric, with the paired difference to r = 0 and to vanilla.
Writes $OUT/span_selection.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dustin.engine.engine import Engine  # noqa: E402
from dustin.engine.session import PrefillCache  # noqa: E402
from dustin.eval.stats import mean_interval, paired_difference_interval  # noqa: E402
from dustin.eval.sweep import row_config  # noqa: E402
from dustin.selection.policies import DustinSelection, _select  # noqa: E402
from dustin.tasks.catalog import build_samples, get_tasks  # noqa: E402


class SpanSelection(DustinSelection):
    """The shipped hybrid selection over scores max-pooled across +-radius positions."""

    def __init__(self, cfg, radius: int) -> None:
        super().__init__(cfg, "dustin")
        self.radius = radius

    def _pool(self, s: torch.Tensor) -> torch.Tensor:
        if self.radius == 0:
            return s
        return F.max_pool1d(s[:, None], 2 * self.radius + 1, stride=1, padding=self.radius)[:, 0]

    def plan(self, state):
        L = state.target_cache.lengths
        s_target = s_draft = self._zeros
        if self._target_scores is not None:
            caches = {layer: state.target_cache.k[layer] for layer in self._target_scores.layers}
            s_target = self._pool(self._target_scores.compute(caches, L))
        if self._draft_scores is not None:
            caches = {layer: state.draft_cache.k[layer] for layer in self._draft_scores.layers}
            s_draft = self._pool(self._draft_scores.compute(caches, L))
        return _select(s_target, s_draft, L, self.cfg, self.m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="niah_multivalue,niah_multiquery")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--radii", default="0,4,8")
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rope-scaling", default=None)
    ap.add_argument("--gamma", type=int, default=4)
    args = ap.parse_args()
    args.draft_window, args.config, args.seed = 512, None, 0
    engine = Engine.from_pretrained("default", "default", device=args.device, rope_scaling=args.rope_scaling)
    tasks = get_tasks(args.tasks)
    by_name = {t.name: t for t in tasks}
    t0 = time.perf_counter()
    samples = build_samples(tasks, engine.tokenizer, args.context, args.samples, 0)
    print(f"{len(samples)} samples built in {time.perf_counter() - t0:.0f} s", flush=True)
    radii = [int(r) for r in args.radii.split(",")]
    rows = ["vanilla"] + [f"span{r}" for r in radii]
    scores: dict[str, dict[tuple, float]] = {r: {} for r in rows}
    preds: dict[str, dict[str, str]] = {r: {} for r in rows}
    for i in range(0, len(samples), args.batch_size):
        batch = samples[i:i + args.batch_size]
        shared = PrefillCache()
        limits = [s.max_new_tokens for s in batch]
        for row in rows:
            t0 = time.perf_counter()
            if row == "vanilla":
                cfg, policy = row_config("vanilla", None, args, max(limits)), None
            else:
                cfg = row_config("dustin", args.budget, args, max(limits))
                policy = SpanSelection(engine.make_policy(cfg).cfg, int(row[4:]))
            r = engine.generate([s.prompt_ids for s in batch], cfg, policy=policy, prefill_cache=shared,
                                limits=limits)
            for s, seq in zip(batch, r.sequences, strict=True):
                scores[row][(s.task, s.index)] = by_name[s.task].score(seq.text or "", s.references)
                preds[row][f"{s.task}/{s.index}"] = seq.text
            print(f"batch {i // args.batch_size}: {row} {time.perf_counter() - t0:.0f} s"
                  + (f", tau {r.tau:.2f}" if row != "vanilla" else ""), flush=True)
    keys = sorted(scores["vanilla"])
    report = {"settings": vars(args), "rows": {}}
    for row in rows:
        per_task = {t.name: [scores[row][k] for k in keys if k[0] == t.name] for t in tasks}
        entry = {"mean": 100 * sum(scores[row][k] for k in keys) / len(keys),
                 "ci": [100 * x for x in mean_interval([scores[row][k] for k in keys])],
                 "per_task": {t: 100 * sum(v) / len(v) for t, v in per_task.items()}}
        for ref in ("vanilla", "span0"):
            if row != ref:
                pairs = [([scores[row][k] for k in keys if k[0] == t.name],
                          [scores[ref][k] for k in keys if k[0] == t.name]) for t in tasks]
                lo, hi = paired_difference_interval(pairs)
                diff = sum(sum(a) / len(a) - sum(b) / len(b) for a, b in pairs) / len(pairs)
                entry[f"vs_{ref}"] = [round(100 * diff, 1), round(100 * lo, 1), round(100 * hi, 1)]
        report["rows"][row] = entry
        print(row, json.dumps(entry), flush=True)
    report["predictions"] = preds
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "span_selection.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
