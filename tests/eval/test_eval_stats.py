"""Intervals of task scores (dustin/eval/stats.py) against values computed by hand."""
from __future__ import annotations

import math

import pytest

from dustin.eval.stats import average_interval, bootstrap_mean, mean_interval, wilson


def test_wilson_by_hand():
    # 8 of 10: center (0.8 + z^2/20) / (1 + z^2/10), half z / (1 + z^2/10) * sqrt(0.016 + z^2/400)
    z = 1.959963984540054
    denom = 1 + z * z / 10
    center, half = (0.8 + z * z / 20) / denom, z / denom * math.sqrt(0.016 + z * z / 400)
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(center - half) and hi == pytest.approx(center + half)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson(0, 20)[0] == 0.0 and 0.16 < wilson(0, 20)[1] < 0.17  # 0%: not a zero-width interval
    assert wilson(20, 20)[1] == 1.0
    with pytest.raises(ValueError):
        wilson(0, 0)


def test_mean_interval_picks_wilson_for_exact_match_and_bootstrap_for_graded():
    assert mean_interval([1.0] * 8 + [0.0] * 2) == wilson(8, 10)
    graded = [0.5, 1.0, 0.25, 0.75, 1.0, 0.0, 0.5, 0.5]
    lo, hi = mean_interval(graded)
    assert lo < sum(graded) / len(graded) < hi and 0 <= lo and hi <= 1
    assert (lo, hi) == bootstrap_mean(graded)  # seeded: reproducible
    assert bootstrap_mean([0.3] * 5) == (0.3, 0.3)


def test_interval_narrows_with_more_samples():
    small = bootstrap_mean([0.0, 1.0] * 5)
    large = bootstrap_mean([0.0, 1.0] * 100)
    assert large[1] - large[0] < (small[1] - small[0]) / 3  # width ~ 1/sqrt(n): 10x the samples, ~3.2x narrower


def test_average_interval_covers_the_average():
    groups = [[1.0, 0.0, 1.0, 1.0], [0.5, 0.25, 0.75, 0.5], [0.0, 0.0, 1.0, 0.0]]
    avg = sum(sum(g) / len(g) for g in groups) / len(groups)
    lo, hi = average_interval(groups)
    assert lo < avg < hi and hi - lo < 0.5
    with pytest.raises(ValueError):
        average_interval([[1.0], []])
