"""Verification-time KV selection policies (paper Sec. 4.1 and baselines), all behind `SelectionPolicy`.

- `streaming`: 4 sinks + the most recent k - 4 positions (StreamingLLM applied to the target).
- `dustin`:   Eq. 6: sinks + window protected, top-m by S_draft, the rest by S_target.
- `dustin-t`: m = 0 (target-historical only); `dustin-d`: the whole unprotected budget from S_draft.
- `oracle`:   top-k of the true mean attention of the verify window over all target heads and layers (Eq. 3);
              it runs a full-cache forward first, so it is for analysis only.
The registry of every policy by name is `registry.py`. Per-layer baselines live in `layerwise.py` (`quest`,
`specattn`) and `snapkv.py` (`snapkv`: SnapKV's prompt-time set per layer and KV head, fixed after prefill, plus
every generated position); `tail.py` the sampled-tail rows (`oracle-layer-tail*`, `oracle-dustin-tail*`: an exact
set plus a uniform, reweighted sample of the rest).
One index set per sequence is shared by all layers and heads. Every policy keeps the full cache: accepted
tokens are appended and nothing is evicted, so any position can be selected at a later step.
"""
from __future__ import annotations

import torch

from dustin.attention.context import SparsePlan
from dustin.errors import InputError
from dustin.kernels.selection import select_dustin, select_streaming
from dustin.selection.adaptive import BudgetHistogram, adaptive_budgets, select_ragged
from dustin.selection.base import SelectionPolicy, StepState, draft_query_shape
from dustin.selection.config import AutoBudget, SparseConfig
from dustin.selection.estimators import DraftLookahead, DraftLookaheadScores, TargetHistoricalScores
from dustin.selection.oracle import oracle_set, window_attention
from dustin.selection.stratified import GREEDY_KEY, stratified_tail


def _select(s_target, s_draft, lengths, cfg: SparseConfig, m: int) -> SparsePlan:
    idx, counts = select_dustin(s_target, s_draft, lengths, k=cfg.budget, m=m, sinks=cfg.sinks, window=cfg.window)
    return SparsePlan(idx, counts)


class StreamingSelection(SelectionPolicy):
    name = "streaming"
    graph_safe = row_local = True  # no observers; the plan depends on the lengths only
    dense_rows = True

    def __init__(self, cfg: SparseConfig) -> None:
        self.cfg = cfg

    def plan(self, state: StepState) -> SparsePlan:
        idx, counts = select_streaming(state.target_cache.lengths, self.cfg.budget, self.cfg.sinks)
        return SparsePlan(idx, counts)


class DustinSelection(DraftLookahead, SelectionPolicy):
    """Hybrid draft-lookahead + target-historical selection. variant: "dustin" | "dustin-t" | "dustin-d"."""

    graph_safe = True  # both estimators only write fixed-address buffers; one SparsePlan per step
    dense_rows = True
    row_local = True  # score rows and queries are per sequence; a row's prefill sets its S_target query

    def __init__(self, cfg: SparseConfig, variant: str = "dustin", name: str | None = None) -> None:
        self.cfg, self.name = cfg, name or variant
        # with a sampled tail (cfg.tail_share), Eq. 6 picks the exact part of the budget and each layer draws the
        # rest (`stratified_tail`); without one, the exact part is the whole config
        self.sampled = cfg.tail_split()[1]  # positions sampled per layer and KV head (0: no tail)
        cfg = cfg.exact_part()
        self.exact_cfg = cfg
        source = cfg.source or "the sparse config"
        if variant in ("dustin", "dustin-t") and not cfg.target and (variant == "dustin-t" or not cfg.draft):
            raise InputError(f"{source} has no target score heads, which {variant} needs")
        if variant == "dustin-d" and not cfg.draft:
            raise InputError(f"{source} has no draft score heads, which dustin-d needs")
        # A source with no heads must not fill slots from an all-zero row (arbitrary positions): with only
        # target heads dustin is dustin-t (m = 0), with only draft heads dustin-d (m = the free budget).
        m = cfg.draft_topm if cfg.draft else 0
        m = m if cfg.target else cfg.free_budget
        self.m = {"dustin": m, "dustin-t": 0, "dustin-d": cfg.free_budget}[variant]
        self.uses_draft = self.m > 0 and bool(cfg.draft)
        self.uses_target = self.m < cfg.free_budget and bool(cfg.target)
        self.observes_prefill = self.uses_target  # S_target of step 1 needs the last prompt token's query
        self._draft_scores: DraftLookaheadScores | None = None
        self._target_scores: TargetHistoricalScores | None = None
        self.auto: AutoBudget | None = None  # --budget auto: k per row and step from the scores
        self._k_hist: BudgetHistogram | None = None

    def use_auto_budget(self, rule: AutoBudget) -> None:
        """Size k per sequence and step by `rule` (dustin/selection/adaptive.py); the config's budget is k_max."""
        if self.sampled:
            raise InputError("--budget auto sizes an exact set; it takes no sampled tail (set tail_share to 0)")
        if rule.k_max != self.cfg.budget:
            raise ValueError(f"the config's budget ({self.cfg.budget}) must be the rule's k_max ({rule.k_max})")
        self.auto = rule

    def budget_stats(self, reset: bool = False) -> dict | None:
        return None if self._k_hist is None else self._k_hist.report(reset)

    def _setup(self, state: StepState) -> None:
        if self._target_scores is not None or self._draft_scores is not None:
            return
        B, cap, dev = state.B, state.target_cache.capacity, state.device
        if self.uses_target:
            self._target_scores = self._make_target_scores(state)
        if self.uses_draft:
            self._draft_scores = DraftLookaheadScores(self.cfg.draft, state.draft.args.gqa_group, B, cap, dev,
                                                      state.gamma, *draft_query_shape(state))
        self._zeros = torch.zeros(B, cap, dtype=torch.float32, device=dev)
        if self.auto is not None:
            self._k_hist = BudgetHistogram(self.auto.k_max, dev)

    @property
    def target_scores(self) -> TargetHistoricalScores | None:
        """S_target's estimator, set up by the first step (None before it, or for a variant without S_target):
        its scores can be read back and checked after a step."""
        return self._target_scores

    def _make_target_scores(self, state: StepState) -> TargetHistoricalScores:
        """S_target's estimator (tensor parallelism overrides it: each rank scores its own heads)."""
        return TargetHistoricalScores(self.cfg.target, state.target.args.gqa_group, state.B,
                                      state.target_cache.capacity, state.device)

    def target_observers(self, state: StepState):
        self._setup(state)
        return [self._target_scores] if self._target_scores is not None else []

    def plan(self, state: StepState) -> SparsePlan:
        plan = self._exact_plan(state)
        if not self.sampled:
            return plan
        state.timer.start("select")
        a = state.target.args
        offset, total = self._kv_heads(state)
        plan = stratified_tail(plan, state.sampler.row_keys(GREEDY_KEY), state.target_cache.lengths, a.n_layers,
                               a.n_kv_heads, self.sampled, offset, total)
        state.timer.stop("select")
        return plan

    def _kv_heads(self, state: StepState) -> tuple[int, int]:
        """(the first of this device's KV heads, KV heads in all): each draws its tail keyed by its global index."""
        return 0, state.target.args.n_kv_heads

    def _exact_plan(self, state: StepState) -> SparsePlan:
        """Eq. 6's set at the exact part of the budget, one per row, shared by every layer and head."""
        self._setup(state)  # a plain step (Γ = 0) plans before any draft forward asked for its captures
        L = state.target_cache.lengths
        s_target = s_draft = self._zeros
        state.timer.start("estimate")
        if self._target_scores is not None:
            caches = {layer: state.target_cache.k[layer] for layer in self._target_scores.layers}
            s_target = self._target_scores.compute(caches, L)
        if self._draft_scores is not None:
            s_draft = self._estimate_draft(state, L)
        state.timer.stop("estimate")
        state.timer.start("select")
        if self.auto is None:
            plan = _select(s_target, s_draft, L, self.exact_cfg, self.m)
        else:
            plan = self._select_auto(s_target, s_draft, L, state.done)
        state.timer.stop("select")
        return plan

    def _select_auto(self, s_target, s_draft, L, done) -> SparsePlan:
        """`--budget auto`: each row's k from the estimated mass, its m at the config's share, then the hybrid
        selection at that k (indices padded to k_max); the k of the rows still running go to the histogram."""
        c = self.cfg
        free = max(c.free_budget, 1)
        k, m, dense = adaptive_budgets(s_target if self.uses_target else None, s_draft if self.uses_draft else None,
                                       L, self.auto, sinks=c.sinks, window=c.window, m_share=self.m / free)
        idx, counts = select_ragged(s_target, s_draft, L, k, m, k_max=c.budget, m_max=self.m, sinks=c.sinks,
                                    window=c.window)
        self._k_hist.add(counts, ~done, dense)
        return SparsePlan(idx, counts, dense)

    def after_verify(self, state: StepState, n_accepted: torch.Tensor) -> None:
        if self._target_scores is not None:
            self._target_scores.after_verify(n_accepted)


class OracleSelection(SelectionPolicy):
    """Top-k of the mean attention the verify window's queries really pay (all target layers and heads)."""

    name = "oracle"

    def __init__(self, cfg: SparseConfig) -> None:
        self.cfg = cfg

    def plan(self, state: StepState) -> SparsePlan:
        mass = window_attention(state.target, state.target_cache, state.verify_input, state.verify_positions)
        idx, counts = oracle_set(mass, state.target_cache.lengths, self.cfg.budget, self.cfg.sinks, self.cfg.window)
        return SparsePlan(idx, counts)
