"""Confidence intervals for task scores: how much a score over n samples can be trusted.

A score is a mean over samples, each scored in [0, 1]. With 0/1 scores (exact-match tasks) the 95% interval is
Wilson's score interval, which stays inside [0, 1] and is sensible at n = 4 and at 0% or 100% (the normal
approximation gives zero width there). With graded scores (recall of several values, edit similarity) it is a
percentile bootstrap over the samples, seeded so that a report is reproducible. The average over tasks gets a
bootstrap interval too, resampling each task's samples independently (the tasks are fixed, the samples drawn).
"""
from __future__ import annotations

import math
import random

Z95 = 1.959963984540054


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (successes out of n)."""
    if n < 1:
        raise ValueError("wilson needs n >= 1")
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def _percentiles(xs: list[float], alpha: float) -> tuple[float, float]:
    xs = sorted(xs)
    lo = xs[int(math.floor(alpha / 2 * (len(xs) - 1)))]
    hi = xs[int(math.ceil((1 - alpha / 2) * (len(xs) - 1)))]
    return lo, hi


def bootstrap_mean(values: list[float], n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
                   ) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values`."""
    if not values:
        raise ValueError("bootstrap_mean needs at least one value")
    rng = random.Random(seed)
    n = len(values)
    means = [sum(rng.choice(values) for _ in range(n)) / n for _ in range(n_boot)]
    return _percentiles(means, alpha)


def mean_interval(values: list[float], seed: int = 0) -> tuple[float, float]:
    """95% interval of a task's mean score: Wilson for 0/1 scores, else a bootstrap."""
    if all(v in (0.0, 1.0) for v in values):
        return wilson(sum(values), len(values))
    return bootstrap_mean(values, seed=seed)


def average_interval(groups: list[list[float]], n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
                     ) -> tuple[float, float]:
    """95% bootstrap interval of the average over tasks of each task's mean (each task resampled on its own)."""
    if not groups or any(not g for g in groups):
        raise ValueError("average_interval needs at least one sample per task")
    rng = random.Random(seed)
    avgs = []
    for _ in range(n_boot):
        avgs.append(sum(sum(rng.choice(g) for _ in range(len(g))) / len(g) for g in groups) / len(groups))
    return _percentiles(avgs, alpha)


def paired_difference_interval(pairs: list[tuple[list[float], list[float]]], n_boot: int = 2000, seed: int = 0,
                               alpha: float = 0.05) -> tuple[float, float]:
    """95% bootstrap interval of avg_task(mean(a) - mean(b)) where, per task, a[i] and b[i] are two methods'
    scores on the same sample i: the average interval of the per-sample differences, so each task's samples are
    resampled as pairs, the shared difficulty of a sample cancels and the interval is much narrower than two
    unpaired intervals compared."""
    if not pairs or any(len(a) != len(b) or not a for a, b in pairs):
        raise ValueError("paired_difference_interval needs equal-length, non-empty score lists per task")
    return average_interval([[x - y for x, y in zip(a, b, strict=True)] for a, b in pairs], n_boot, seed, alpha)
