"""Sparse-verification selection with a tensor-parallel target: every rank must attend to the same index sets.

Design (dustin, dustin-t, dustin-d):
- S_draft comes from the draft, which is replicated, so every rank computes the same row with no communication.
- S_target (Eq. 5) is a sum over the configured target (layer, head) pairs. A configured query head h lives on
  rank h // (H / world), next to its KV head, so each rank scores only the configured heads it owns (local index
  h - rank * H/world) into a partial [B, S_cap] row, and one all_reduce(SUM) gives every rank the full S_target.
- The selection kernel then runs on every rank over identical inputs; as a safety net the final SparsePlan
  (indices, counts) is broadcast from rank 0, so the index sets are identical even if a backend's all_reduce
  were not bitwise identical across ranks.
- A sampled tail (the config's tail_share) is drawn by each rank for its own KV heads from that broadcast set, keyed
  by their global indices: the positions a single device draws for them.
Sparse configs name global head indices and are validated/defaulted against the unsharded shape (the Engine
does that with `TensorParallel.full_args`), so a run with and without TP picks the same heads.
`streaming` needs no scores (lengths only) and works unchanged. `quest`, `specattn`, `snapkv` and `oracle` are not
supported under TP (they read every target head) and raise an InputError.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dustin.attention.context import SparsePlan
from dustin.errors import InputError
from dustin.selection.base import StepState
from dustin.selection.config import DUSTIN_POLICIES, ScoreHeads
from dustin.selection.estimators import TargetHistoricalScores
from dustin.selection.policies import DustinSelection
from dustin.selection.registry import make_policy

TP_POLICIES = ("full", "streaming", *DUSTIN_POLICIES)


def local_score_heads(heads: tuple[ScoreHeads, ...], rank: int, heads_per_rank: int) -> tuple[ScoreHeads, ...]:
    """The configured (layer, global heads) owned by `rank`, as local head indices (layers with none dropped)."""
    lo, hi = rank * heads_per_rank, (rank + 1) * heads_per_rank
    out = []
    for sh in heads:
        mine = tuple(h - lo for h in sh.heads if lo <= h < hi)
        if mine:
            out.append(ScoreHeads(sh.layer, mine))
    return tuple(out)


class TPTargetHistoricalScores(TargetHistoricalScores):
    """S_target from this rank's share of the configured heads, summed over ranks."""

    def __init__(self, heads, group: int, batch: int, capacity: int, device, rank: int, heads_per_rank: int,
                 pg=None) -> None:
        super().__init__(local_score_heads(heads, rank, heads_per_rank), group, batch, capacity, device)
        self.pg = pg

    @torch.inference_mode()
    def compute(self, k_caches, lengths: torch.Tensor) -> torch.Tensor:
        scores = super().compute(k_caches, lengths)  # partial: this rank's heads only (zeros if it owns none)
        dist.all_reduce(scores, op=dist.ReduceOp.SUM, group=self.pg)
        return scores


class TPDustinSelection(DustinSelection):
    """DustinSelection whose S_target sums this rank's configured heads over ranks, and whose plan is
    broadcast from rank 0."""

    def __init__(self, cfg, variant: str, rank: int, group=None) -> None:
        super().__init__(cfg, variant)
        self.rank, self.group = rank, group

    def _make_target_scores(self, state: StepState) -> TargetHistoricalScores:
        a = state.target.args  # per-rank shape: n_heads is the heads per rank
        return TPTargetHistoricalScores(self.cfg.target, a.gqa_group, state.B, state.target_cache.capacity,
                                        state.device, self.rank, a.n_heads, self.group)

    def _exact_plan(self, state: StepState) -> SparsePlan:
        return broadcast_plan(super()._exact_plan(state), self.group)

    def _kv_heads(self, state: StepState) -> tuple[int, int]:
        """A sampled tail is drawn by each rank for its own KV heads, from rank 0's exact set: the positions a
        single device would draw for those heads, with no more to broadcast."""
        n_kv = state.target.args.n_kv_heads  # this rank's
        return self.rank * n_kv, n_kv * dist.get_world_size(self.group)


def broadcast_plan(plan: SparsePlan, group=None) -> SparsePlan:
    """Rank 0's plan on every rank of `group`: its indices, counts, dense rows and log-weights, all of them (a rank
    that verified against other positions, or weighted them otherwise, would compute another model's output)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    indices, counts = plan.indices.contiguous(), plan.counts.contiguous()
    dist.broadcast(indices, src, group=group)
    dist.broadcast(counts, src, group=group)
    dense = bias = None
    if plan.dense is not None:  # gloo broadcasts no bool tensors: as uint8
        flags = plan.dense.to(torch.uint8)
        dist.broadcast(flags, src, group=group)
        dense = flags.bool()
    if plan.bias is not None:  # a sampled tail's log-weights: every rank must weight the same positions alike
        bias = plan.bias.contiguous()
        dist.broadcast(bias, src, group=group)
    return SparsePlan(indices, counts, dense, bias)


def tp_policy(name: str, cfg, rank: int, group=None):
    """The TP form of selection policy `name` (cfg: the sparse config in global heads, None for "full")."""
    if name not in TP_POLICIES:
        raise InputError(f"policy {name!r} is not supported with tensor parallelism; supported policies: "
                         f"{', '.join(TP_POLICIES)}")
    if name in ("full", "streaming"):
        return make_policy(name, cfg)
    return TPDustinSelection(cfg, name, rank, group)
