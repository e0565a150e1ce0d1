"""Sparse verification that keeps spread-out attention: an exact set plus a sampled, reweighted tail.

An exact top-k set is a biased estimate of attention: where attention is spread over the whole context
(aggregation: the most frequent words of a document) no few hundred positions hold the answer, and the positions
left out are simply dropped from the softmax. Sampling the rest instead removes that bias (MagicPIG, Chen et al.,
ICLR 2025; vAttention, Desai et al., ICLR 2026). Per verify forward, row, layer and KV head:
- S, the exact set: the sinks, the recent window and the best positions by some score (`TailRow.source`);
- T, m positions drawn uniformly without replacement from the rest R of the row's cached context (|R| = L - |S|),
  each weighted w = |R| / m, i.e. an additive log-weight log(w) on its score (`SparsePlan.bias`):

    o = (sum_S e^s v + w sum_T e^s v) / (sum_S e^s + w sum_T e^s)

  Numerator and denominator are each unbiased estimates of their sums over S and R; their ratio is consistent,
  with a bias of O(1/m). The Γ + 1 new tokens stay exact (weight 1). m <= |R| always: a row whose R is empty
  takes no tail, one with |R| <= m reads all of R with w = 1 (exact attention); a `dense` row takes no tail.
- All Γ + 1 verify queries and the G query heads of a KV head share one draw (one list of positions per KV head,
  what the sparse verify kernels read); each layer draws its own, so the layers' sampling errors are independent
  rather than the same positions missing in every layer.
- The draw is row-local and deterministic: position j's place in the random order is `counter_bits` (the
  counter-based generator of the engine's per-row sampling) keyed by the row's key (the request's seed, one fixed
  key for greedy rows: `RowSampling.row_keys`), its cache length, the layer and the KV head; the m positions of R
  first in that order are the sample. Never the slot or the request id: a row's draw, hence its greedy text, is
  the same alone or in any batch, and run to run. Keys are distinct 64-bit values, so the order has no ties.
- With `adaptive` (vAttention's rule), m comes from a bound on the error of the softmax's denominator: with
  probability 1 - δ its estimate is within ε of the truth when m >= (z_{1-δ} σ |R| / (ε D))², σ the standard
  deviation of e^s over R and D the denominator, both estimated from a pilot (the first positions of the same
  random order, so the pilot is part of the sample); the finite-population correction of sampling without
  replacement then lowers it, m = n / (1 + (n - 1) / |R|). The largest m over the KV head's G x (Γ + 1) queries,
  at least the pilot and at most the split's m (a cap: a kernel reads a fixed number of slots). D counts the
  cached context only, not the new tokens: a smaller D asks for more samples, never fewer.

The analysis rows (`ORACLE_TAIL_ROWS` in selection/config.py; the rungs beside the oracle ladder in
docs/accuracy.md): `oracle-layer-tail*` take S from the ladder's rung (b), the exact per-layer set of the layer's
own verify queries (analysis only: each layer materializes its heads' attention over the whole cache);
`oracle-dustin-tail*` take dustin's own selection at |S| positions. The positions each row reads per layer and KV
head (|S| + the m drawn, or fewer for a short row) are counted and reported like `--budget auto`'s k
(`budget_stats`), so the adaptive rows report the m they used. The Triton sparse verify kernel reads each position's
weight next to its index (kernels/sparse_verify.py); SDPA (the CPU default) takes a float mask instead
(attention/backend.py `weighted_mask`). Under tensor parallelism, `broadcast_plan` hands every rank the weights too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from dustin.attention.context import SparsePlan
from dustin.rng import counter_bits
from dustin.selection.adaptive import BudgetHistogram
from dustin.selection.base import SelectionPolicy, StepState
from dustin.selection.config import ORACLE_TAIL_ROWS, SparseConfig, TailRow
from dustin.selection.ladder import rung_set
from dustin.selection.oracle import window_probs
from dustin.selection.policies import DustinSelection
from dustin.selection.stratified import GREEDY_KEY, PAST_ALL


@dataclass(frozen=True)
class AdaptiveTail:
    """vAttention's sample-size rule (module docstring): the denominator within ε of the truth with probability
    1 - δ; the pilot is this share of |R| (at least 2 positions, to estimate a spread)."""

    eps: float = 0.1
    delta: float = 0.05
    pilot: float = 0.02

    @property
    def z(self) -> float:
        return NormalDist().inv_cdf(1.0 - self.delta)


def tail_keys(seeds: torch.Tensor, lengths: torch.Tensor, layer: int, n_kv: int) -> torch.Tensor:
    """[B, n_kv] int64: the key of each row's draw at this layer and KV head, from the row's key and its cache
    length (draw L of the row's key, then draw layer * n_kv + h of that)."""
    row = counter_bits(seeds.long(), lengths.long(), 1)[:, 0]
    return counter_bits(row, torch.full_like(row, layer * n_kv), n_kv)


def draw_tail(keys: torch.Tensor, outside: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [B, H], outside [B, H, S] (True on R) -> (positions [B, H, min(m, S)] long in random order, |R| [B, H]).
    The first min(m, |R|) positions are a uniform sample of R without replacement (any prefix of them is one too);
    the rest are padding."""
    B, H, S = outside.shape
    order = counter_bits(keys.reshape(-1), torch.zeros_like(keys.reshape(-1)), S).view(B, H, S)
    order = torch.where(outside, order, PAST_ALL)
    picks = order.topk(min(m, S), dim=-1, largest=False, sorted=True).indices
    return picks, outside.sum(-1)


def adaptive_m(q: torch.Tensor, k_cache: torch.Tensor, exact: torch.Tensor, exact_valid: torch.Tensor,
               picks: torch.Tensor, r: torch.Tensor, cap: int, rule: AdaptiveTail) -> torch.Tensor:
    """m [B, H] long by `rule` (module docstring): q [B, Hq, T, D] this layer's verify queries, k_cache
    [B, H, S_cap, D], the exact set (positions [B, H, Ke], valid [B, H, Ke]), the tail's random order `picks`
    [B, H, P] (P >= min(cap, |R|)) and |R| [B, H]. 0 where R is empty."""
    B, Hq, T, D = q.shape
    H = k_cache.shape[1]
    qg = q.float().reshape(B, H, (Hq // H) * T, D)

    def logits(pos: torch.Tensor) -> torch.Tensor:  # [B, H, GT, n]
        keys = k_cache.gather(2, pos.long()[..., None].expand(-1, -1, -1, D)).float()
        return qg @ keys.transpose(-1, -2) / math.sqrt(D)

    n0 = torch.clamp(torch.ceil(rule.pilot * r.float()).long(), 2, cap).minimum(r)
    pilot_on = (torch.arange(picks.shape[-1], device=q.device) < n0[..., None])[:, :, None, :]
    on = exact_valid[:, :, None, :]
    s_exact, s_pilot = logits(exact), logits(picks)
    peak = torch.maximum(s_exact.masked_fill(~on, -math.inf).amax(-1), s_pilot.masked_fill(~pilot_on, -math.inf)
                         .amax(-1))[..., None]  # any common factor cancels in σ / D: keeps exp() in range
    d_exact = ((s_exact - peak).exp() * on).sum(-1)
    e_pilot = (s_pilot - peak).exp() * pilot_on
    n = n0[:, :, None].float().clamp_min(1.0)
    mean = e_pilot.sum(-1) / n
    var = (((e_pilot - mean[..., None]) ** 2) * pilot_on).sum(-1) / (n - 1).clamp_min(1.0)
    rf = r[:, :, None].float().clamp_min(1.0)
    total = d_exact + rf * mean  # > 0: the peak's own term is 1
    n_inf = ((rule.z * var.sqrt() * rf / (rule.eps * total)) ** 2).clamp(1.0, 1e30)
    need = n_inf / (1.0 + (n_inf - 1.0) / rf)  # without replacement: the finite-population correction
    m = torch.ceil(need).amax(-1).long()
    return torch.where(r > 0, torch.clamp(torch.maximum(m, n0), max=cap).minimum(r), 0)


def with_tail(exact: SparsePlan, seeds: torch.Tensor, lengths: torch.Tensor, layer: int, n_kv: int, max_len: int,
              m: int, weighted: bool = True, adaptive: AdaptiveTail | None = None, q: torch.Tensor | None = None,
              k_cache: torch.Tensor | None = None) -> SparsePlan:
    """The exact plan (indices [B, Ke] or [B, n_kv, Ke]) plus each row's and KV head's tail of m positions
    (module docstring): one [B, n_kv, Ke + m] plan, sorted, its `bias` 0 on S and log(|R| / m_used) on the tail
    (0 with weighted False). seeds: each row's key [B]; adaptive (needs q, this layer's verify queries, and its
    k_cache): m per row and KV head from the rule, capped at m."""
    idx = exact.indices if exact.indices.dim() == 3 else exact.indices[:, None].expand(-1, n_kv, -1)
    cnt = exact.counts if exact.counts.dim() == 2 else exact.counts[:, None].expand(-1, n_kv)
    B, _, Ke = idx.shape
    dev = idx.device
    S = max_len
    L = lengths.long().to(dev)
    valid = torch.arange(Ke, device=dev)[None, None, :] < cnt[:, :, None]
    in_exact = torch.zeros(B, n_kv, S, dtype=torch.int32, device=dev).scatter_add_(
        2, idx.long().clamp_max(S - 1), valid.to(torch.int32)) > 0
    outside = (torch.arange(S, device=dev)[None, None, :] < L[:, None, None]) & ~in_exact
    if exact.dense is not None:  # a row verified against the whole cache takes no tail
        outside = outside & ~exact.dense[:, None, None]
    picks, r = draw_tail(tail_keys(seeds, L, layer, n_kv), outside, m)
    if adaptive is not None:
        used = adaptive_m(q, k_cache, idx, valid, picks, r, m, adaptive)
    else:
        used = r.clamp_max(m)
    log_w = torch.log(r.float() / used.clamp_min(1).float()) if weighted else torch.zeros_like(r, dtype=torch.float)
    tail_on = torch.arange(picks.shape[-1], device=dev)[None, None, :] < used[:, :, None]
    pos = torch.cat([idx.long(), picks], dim=-1)
    on = torch.cat([valid, tail_on], dim=-1)
    bias = torch.cat([torch.zeros(B, n_kv, Ke, device=dev), log_w[:, :, None].expand(-1, -1, picks.shape[-1])], -1)
    order = torch.where(on, pos, PAST_ALL).argsort(dim=-1)  # valid entries ascending, then the padding
    pos, on, bias = pos.gather(-1, order), on.gather(-1, order), bias.gather(-1, order)
    return SparsePlan(torch.where(on, pos, 0).to(torch.int32), on.sum(-1).to(torch.int32), exact.dense,
                      torch.where(on, bias, 0.0))


class _Tail:
    """What the tail rows share: the split of the budget, the rows' keys at each step, the tail of each layer's
    exact set, and the positions read per (sequence, step, layer, KV head) as `budget_stats`."""

    def _init_tail(self, cfg: SparseConfig, name: str) -> tuple[int, int]:
        self.row: TailRow = ORACLE_TAIL_ROWS[name]
        self.total = cfg.budget
        self.exact_k, self.tail_m = self.row.split(cfg.budget, cfg.sinks + cfg.window + 1)
        self.adaptive = AdaptiveTail() if self.row.adaptive else None
        self._seeds = self._active = None
        self._read: BudgetHistogram | None = None
        return self.exact_k, self.tail_m

    def _begin(self, state: StepState) -> None:
        self._seeds = state.sampler.row_keys(GREEDY_KEY)
        self._active = ~state.done
        if self._read is None:
            self._read = BudgetHistogram(self.total, state.device)

    def _tailed(self, exact: SparsePlan, layer: int, q: torch.Tensor, ctx) -> SparsePlan:
        k_cache = ctx.cache.k[layer]
        n_kv = k_cache.shape[1]
        plan = with_tail(exact, self._seeds, ctx.lengths, layer, n_kv, ctx.max_len, self.tail_m, self.row.weighted,
                         self.adaptive, q, k_cache)
        dense = None if plan.dense is None else plan.dense.repeat_interleave(n_kv)
        self._read.add(plan.counts.reshape(-1), self._active.repeat_interleave(n_kv), dense)
        return plan

    def budget_stats(self, reset: bool = False) -> dict | None:
        """Positions read per (sequence, step, layer, KV head): |S| plus the m drawn (the m used, for the adaptive
        rows), fewer for a row shorter than the budget."""
        return None if self._read is None else self._read.report(reset)


class LayerTailOracle(_Tail, SelectionPolicy):
    """`oracle-layer-tail*`: the ladder's rung (b) (the top of each layer's own mean attention, sinks and window
    kept) at |S| positions, plus the tail. Analysis only, as the ladder is."""

    def __init__(self, cfg: SparseConfig, name: str) -> None:
        self.cfg, self.name = cfg, name
        self._init_tail(cfg, name)

    def plan(self, state: StepState):
        self._begin(state)
        return self

    def plan_layer(self, layer: int, q: torch.Tensor, ctx) -> SparsePlan:
        k_cache = ctx.cache.k[layer]
        probs = window_probs(q, k_cache, ctx.lengths, ctx.max_len)
        c = self.cfg
        exact = rung_set(probs, k_cache.shape[1], "layer", ctx.lengths, self.exact_k, c.sinks, c.window)
        return self._tailed(exact, layer, q, ctx)


class DustinTail(_Tail, DustinSelection):
    """`oracle-dustin-tail*`: dustin's own selection (both estimators, Eq. 6) at |S| positions, plus the tail.
    Its plan is per layer (each layer draws its own tail), so it runs outside the step graph."""

    graph_safe = False
    dense_rows = False  # plans are per layer: a plain step (Γ = 0) has no single plan to widen

    def __init__(self, cfg: SparseConfig, name: str) -> None:
        exact_k, _ = self._init_tail(cfg, name)
        super().__init__(cfg.with_budget(exact_k), "dustin")  # self.cfg: the exact part's config
        self.name = name
        self._exact: SparsePlan | None = None

    def plan(self, state: StepState):
        self._exact = super().plan(state)
        self._begin(state)
        return self

    def plan_layer(self, layer: int, q: torch.Tensor, ctx) -> SparsePlan:
        return self._tailed(self._exact, layer, q, ctx)
