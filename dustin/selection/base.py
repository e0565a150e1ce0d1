"""The interface every verification-time KV selection policy implements.

A policy decides, before each verify forward, which cached positions the target attends to (a
`SparsePlan`, or None for the full cache). It may attach `QueryObserver`s to the draft's and the target's
forwards to collect the attention scores it needs (only for the heads it chooses), and it is told how many
tokens each sequence accepted so it can keep the right query for the next step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dustin.attention.context import QueryObserver, SparsePlan

if TYPE_CHECKING:
    from dustin.engine.session import Session


class SelectionPolicy:
    name = "full"
    cfg = None  # the SparseConfig a sparse policy runs with (reported by `generate --json`); None: full verify
    observes_prefill = False  # True if target_observers must also see the prompt's last token
    # True if the policy must observe the whole prompt's prefill forward (SnapKV's observation window): the
    # Engine then never hands it a reused prefill, which re-runs only the last prompt token
    needs_own_prefill = False
    # True if the step forwards may be replayed as CUDA graphs: the plan is one `SparsePlan` (or None) and every
    # observer only writes fixed-address device buffers (no Python-side state per call)
    graph_safe = False

    def draft_observers(self, session: "Session") -> list[QueryObserver]:
        return []

    def target_observers(self, session: "Session") -> list[QueryObserver]:
        return []

    def begin_step(self, session: "Session") -> None:
        """Called before drafting (reset per-step score buffers here)."""

    def plan(self, session: "Session") -> SparsePlan | None:
        """Called after drafting, before the verify forward."""
        return None

    def after_verify(self, session: "Session", n_accepted: torch.Tensor) -> None:
        """Called with the number of accepted draft tokens per sequence (device tensor)."""


class FullSelection(SelectionPolicy):
    """Classic verification over the whole cache: lossless."""

    graph_safe = True
