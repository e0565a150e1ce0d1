"""Baselines that select a different set per layer (paper Sec. 5 and appendix F):

- `quest`: pages of 16; per layer and KV head, pages are scored from per-page min/max key statistics against the
  layer's current (verify) queries; the top pages fill k; layers 0-1 stay dense (Quest's practice).
- `specattn`: per target layer, the positions the draft's corresponding layer attends to most (all of its heads,
  the Γ lookahead queries), with sinks + recent window protected.
Both act as a `LayerPlanner`: the verify forward asks them for each layer's set. Both are graph-safe: their
per-step work makes no host syncs and writes fixed-address buffers (Quest's page statistics are built at the
first step, which runs eagerly before capture), so the whole step, per-layer planning included, replays as one
CUDA graph (`StepGraph`); with one graph per forward instead, their verify forward runs eagerly.
"""
from __future__ import annotations

import torch

from dustin.attention.context import SparsePlan
from dustin.selection.base import SelectionPolicy, StepState, draft_query_shape
from dustin.selection.config import ScoreHeads, SparseConfig
from dustin.selection.estimators import DraftLookaheadScores

QUEST_DENSE_LAYERS = 2


class QuestSelection(SelectionPolicy):
    name = "quest"
    graph_safe = True

    def __init__(self, cfg: SparseConfig) -> None:
        self.cfg = cfg
        self.pages = None

    def begin_gang(self, state: StepState) -> None:
        self.pages = None  # built again from the new gang's prompts at its first step

    def plan(self, state: StepState):
        from dustin.kernels.quest import QuestPages  # lazy: Triton

        cache = state.target_cache
        if self.pages is None:  # first step: page statistics of the prompts
            a = state.target.args
            self.pages = QuestPages(a.n_layers, state.B, a.n_kv_heads, a.head_dim, cache.capacity, cache.k.dtype,
                                    state.device)
            for layer in range(a.n_layers):
                self.pages.build(layer, cache.k[layer], cache.lengths)
        return self

    def plan_layer(self, layer: int, q: torch.Tensor, ctx) -> SparsePlan | None:
        if layer < QUEST_DENSE_LAYERS:
            return None
        idx, counts = self.pages.select(layer, q, ctx.lengths, self.cfg.budget)
        return SparsePlan(idx, counts)

    def after_verify(self, state: StepState, n_accepted: torch.Tensor) -> None:
        if self.pages is None:  # before the first plan (prefill): the pages are built from the cache then
            return
        after = state.target_cache.lengths  # already advanced by this step
        before = (after - torch.where(state.done, 0, 1 + n_accepted)).to(torch.int32)
        for layer in range(state.target.args.n_layers):
            self.pages.update(layer, state.target_cache.k[layer], before, after,
                              max_new=state.gamma + 1)


class SpecAttnSelection(SelectionPolicy):
    name = "specattn"
    graph_safe = True

    def __init__(self, cfg: SparseConfig) -> None:
        self.cfg = cfg
        self.scores: DraftLookaheadScores | None = None
        self._plans: dict[int, SparsePlan] = {}

    def draft_captures(self, state: StepState):
        if self.scores is None:
            d = state.draft.args
            every = tuple(ScoreHeads(layer, tuple(range(d.n_heads))) for layer in range(d.n_layers))
            self.scores = DraftLookaheadScores(every, d.gqa_group, state.B, state.target_cache.capacity,
                                               state.device, state.gamma, *draft_query_shape(state))
        return [self.scores.capture]

    def begin_step(self, state: StepState) -> None:
        self.draft_captures(state)
        self.scores.begin_step(state.target_cache.lengths, state.row_gamma)

    def plan(self, state: StepState):
        from dustin.kernels.selection import select_dustin  # lazy: Triton

        L = state.target_cache.lengths
        state.timer.start("estimate")
        caches = {layer: state.draft_cache.k[layer] for layer in self.scores.layers}
        per_layer = self.scores.compute(caches, L, per_layer=True)
        state.timer.stop("estimate")
        state.timer.start("select")
        n_target, n_draft = state.target.args.n_layers, state.draft.args.n_layers
        by_draft: dict[int, SparsePlan] = {}
        zeros = torch.zeros_like(self.scores.scores)
        for layer in range(n_target):
            d = min(n_draft - 1, layer * n_draft // n_target)  # the draft layer at the same relative depth
            if d not in by_draft:
                idx, counts = select_dustin(zeros, per_layer[d], L, k=self.cfg.budget, m=self.cfg.free_budget,
                                            sinks=self.cfg.sinks, window=self.cfg.window)
                by_draft[d] = SparsePlan(idx, counts)
            self._plans[layer] = by_draft[d]
        state.timer.stop("select")
        return self

    def plan_layer(self, layer: int, q: torch.Tensor, ctx) -> SparsePlan | None:
        return self._plans[layer]
