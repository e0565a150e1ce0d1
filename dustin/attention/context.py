"""What one forward pass needs to know about the cache and the attention pattern.

The engine builds one `ForwardContext` per forward ("plan"); every layer then runs attention with it.
Selection policies (sparse verification) attach a `SparsePlan`; score estimators attach a `QueryObserver`
that sees the post-RoPE queries of the layers it asks for, which is how attention scores of chosen heads
are made available without materializing them for every head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dustin.cache.kv_cache import KVCache


@dataclass
class SparsePlan:
    """Per-sequence cached positions the new tokens attend to (shared by all layers and heads)."""

    indices: torch.Tensor  # int32 [B, K], sorted; entries past counts[b] are padding
    counts: torch.Tensor  # int32 [B]


class LayerPlanner(Protocol):
    """Plans the sparse set of each layer from that layer's queries (Quest) or from per-layer scores (SpecAttn);
    returning None keeps a layer dense."""

    def plan_layer(self, layer: int, q: torch.Tensor, ctx: "ForwardContext") -> SparsePlan | None: ...


class QueryObserver(Protocol):
    layers: frozenset[int]

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: "ForwardContext") -> None:
        """Called with q [B, Hq, T, D] (after RoPE) and this layer's K cache [B, Hkv, S_cap, D]."""


@dataclass
class ForwardContext:
    cache: KVCache
    positions: torch.Tensor  # int64 [B, T]: absolute positions of the new tokens
    lengths: torch.Tensor  # int32 [B]: cached positions before the new tokens
    max_len: int  # host-side upper bound of max(lengths) + T (sizes the attention work)
    rows: slice | None = None  # batch rows of the cache being written (prefill: one sequence)
    fresh: bool = False  # the cache is empty for these rows: attend over the new tokens only
    prompt: bool = False  # the new tokens are prompt tokens of `rows` (a whole prefill or a chunk of one)
    sinks: int = 0  # streaming attention (MagicDec draft): sinks + recent window only
    window: int = 0
    sparse: SparsePlan | LayerPlanner | None = None  # one set for every layer, or a per-layer planner
    observers: list[QueryObserver] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt = self.prompt or self.fresh  # a fresh forward is always a prompt's

    @property
    def num_new(self) -> int:
        return self.positions.shape[1]
