"""The oracle ladder: what the best selection at each granularity can do, measured before building one.

Today's `oracle` (policies.py) is one set per sequence shared by every layer and head: the positions with the most
mean attention of a separate dense forward's verify queries. The rungs here are finer, each an exact oracle of
its own granularity, chosen inside the verify forward from each layer's own queries (the queries the layer
really has, after the sparse layers below it), at the same k positions per KV head as rung (a) reads:

- `oracle-layer` (b): one set per layer, by the layer's mean attention over its heads;
- `oracle-kv` (c): one set per layer and KV head, by the mean attention of the KV head's query heads (the set that
  keeps the most attention mass of the group);
- `oracle-head` (d): one set per query head, their union per KV head within the same k: each query head's
  positions ranked by its own attention, the union filled round-robin (every head of the group gets its
  best positions before any head gets its next ones), ties by the higher attention.
A `-dN` suffix keeps the first N layers dense (Kascade's practice is layer 0). Every rung keeps the sinks and the
recent window, as dustin's sets do, and averages the attention over the first w = 4 verify queries (Eq. 3).
Analysis only: each layer materializes its heads' attention over the whole cache.
"""
from __future__ import annotations

import torch

from dustin.attention.context import SparsePlan
from dustin.selection.base import SelectionPolicy, StepState
from dustin.selection.config import SparseConfig, oracle_rung
from dustin.selection.oracle import oracle_set, window_probs


def round_robin_scores(probs: torch.Tensor) -> torch.Tensor:
    """probs [..., G, S] (G query heads sharing a KV head) -> [..., S] scores whose top-k is the round-robin
    union of the heads' own rankings: a position scores minus its best rank over the G heads, plus half its
    highest attention (< 1, so it breaks ties between equal ranks without reordering ranks)."""
    S = probs.shape[-1]
    order = probs.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(S, device=probs.device).expand_as(order))
    return -ranks.min(dim=-2).values.float() + 0.5 * probs.max(dim=-2).values


def rung_set(probs: torch.Tensor, n_kv: int, granularity: str, lengths: torch.Tensor, k: int, sinks: int,
             window: int) -> SparsePlan:
    """One layer's oracle set from its heads' window attention probs [B, Hq, S]: [B, K] for `layer`,
    [B, Hkv, K] for `kv` and `head` (the sparse verify kernels' per-KV-head form)."""
    B, Hq, S = probs.shape
    if granularity == "layer":
        return SparsePlan(*oracle_set(probs.mean(1), lengths, k, sinks, window))
    grouped = probs.view(B, n_kv, Hq // n_kv, S)
    scores = grouped.mean(2) if granularity == "kv" else round_robin_scores(grouped)
    idx, counts = oracle_set(scores.reshape(B * n_kv, S), lengths.repeat_interleave(n_kv), k, sinks, window)
    return SparsePlan(idx.view(B, n_kv, -1), counts.view(B, n_kv))


class LadderOracle(SelectionPolicy):
    """A rung of the ladder as a `LayerPlanner`: the verify forward asks it for each layer's set."""

    def __init__(self, cfg: SparseConfig, name: str) -> None:
        self.cfg, self.name = cfg, name
        self.granularity, self.dense_layers = oracle_rung(name)

    def plan(self, state: StepState):
        return self

    def plan_layer(self, layer: int, q: torch.Tensor, ctx) -> SparsePlan | None:
        if layer < self.dense_layers:
            return None
        k_cache = ctx.cache.k[layer]
        probs = window_probs(q, k_cache, ctx.lengths, ctx.max_len)
        c = self.cfg
        return rung_set(probs, k_cache.shape[1], self.granularity, ctx.lengths, c.budget, c.sinks, c.window)
