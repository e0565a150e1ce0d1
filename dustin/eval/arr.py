"""Attention recovery rate (paper Eq. 1-4) of selection policies along a full-verification trajectory.

`ARRProbe` is a selection policy that verifies with the full cache (so the trajectory is classic SD's) while,
at every step, it lets each policy under test pick its set and scores the set against the true attention of the
verify window: ARR = Σ_{j∈K} Ā_j / Σ_j Ā_j over cached positions, with Ā the mean over the first w = 4 window
queries, all heads and all layers of the target. The oracle (Eq. 3) is the top-k of Ā itself.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from dustin.selection.base import SelectionPolicy
from dustin.selection.oracle import window_attention

if TYPE_CHECKING:
    from dustin.engine.session import Session


def recovery(mass: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """ARR per sequence: share of the context attention mass `mass` [B, S] held by the selected positions."""
    valid = torch.arange(indices.shape[1], device=indices.device)[None] < counts[:, None]
    picked = mass.gather(1, indices.long()) * valid
    return picked.sum(1) / mass.sum(1).clamp_min(1e-30)


class ARRProbe(SelectionPolicy):
    name = "arr-probe"

    def __init__(self, policies: dict[str, SelectionPolicy], budget: int) -> None:
        self.policies, self.budget = policies, budget
        self.observes_prefill = any(p.observes_prefill for p in policies.values())
        self.arr: dict[str, list[float]] = defaultdict(list)

    def draft_observers(self, session: "Session"):
        return [o for p in self.policies.values() for o in p.draft_observers(session)]

    def target_observers(self, session: "Session"):
        return [o for p in self.policies.values() for o in p.target_observers(session)]

    def begin_step(self, session: "Session") -> None:
        for p in self.policies.values():
            p.begin_step(session)

    def plan(self, session: "Session"):
        active = [b for b, done in enumerate(session.finished) if not done]
        mass = window_attention(session.target, session.target_cache, session.verify_input, session.verify_positions)
        top = mass.topk(min(self.budget, mass.shape[1]), dim=1)
        counts = torch.clamp(session.target_cache.lengths, max=top.indices.shape[1])
        self.arr["oracle"] += recovery(mass, top.indices, counts)[active].tolist()
        for name, p in self.policies.items():
            plan = p.plan(session)
            self.arr[name] += recovery(mass, plan.indices, plan.counts)[active].tolist()
        return None  # verify with the full cache: the trajectory is classic's

    def after_verify(self, session: "Session", n_accepted: torch.Tensor) -> None:
        for p in self.policies.values():
            p.after_verify(session, n_accepted)

    def mean_arr(self) -> dict[str, float]:
        return {name: sum(v) / max(len(v), 1) for name, v in self.arr.items()}
