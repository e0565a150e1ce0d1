"""CUDA graphs of the decode loop: a whole speculative step (`StepGraph`), or one fixed-shape forward
(`GraphedForward`: B sequences x T new tokens over a KV cache).

A decode or verify step launches hundreds of small kernels; replaying them as one graph removes the launch
gaps, which dominate for small models. The captured forward reads its tokens, positions and cache lengths from
static buffers, and attention is sized by the cache capacity (the Triton kernels exit early past each
sequence's length), so one graph serves every step of a generation.
"""
from __future__ import annotations

import time

import torch

from dustin.attention.context import ForwardContext, SparsePlan
from dustin.cache.kv_cache import KVCache
from dustin.models.transformer import Transformer


class GraphedForward:
    def __init__(self, model: Transformer, cache: KVCache, batch: int, num_new: int, *, sinks: int = 0,
                 window: int = 0, sparse_shape: tuple[int, ...] | None = None, sparse_dense: bool = False,
                 sparse_bias: bool = False, observers=(), warmup: int = 2, float_logits: bool = True,
                 greedy: int | None = None) -> None:
        """sparse_shape: capture sparse verification over a static index plan of this shape, [batch, K] (a set per
        sequence), [batch, Hkv, K] (a set per KV head) or [n_layers, batch, Hkv, K] (per layer), with per-row
        `dense` flags when sparse_dense and per-position log-weights when sparse_bias; the plan is copied in per
        call.
        observers: graph-safe `QueryObserver`s (they only write device buffers of fixed address, so the
        replay repeats their writes; warm-up and capture also run them, on dummy inputs). float_logits, greedy: as
        `Transformer.forward`'s (greedy: the replay's output is each row's greedy token)."""
        dev = cache.k.device
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(batch, num_new, dtype=torch.long, device=dev)
        # Warm-up and capture really write K/V: point them at the cache's last slots, which the engine keeps
        # free at capture (`session.cache_capacity` leaves spare positions past the longest sequence).
        tail = cache.capacity - num_new
        self.positions = (tail + torch.arange(num_new, device=dev)).expand(batch, num_new).contiguous()
        self.lengths = torch.full((batch,), tail, dtype=torch.int32, device=dev)
        self.plan = None
        if sparse_shape is not None:
            self.plan = SparsePlan(torch.zeros(sparse_shape, dtype=torch.int32, device=dev),
                                   torch.zeros(sparse_shape[:-1], dtype=torch.int32, device=dev),
                                   torch.zeros(batch, dtype=torch.bool, device=dev) if sparse_dense else None,
                                   torch.zeros(sparse_shape, device=dev) if sparse_bias else None)
        self.ctx = ForwardContext(cache, self.positions, self.lengths, cache.capacity, sinks=sinks, window=window,
                                  sparse=self.plan, observers=list(observers))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(warmup):  # compile Triton kernels and let the allocator settle before capture
                model(self.tokens, self.ctx, float_logits=float_logits, greedy=greedy)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.logits = model(self.tokens, self.ctx, float_logits=float_logits, greedy=greedy)
        # greedy tokens are kept across replays (a step's drafts are stacked after its last forward): each call's are
        # a copy; logits are consumed before the next replay
        self.copy_out = greedy is not None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                 plan: SparsePlan | None = None) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.lengths.copy_(lengths)
        if plan is not None:
            self.plan.indices.copy_(plan.indices)
            self.plan.counts.copy_(plan.counts)
            if plan.dense is not None:
                self.plan.dense.copy_(plan.dense)
            if plan.bias is not None:
                self.plan.bias.copy_(plan.bias)
        self.graph.replay()
        return self.logits.clone() if self.copy_out else self.logits


class StepGraph:
    """One CUDA graph of a whole decode step: `fn` (no host syncs; every piece of state it changes is updated in
    place) is captured once and replayed each step.

    Why: a speculative step of a small pair is ~2,500 kernels; replayed forward by forward, the Python between
    the forwards (token choice, estimation, selection, acceptance, bookkeeping: ~100 small launches) leaves the
    GPU idle for ~15% of the step (H200, 1.5B + 0.5B, 16 x 32k: 1.7 of 12 ms). As one graph the GPU runs the
    step back to back, and the host's only work is one replay and one sync.
    Capture does not execute `fn`, so the caller runs the same code once eagerly before (to compile the Triton
    kernels and create every lazily built buffer). `generators`: CUDA generators `fn` draws from (sampling,
    acceptance control), registered so that each replay advances their state like an eager run would."""

    def __init__(self, fn, generators=()) -> None:
        t0 = time.perf_counter()
        self.graph = torch.cuda.CUDAGraph()
        for g in generators:
            if g is not None and g.device.type == "cuda":
                self.graph.register_generator_state(g)
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.out = fn()
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out

    @staticmethod
    def can_register_generators() -> bool:
        """Whether this PyTorch can capture draws from a generator other than the default one."""
        return hasattr(torch.cuda.CUDAGraph, "register_generator_state")
