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
from dustin.kernels.prefill_plan import PrefillPlan


@dataclass
class SparsePlan:
    """Cached positions the new tokens attend to: one set per sequence (indices [B, K], counts [B]), or one per
    sequence and KV head (indices [B, Hkv, K], counts [B, Hkv]; query head h reads its KV head's), both shared by
    all layers; or one per layer, sequence and KV head (indices [n_layers, B, Hkv, K], counts [n_layers, B, Hkv]:
    `at_layer` gives a layer's, so that attention only ever sees the first two forms). A per-layer plan is still one
    object of fixed shape made once per step, so a step graph or a forward's graph replays it like the others
    (dustin's sampled tail draws each layer's own: dustin/selection/tail.py).
    Sorted; entries past the count are padding. Rows marked `dense` attend to the whole cache.

    `bias`, when set, weights each gathered position: an additive log-weight on its attention score, read next to
    its index (same shape as `indices`), so that position i counts e^{s_i + bias_i} = w_i e^{s_i} in both the
    softmax's numerator and its denominator. A sampled tail of m positions drawn uniformly from the R cached
    positions outside the exact set carries log(|R| / m): its sums then estimate the sums over all of R without
    bias (dustin/selection/tail.py). Exact positions carry 0, unread positions are simply absent (-inf), the new
    tokens and `dense` rows are never weighted. Natural log, as the scores are: the Triton kernels, which work in
    base 2 with log2(e) folded into the scale, take bias * log2(e). None: every weight is 1."""

    indices: torch.Tensor  # int32 [B, K] or [B, Hkv, K]
    counts: torch.Tensor  # int32 [B] or [B, Hkv]
    # bool [B] or None: rows that verify against the whole cache this step instead (their indices are ignored):
    # `--budget auto --budget-dense`, for rows whose estimated attention is too spread out for k_max positions
    dense: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # float32 like `indices`, or None: the log-weight of each gathered position

    @property
    def per_layer(self) -> bool:
        return self.indices.dim() == 4

    def at_layer(self, layer: int) -> "SparsePlan":
        """The plan layer `layer` reads: its slice of a per-layer plan (views, no copy), else this plan."""
        if not self.per_layer:
            return self
        return SparsePlan(self.indices[layer], self.counts[layer], self.dense,
                          None if self.bias is None else self.bias[layer])


class LayerPlanner(Protocol):
    """Plans the sparse set of each layer from that layer's queries (Quest) or from per-layer scores (SpecAttn);
    returning None keeps a layer dense."""

    def plan_layer(self, layer: int, q: torch.Tensor, ctx: "ForwardContext") -> SparsePlan | None: ...


class QueryObserver(Protocol):
    layers: frozenset[int]

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: "ForwardContext") -> None:
        """Called with q [B, Hq, T, D] (after RoPE) and this layer's K cache [B, Hkv, S_cap, D]."""


@dataclass(eq=False)
class LookaheadCapture:
    """What a selection policy asks the draft step to record, as data: of every draft forward of a step (t = 0 ..
    G - 1), for each draft layer in `heads`, the query of those query heads for the token the forward reads last,
    written to slot (its position - base[b]) of `queries[layer]` [B, Hs_layer, Γ, D], with the position in
    `positions[b, slot]`. The eager draft forwards honour it by calling it as a `QueryObserver` (one small kernel
    per observed layer, `fused_ops.capture_query`); a fused draft kernel would write the same buffers itself.
    Fixed buffers, so a captured CUDA graph's replay repeats the writes (the policy marks slots unwritten, -1, at
    each step's start)."""

    heads: dict[int, torch.Tensor]  # draft layer -> query head ids, long [Hs_layer]
    queries: dict[int, torch.Tensor]  # draft layer -> [B, Hs_layer, Γ, D]
    positions: torch.Tensor  # long [B, Γ]
    base: torch.Tensor  # long [B]: the position of slot 0 (the step's first lookahead query)

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.heads)

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: "ForwardContext") -> None:
        if ctx.prompt or layer not in self.heads:
            return  # a prefill has no lookahead
        from dustin.kernels import fused_ops  # lazy: Triton

        fused_ops.capture_query_any(q, self.heads[layer], ctx.positions, self.base, self.queries[layer],
                                    self.positions)


@dataclass
class ForwardContext:
    cache: KVCache
    positions: torch.Tensor  # int64 [B, T]: absolute positions of the new tokens
    lengths: torch.Tensor  # int32 [B]: cached positions before the new tokens
    max_len: int  # host-side upper bound of max(lengths) + T (sizes the attention work)
    rows: slice | None = None  # batch rows of the cache being written (prefill: one sequence)
    # packed prefill: tokens [1, N] are prompt chunks of several rows (the plan says which row and positions)
    packed: PrefillPlan | None = None
    fresh: bool = False  # the cache is empty for these rows: attend over the new tokens only
    prompt: bool = False  # the new tokens are prompt tokens of `rows` (a whole prefill or a chunk of one)
    sinks: int = 0  # streaming attention (MagicDec draft): sinks + recent window only
    window: int = 0
    sparse: SparsePlan | LayerPlanner | None = None  # one set for every layer, or a per-layer planner
    observers: list[QueryObserver] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt = self.prompt or self.fresh or self.packed is not None  # fresh / packed: always a prompt's

    def last_prompt_queries(self, q: torch.Tensor) -> tuple[torch.Tensor | slice, torch.Tensor]:
        """(cache rows, q [n, H, 1, D]): the query of the last token of each prompt piece in this prompt forward
        (q [B, H, T, D]): per chunk of a packed prefill, or the last token of the `rows` prefilled."""
        if self.packed is not None:  # once per row: its last chunk here
            return self.packed.row_ids, q[0][:, self.packed.row_last].transpose(0, 1)[:, :, None]
        return (self.rows if self.rows is not None else slice(None)), q[:, :, -1:]

    def prompt_pieces(self, q: torch.Tensor, k_cache: torch.Tensor):
        """Per prompt piece of this prompt forward (q [B, H, T, D] and the K cache its observers get):
        (cache row, its queries [1, H, n, D], that row's K cache [1, Hkv, S, D], its first position): each chunk of
        a packed prefill, or each of the `rows` prefilled (a fresh prefill: from position 0)."""
        if self.packed is not None:
            out, at = [], 0
            for row, pos0, n in self.packed.host:
                out.append((row, q[:, :, at:at + n], k_cache[row:row + 1], pos0))
                at += n
            return out
        rows = self.rows if self.rows is not None else slice(0, q.shape[0])
        if not self.fresh:
            raise ValueError("prompt_pieces: a prompt forward that is neither packed nor fresh")
        return [(b, q[i:i + 1], k_cache[i:i + 1], 0) for i, b in enumerate(range(rows.start or 0, rows.stop))]

    @property
    def num_new(self) -> int:
        return self.positions.shape[1]
