"""The sampled tail that `--method dustin` runs (the config's `tail_share`): each layer's and KV head's stratified
sample of the positions outside Eq. 6's exact set, reweighted so that attention over them is estimated without
bias. Why a tail at all, and the analysis rows that measure its variants, are in selection/tail.py; this module is
the engine's draw, which every layer's plan takes inside the step graph.
"""
from __future__ import annotations

import torch

from dustin.attention.context import SparsePlan
from dustin.rng import below, counter_bits

GREEDY_KEY = 0x7A11_5EED  # every greedy row's key: its draws depend on its cache length, layer and KV head only
PAST_ALL = torch.iinfo(torch.int64).max  # a sort key after every real position


def stratified_tail(exact: SparsePlan, keys: torch.Tensor, lengths: torch.Tensor, n_layers: int, n_kv: int, m: int,
                    head_offset: int = 0, heads_total: int | None = None) -> SparsePlan:
    """The engine's sampled tail (`--method dustin` with the config's `tail_share`): the exact set (indices [B, Ke],
    one set per row, sorted, counts [B]) plus, per layer and KV head, m positions of the rest R drawn by
    stratified sampling. R's positions, in order, are cut into m_used = min(m, |R|) strata of floor or ceil
    |R| / m_used consecutive ones, and one position is drawn uniformly from each; it carries the log of its
    stratum's size, its inverse inclusion probability, so the tail's sums are unbiased estimates of the sums over
    R (Horvitz-Thompson), like the uniform sample's of `with_tail`, with a variance no larger where attention varies
    smoothly along the context. Strata are disjoint: no position is drawn twice.
    Why not `with_tail`'s uniform draw: that sorts a random key for every cached position of every layer and head
    (topk over [B, Hkv, S] per layer). Here each drawn position costs O(1) (its stratum's rank, mapped to a
    position by one binary search over the exact set) and no sort touches the whole cache, so every layer's tail
    is drawn at once, with fixed shapes, inside the step graph.
    Row-local and deterministic as `with_tail`'s: the random bits are `counter_bits` keyed by the row's key
    (`keys`: the request's seed, or `GREEDY_KEY`), its cache length, the layer and the KV head, here the global
    head `head_offset + h` of `heads_total` (tensor parallelism: each rank draws its own heads, the same positions
    a single device draws for them). A `dense` row takes no tail.
    Returns a per-layer plan: indices and bias [n_layers, B, n_kv, Ke + m] (sorted, bias 0 on S), counts
    [n_layers, B, n_kv] (|S| + m_used), `dense` as given."""
    assert exact.indices.dim() == 2, "the tail extends one exact set per row"
    idx, cnt = exact.indices, exact.counts
    B, Ke = idx.shape
    dev = idx.device
    H = heads_total or n_kv
    L, c = lengths.long().to(dev), cnt.long()
    r = (L - c).clamp_min(0)
    if exact.dense is not None:
        r = torch.where(exact.dense, 0, r)
    used = r.clamp_max(m)  # [B]: strata (= positions drawn) per layer and head
    i = torch.arange(m, device=dev)
    per = used.clamp_min(1)[:, None]
    lo, hi = (i * r[:, None]) // per, ((i + 1) * r[:, None]) // per  # [B, m]: stratum i is ranks [lo, hi) of R
    on = i[None, :] < used[:, None]
    row = counter_bits(keys.long().to(dev), L, 1)[:, 0]  # the row's key at this cache length
    heads = counter_bits(row, torch.zeros_like(row), n_layers * H).view(B, n_layers, H)
    heads = heads[..., head_offset:head_offset + n_kv]  # this device's KV heads
    bits = counter_bits(heads.reshape(-1), torch.zeros(B * n_layers * n_kv, dtype=torch.long, device=dev), m)
    size = (hi - lo).clamp_min(1)[:, None, None, :]
    rank = lo[:, None, None, :] + below(bits.view(B, n_layers, n_kv, m), size)  # [B, nl, n_kv, m]
    # rank -> position: the rank-th position of R is rank + (exact positions before it), and exact position s_j
    # precedes it iff the R positions before s_j (s_j - j, nondecreasing in j) are <= rank
    j = torch.arange(Ke, device=dev)
    valid = j[None, :] < c[:, None]
    gaps = torch.where(valid, idx.long() - j, torch.iinfo(torch.int64).max)
    pos = rank + torch.searchsorted(gaps, rank.view(B, -1), right=True).view_as(rank)
    shape = (B, n_layers, n_kv)
    pos = torch.cat([idx.long()[:, None, None, :].expand(*shape, Ke), pos], dim=-1)
    keep = torch.cat([valid[:, None, None, :].expand(*shape, Ke), on[:, None, None, :].expand(*shape, m)], dim=-1)
    bias = torch.cat([torch.zeros(*shape, Ke, device=dev), size.float().log().expand(*shape, m)], dim=-1)
    order = torch.where(keep, pos, PAST_ALL).argsort(dim=-1)  # S and T are disjoint: the valid ones ascending first
    pos, keep, bias = pos.gather(-1, order), keep.gather(-1, order), bias.gather(-1, order)
    counts = (c + used).to(torch.int32)[None, :, None].expand(n_layers, B, n_kv).contiguous()
    return SparsePlan(torch.where(keep, pos, 0).to(torch.int32).transpose(0, 1).contiguous(), counts, exact.dense,
                      torch.where(keep, bias, 0.0).transpose(0, 1).contiguous())
