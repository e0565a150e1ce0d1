"""Token-equality checks that explain themselves: if two greedy outputs differ, the first divergence must sit
at a near-tie of the reference model (top-2 logit gap below `eps`), otherwise it is a real bug."""
from __future__ import annotations

import torch

NEAR_TIE_EPS = {torch.float32: 1e-4, torch.bfloat16: 0.1}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def assert_same_or_near_tie(reference: list[int], other: list[int], prompt: list[int], score_fn, eps: float):
    """`score_fn(ids) -> logits [V]` of the reference model for the next token after `ids`."""
    i = first_divergence(reference, other)
    if i is None:
        return
    if i == min(len(reference), len(other)):  # one stopped early: only legal at EOS, which both share
        raise AssertionError(f"outputs have different lengths {len(reference)} vs {len(other)} with equal prefix")
    gap = top2_gap(score_fn(prompt + reference[:i]))
    assert gap < eps, (f"outputs diverge at token {i} ({reference[i]} vs {other[i]}) where the reference's "
                       f"top-2 logit gap is {gap:.4g} >= {eps}: not a float tie, a real mismatch")
