"""`--budget auto`: a per-sequence, per-step k from the estimated attention mass (top-p over positions).

Dustin's score heads already estimate, every step, how the target's attention spreads over the cache (S_target,
S_draft: softmax masses summed over the configured heads). A fixed k is too few positions where attention is
spread out (aggregation and QA at 32k) and too many where it is concentrated (a needle). So, per sequence:
- each available score row is normalised over the pickable positions (past the sinks, before the recent window)
  and, for the hybrid, the two are averaged (each source counts equally, as in the paper's split of k);
- n = the smallest number of positions whose combined mass reaches `p` (the top-p rule of Twilight, NeurIPS
  2025, applied to Dustin's own estimate);
- k = clamp(sinks + window + n, k_min, k_max): sinks and the recent window are always kept; a step whose scores
  are all zero (nothing estimated yet) takes k_max;
- the draft's share m follows the config's m / (k - sinks - window) ratio, the rest comes from S_target;
- with `dense` (`--budget-dense`), a row whose k_max best positions hold less than p of its estimated mass (its
  attention is spread out: aggregation, multi-value retrieval) verifies against the whole cache this step instead
  (`SparsePlan.dense`), rather than with k_max positions that miss much of it.
Everything is torch ops over fixed shapes (indices padded to k_max, the real count per row in `counts`, which the
sparse verify kernels already honour), so a step with it is captured as one CUDA graph; the k each row used goes
into a device histogram that is read once at the end of a run.
"""
from __future__ import annotations

import math

import torch

from dustin.kernels.selection import rows_contain
from dustin.selection.config import AutoBudget

_NEG_INF = float("-inf")


def _normalised(scores: torch.Tensor, pickable: torch.Tensor) -> torch.Tensor:
    s = scores.float().clamp_min(0).masked_fill(~pickable, 0.0)
    total = s.sum(-1, keepdim=True)
    return torch.where(total > 0, s / total.clamp_min(1e-30), torch.zeros_like(s))


def adaptive_budgets(s_target: torch.Tensor | None, s_draft: torch.Tensor | None, lengths: torch.Tensor,
                     rule: AutoBudget, *, sinks: int, window: int, m_share: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row (k [B], m [B]) int64: the smallest k whose positions hold `rule.p` of the estimated mass (see the
    module docstring); m = round(m_share * (k - sinks - window)) draft picks; and with `rule.dense` the rows that
    verify against the whole cache (bool [B]; else None)."""
    ref = s_target if s_target is not None else s_draft
    B, S = ref.shape
    L = lengths.to(device=ref.device, dtype=torch.long)[:, None]
    j = torch.arange(S, device=ref.device)[None, :]
    pickable = (j >= sinks) & (j < L - window)
    parts = [_normalised(s, pickable) for s in (s_target, s_draft) if s is not None]
    mass = parts[0] if len(parts) == 1 else (parts[0] + parts[1]) / 2
    sw = sinks + window
    n_max = max(rule.k_max - sw, 1)
    top = mass.topk(min(n_max, S), dim=-1).values.cumsum(-1)  # [B, n_max], non-decreasing
    reached = top >= rule.p * top[:, -1:]  # p of all the mass the top n_max hold (what k_max could give)
    n = torch.where(reached.any(-1), reached.float().argmax(-1) + 1, torch.full_like(L[:, 0], n_max))
    n = torch.where(top[:, -1] > 0, n, torch.full_like(n, n_max))  # nothing estimated: the most
    k = (n + sw).clamp(rule.k_min, rule.k_max)
    m = torch.round((k - sw).float() * m_share).long()
    dense = None
    if rule.dense:  # the mass sums to 1 where anything was estimated: what the best n_max positions miss
        dense = (top[:, -1] < rule.p * mass.sum(-1)) & (top[:, -1] > 0)
    return k, m, dense


def select_ragged(s_target: torch.Tensor, s_draft: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor,
                  m: torch.Tensor, *, k_max: int, m_max: int, sinks: int, window: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dustin's selection with a k and an m per row: the sinks, the recent window, row b's top m[b] of S_draft,
    then its best S_target positions not already taken until k[b] in all; a row of at most k[b] positions keeps
    them all. Returns indices int32 [B, k_max] (ascending; padding past counts is 0) and counts int32 [B]
    (the sparse verify kernels read only the first counts[b])."""
    B, S = s_target.shape
    device = s_target.device
    L = lengths.to(device=device, dtype=torch.long)[:, None]
    j = torch.arange(S, device=device)[None, :]
    pickable = (j >= sinks) & (j < L - window)
    n_max = max(min(k_max - sinks - window, S), 1)
    ranked_t = s_target.float().masked_fill(~pickable, _NEG_INF).topk(n_max, dim=1).indices  # [B, n_max]
    if m_max > 0:
        ranked_d = s_draft.float().masked_fill(~pickable, _NEG_INF).topk(min(m_max, S), dim=1).indices
        d_keep = torch.arange(ranked_d.shape[1], device=device)[None, :] < m[:, None]
        in_draft = rows_contain(ranked_d, ranked_t, S, keep=d_keep)
    else:
        ranked_d = ranked_t[:, :0]
        d_keep = torch.zeros_like(ranked_d, dtype=torch.bool)
        in_draft = torch.zeros_like(ranked_t, dtype=torch.bool)
    t_budget = (k - sinks - window - m.clamp_max(m_max))[:, None]
    t_keep = ~in_draft & ((~in_draft).cumsum(1) <= t_budget)
    window_pos = L - window + torch.arange(window, device=device)[None, :]
    candidates = torch.cat((torch.arange(sinks, device=device)[None, :].expand(B, sinks), window_pos,
                            ranked_d, ranked_t), dim=1)
    keep = torch.cat((torch.ones(B, sinks + window, dtype=torch.bool, device=device), d_keep, t_keep), dim=1)
    ordered = torch.where(keep, candidates, torch.full_like(candidates, S)).sort(dim=1).values
    width = ordered.shape[1]
    if width < k_max:
        ordered = torch.cat([ordered, torch.full((B, k_max - width), S, dtype=ordered.dtype, device=device)], 1)
    ordered = ordered[:, :k_max]
    ordered = torch.where(ordered >= S, torch.zeros_like(ordered), ordered)
    slot = torch.arange(k_max, device=device)[None, :]
    short = L <= k[:, None]
    indices = torch.where(short, torch.where(slot < L, slot, torch.zeros_like(slot)), ordered)
    counts = torch.where(short[:, 0], L[:, 0], k)
    return indices.to(torch.int32), counts.to(torch.int32)


class BudgetHistogram:
    """How many (step, sequence) pairs verified with each k: a device counter updated inside the step (no sync),
    read once when a run reports it."""

    def __init__(self, k_max: int, device) -> None:
        self.counts = torch.zeros(k_max + 1, dtype=torch.long, device=device)
        self.dense = torch.zeros((), dtype=torch.long, device=device)  # (step, sequence) pairs verified densely

    def reset(self) -> None:
        with torch.inference_mode():  # made inside a step, in inference mode: only zeroed in it
            self.counts.zero_()
            self.dense.zero_()

    def add(self, k: torch.Tensor, active: torch.Tensor, dense: torch.Tensor | None = None) -> None:
        if dense is not None:
            self.dense += (active & dense).sum()
            active = active & ~dense
        self.counts.scatter_add_(0, k.long().clamp(0, self.counts.numel() - 1), active.long())

    def report(self, reset: bool = False) -> dict | None:
        """`summary`, then, with `reset`, a fresh count (a run's report counts that run only)."""
        out = self.summary()
        if reset:
            self.reset()
        return out

    def summary(self) -> dict | None:
        """{"mean", "p50", "p90", "p99", "samples", "dense"} of k over the sparsely verified pairs, and the share of
        pairs verified against the whole cache, or None before any step."""
        c = self.counts.cpu()
        n_dense = int(self.dense)
        total = int(c.sum())
        if total + n_dense == 0:
            return None
        if total == 0:
            return {"mean": 0.0, "p50": 0, "p90": 0, "p99": 0, "samples": 0, "dense": 1.0}
        ks = torch.arange(c.numel(), dtype=torch.float64)
        cdf = c.cumsum(0)

        def pct(q: float) -> int:  # the smallest k with at least ceil(q * total) samples at or below it
            need = max(1, math.ceil(q * total))
            return int(torch.searchsorted(cdf, torch.tensor(need, dtype=cdf.dtype), right=False))

        return {"mean": round(float((ks * c).sum()) / total, 1), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
                "samples": total, "dense": round(n_dense / (total + n_dense), 4)}
