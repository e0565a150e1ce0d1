"""The interface every verification-time KV selection policy implements.

A policy decides, before each verify forward, which cached positions the target attends to: one `SparsePlan`
shared by every layer, a `LayerPlanner` that picks per layer from that layer's queries, or None for the full
cache. It may attach `QueryObserver`s to the draft's and the target's forwards to collect the attention scores
it needs (only for the heads it chooses), and it is told how many tokens each sequence accepted, after the
cache lengths advanced, so it can keep the right query for the next step.

Policies see the generation only through `StepState`, the step loop's read-only view declared here: the
selection package never imports the engine (the engine imports the policies).
"""
from __future__ import annotations

from typing import Protocol

import torch

from dustin.attention.context import LayerPlanner, LookaheadCapture, QueryObserver, SparsePlan
from dustin.cache.kv_cache import KVCache
from dustin.errors import InputError
from dustin.models.transformer import Transformer

VerifyPlan = SparsePlan | LayerPlanner | None  # what `plan` returns: one set, a per-layer planner, or full


class StepState(Protocol):
    """What a policy may read of the batch it serves (engine/worker/batch.py's BatchState implements it).
    Fixed for the batch: B, gamma, max_new_tokens (the most new tokens a row may ask), device, target/draft
    (their .args), the caches, prompts, cfg, timer (phases
    "estimate" / "select" are the policy's own). Per step: target_cache.lengths (cached positions; inside
    `after_verify` already advanced by this step), pending (each row's newest token, not cached yet; inside
    `after_verify` the one this step chose), verify_input / verify_positions (this step's [pending, drafts] and
    positions, set before `plan`: G + 1 columns, G <= gamma), row_gamma (each row's own Γ, long [B]: a row's
    drafts past it, and the draft forwards' lookahead queries past it, are not its own and must not count for
    it), done (rows that stopped), finished (host copy), sampler (the rows' sampling, and their keys for other
    draws). A non-speculative step (vanilla, or G = 0) calls `begin_step`, the target observers and `after_verify`
    too, but no `plan`."""

    B: int
    gamma: int
    max_new_tokens: int
    row_gamma: torch.Tensor
    device: torch.device
    target: Transformer
    draft: Transformer | None
    target_cache: KVCache
    draft_cache: KVCache | None
    pending: torch.Tensor
    prompts: list[list[int]]
    cfg: object
    timer: object  # start(phase) / stop(phase): engine.timing.PhaseTimer
    verify_input: torch.Tensor
    verify_positions: torch.Tensor
    done: torch.Tensor
    finished: list[bool]
    sampler: object  # engine.sampling.RowSampling: each row's sampling, and its key for other draws (`row_keys`)



def draft_query_shape(state: StepState) -> tuple[int, torch.dtype]:
    """(head_dim, dtype) of the draft's queries: the buffers of a `LookaheadCapture`."""
    return state.draft.args.head_dim, state.draft.embed_tokens.weight.dtype


class SelectionPolicy:
    name = "full"
    cfg = None  # the SparseConfig a sparse policy runs with (reported by `generate --json`); None: full verify
    observes_prefill = False  # True if target_observers must also see the prompt's last token
    # True if the policy must observe the whole prompt's prefill forward (SnapKV's observation window): the
    # Engine then never hands it a reused prefill, which re-runs only the last prompt token
    needs_own_prefill = False
    # True if the policy's per-step work (observers, plan or per-layer plans, after_verify) makes no host syncs
    # and keeps its state in fixed-address device buffers: the whole step may then be captured as one CUDA graph
    # (`StepGraph`), forwards given one `SparsePlan` may replay as per-forward graphs (a `LayerPlanner`'s verify
    # forward then runs eagerly), and the engine loop may run a step ahead of the host
    graph_safe = False
    # True if every piece of the policy's state is per sequence and built from that sequence's own prefill and
    # steps: a sequence can then join a running batch (serving slots, `Engine.generate`'s kept session)
    row_local = False
    # True if the policy verifies against the whole cache: a row's tokens then do not depend on its drafts, so it
    # may also take plain decode steps (Γ = 0, `--gamma auto`)
    full_verify = False
    # True if every plan is one `SparsePlan`: a row's plain step (Γ = 0, `--gamma auto`) can then be verified
    # against the whole cache (`SparsePlan.dense`), which no draft chooses
    dense_rows = False

    def draft_observers(self, state: StepState) -> list[QueryObserver]:
        """Observers of the draft's forwards (probes); what a policy needs of the draft's queries it asks as data,
        `draft_captures`."""
        return []

    def draft_captures(self, state: StepState) -> list[LookaheadCapture]:
        """The lookahead queries the draft step must record for this policy (`LookaheadCapture`)."""
        return []

    def target_observers(self, state: StepState) -> list[QueryObserver]:
        return []

    def begin_gang(self, state: StepState) -> None:
        """Called before a gang's prefill (a batch admitted together, engine/worker/prefill.py): a policy with state
        of the whole batch starts it over here (the rows now hold other sequences)."""

    def begin_step(self, state: StepState) -> None:
        """Called before drafting (reset per-step score buffers here)."""

    def plan(self, state: StepState) -> VerifyPlan:
        """Called after drafting, before the verify forward."""
        return None

    def after_verify(self, state: StepState, n_accepted: torch.Tensor) -> None:
        """Called with the number of accepted draft tokens per sequence (device tensor), after the cache
        lengths advanced by 1 + n_accepted for the rows still running and `pending` became the step's next token."""

    def use_auto_budget(self, rule) -> None:
        """`--budget auto` (an AutoBudget): only Dustin's policies size k from their scores."""
        raise InputError(f"--budget auto sizes Dustin's selection; {self.name!r} takes a fixed --budget")

    def budget_stats(self, reset: bool = False) -> dict | None:
        """The k this policy verified with since the last reset ({"mean", "p50", "p90", "p99", "samples", "dense"}), for
        policies whose k varies (`--budget auto`); None otherwise. Reading it waits for the device."""
        return None


class FullSelection(SelectionPolicy):
    """Classic verification over the whole cache: lossless."""

    graph_safe = row_local = full_verify = True
