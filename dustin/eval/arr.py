"""Attention recovery rate (paper Eq. 1-4) of selection policies along a full-verification trajectory.

Definition used everywhere in dustin (the probe below, the profiling search, the docs): at a step whose cache
holds L positions, the verify window's first w = 4 queries sit at L .. L+3; Ā_j is their attention on cached
position j < L, averaged over the w queries and over a head set H (every head of every target layer here; the
SRHs of every layer in `dustin profile`). Each query's attention is normalized over everything it sees (the
cache plus the window tokens before it), as the model computes it. Then, for a selected set K,

    ARR(K) = Σ_{j ∈ K} Ā_j / Σ_{j < L} Ā_j

i.e. Eq. 1-2 with A renormalized over the cached positions 𝒱 = {j < L} (the window tokens are always
attended, so no policy chooses them). Two reference sets (selection/oracle.py): `oracle-topk`, the top-k of Ā
(Eq. 3: the upper bound), and `oracle`, sinks + window + top of Ā (the `--method oracle` policy's set).

`ARRProbe` is a selection policy that verifies with the full cache (so the trajectory is classic SD's) while,
at every step, it lets each policy under test pick its set and scores it against the true Ā.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from dustin.attention.context import SparsePlan
from dustin.selection.base import SelectionPolicy, StepState
from dustin.selection.oracle import oracle_set, topk_set, window_attention


def recovery(mass: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """ARR per sequence: share of the context attention mass `mass` [B, S] held by the selected positions."""
    valid = torch.arange(indices.shape[1], device=indices.device)[None] < counts[:, None]
    picked = mass.gather(1, indices.long()) * valid
    return picked.sum(1) / mass.sum(1).clamp_min(1e-30)


class ARRProbe(SelectionPolicy):
    name = "arr-probe"

    def __init__(self, policies: dict[str, SelectionPolicy], budget: int, sinks: int = 4, window: int = 16) -> None:
        self.policies, self.budget, self.sinks, self.window = policies, budget, sinks, window
        self.observes_prefill = any(p.observes_prefill for p in policies.values())
        self.arr: dict[str, list[float]] = defaultdict(list)

    def draft_observers(self, state: StepState):
        return [o for p in self.policies.values() for o in p.draft_observers(state)]

    def draft_captures(self, state: StepState):
        return [c for p in self.policies.values() for c in p.draft_captures(state)]

    def target_observers(self, state: StepState):
        return [o for p in self.policies.values() for o in p.target_observers(state)]

    def begin_gang(self, state: StepState) -> None:
        for p in self.policies.values():
            p.begin_gang(state)

    def begin_step(self, state: StepState) -> None:
        for p in self.policies.values():
            p.begin_step(state)

    def plan(self, state: StepState):
        active = [b for b, done in enumerate(state.finished) if not done]
        mass = window_attention(state.target, state.target_cache, state.verify_input, state.verify_positions)
        L = state.target_cache.lengths
        for name, (idx, counts) in (("oracle-topk", topk_set(mass, L, self.budget)),
                                    ("oracle", oracle_set(mass, L, self.budget, self.sinks, self.window))):
            self.arr[name] += recovery(mass, idx, counts)[active].tolist()
        for name, p in self.policies.items():
            plan = p.plan(state)
            if isinstance(plan, SparsePlan):  # one set for all layers: ARR is defined (Eq. 3)
                self.arr[name] += recovery(mass, plan.indices, plan.counts)[active].tolist()
            else:  # a per-layer planner (quest, specattn, snapkv): no single set to score
                self.arr.setdefault(name, [])
        # verify with the full cache: the trajectory is classic's

    def after_verify(self, state: StepState, n_accepted: torch.Tensor) -> None:
        for p in self.policies.values():
            p.after_verify(state, n_accepted)

    def mean_arr(self) -> dict[str, float | None]:
        """Mean ARR per method; None for per-layer planners, whose sets differ by layer."""
        return {name: (sum(v) / len(v) if v else None) for name, v in self.arr.items()}
