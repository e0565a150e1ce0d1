"""One model of a generation: its weights, its KV cache rows, and the CUDA graphs of its step forwards.

A speculative generation has two (target and draft). The batch's runner (dustin/engine/worker/) asks a model runner for
- `forward(tokens, positions, lengths, ...)`: one step over every row (verify, decode or a draft token),
  replayed from a CUDA graph captured once per shape when graphs are on (they live as long as the runner:
  a serving engine's runner serves every request with the same graphs);
- `prefill_packed(chunks, pad_to, logit_rows)`: prompt chunks of one or several rows in one forward (the one
  prefill path: dustin/kernels/prefill_attention.py; a single sequence's whole prompt is a one-chunk plan),
  optionally also returning the final hidden states of chosen prompt positions (`hidden_at`), whose logits the
  caller computes in pieces (prompt log-probabilities).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dustin.attention.context import ForwardContext, SparsePlan
from dustin.cache.kv_cache import KVCache
from dustin.engine.cuda_graphs import GraphedForward
from dustin.kernels.prefill_plan import PrefillPlan
from dustin.models.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, use_graphs: bool) -> None:
        """cache: the model's KV cache rows, given by the batch's `KVManager` (one row per slot)."""
        self.model, self.cache, self.use_graphs = model, cache, use_graphs
        self.batch = cache.batch_size
        self.device = model.embed_tokens.weight.device
        self._graphs: dict[tuple, GraphedForward] = {}
        self.capture_s = 0.0  # time spent capturing (warm-up runs included)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, max_len: int, *,
                sinks: int = 0, window: int = 0, sparse=None, observers=(), graphed: bool = True,
                float_logits: bool = True, greedy: int | None = None) -> torch.Tensor:
        """Logits [B, T, V] of T new tokens per row at `positions`, after `lengths` cached positions (fp32, or
        with float_logits=False in the model's dtype: `Transformer.forward`); with greedy=V each row's greedy token
        at its last position instead, [B] (`Transformer.forward`).
        graphed=False: run eagerly even when graphs are on (the step loop captures a whole step around it)."""
        if graphed and self.use_graphs and (sparse is None or isinstance(sparse, SparsePlan)):
            sparse_shape = None if sparse is None else tuple(sparse.indices.shape)  # [B, K], [B, Hkv, K] or per layer
            dense = sparse is not None and sparse.dense is not None
            bias = sparse is not None and sparse.bias is not None
            key = (tokens.shape[1], sparse_shape, dense, bias, float_logits, greedy)
            if key not in self._graphs:
                t0 = time.perf_counter()
                self._graphs[key] = GraphedForward(self.model, self.cache, self.batch, tokens.shape[1], sinks=sinks,
                                                   window=window, sparse_shape=sparse_shape, sparse_dense=dense,
                                                   sparse_bias=bias,
                                                   observers=observers, float_logits=float_logits, greedy=greedy)
                self.capture_s += time.perf_counter() - t0
            return self._graphs[key](tokens, positions, lengths, sparse)
        ctx = ForwardContext(self.cache, positions, lengths, max_len, sinks=sinks, window=window, sparse=sparse,
                             observers=list(observers))
        return self.model(tokens, ctx, float_logits=float_logits, greedy=greedy)

    @torch.inference_mode()
    def prefill_packed(self, chunks: list[tuple[int, int, list[int]]], pad_to: int, logit_rows: int,
                       observers=(), hidden_at: list[int] | None = None):
        """chunks: (row, start, tokens): each writes prompt tokens at positions start.. of its row, attending over
        the row's first `start` cached positions. One forward of exactly max(pad_to, real tokens) tokens, and
        logits at each chunk's last token through an lm_head of `logit_rows` (>= chunks) rows: fixed shapes, so
        every GEMM computes a row's numbers the same way whatever else is packed beside it. Returns [C, V].
        hidden_at: indices into the packed tokens; returns (logits [C, V], their final hidden states [P, dim],
        the lm_head) instead, the logits computed exactly as without them."""
        packed = self.pack(chunks, pad_to, logit_rows)
        if not hidden_at:
            return self.forward_packed(packed, observers)
        ctx = self._packed_context(packed, observers)
        host = torch.tensor(hidden_at, dtype=torch.long)
        at = torch.cat([packed.last, (host.pin_memory() if self.device.type == "cuda" else host).to(
            self.device, non_blocking=True)])
        h = self.model(packed.tokens, ctx, logits_at=at, lm_head=False)
        head = self.model.lm_head
        R = packed.last.shape[0]  # the lm_head of `logit_rows` rows, as `forward_packed` runs it
        return head(h[:R]).float()[:packed.chunks], h[R:], head

    def pack(self, chunks: list[tuple[int, int, list[int]]], pad_to: int, logit_rows: int) -> "PackedPrefill":
        """The host side of `prefill_packed`: its plan, tokens, positions and logit rows, sent to the device."""
        plan = PrefillPlan.build([(row, start, len(toks)) for row, start, toks in chunks], self.device)
        flat = [t for _, _, toks in chunks for t in toks]
        n_pad = max(pad_to, len(flat)) - len(flat)
        host = torch.tensor(flat + [0] * n_pad, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        toks = host.to(self.device, non_blocking=True)[None]
        pos = torch.cat([plan.token_pos, torch.zeros(n_pad, dtype=torch.long, device=self.device)])[None]
        C = len(chunks)
        last = torch.cat([plan.last, torch.zeros(max(logit_rows, C) - C, dtype=torch.long, device=self.device)])
        return PackedPrefill(plan, toks, pos, last, C)

    @torch.inference_mode()
    def forward_packed(self, packed: "PackedPrefill", observers=()) -> torch.Tensor:
        """The device side of `prefill_packed` (the kernel warm-up runs it on a fake twin, `pack` outside)."""
        return self.model(packed.tokens, self._packed_context(packed, observers), logits_at=packed.last)[:packed.chunks]

    def _packed_context(self, packed: "PackedPrefill", observers) -> ForwardContext:
        return ForwardContext(self.cache, packed.positions, torch.zeros(1, dtype=torch.int32, device=self.device), 0,
                              packed=packed.plan, observers=list(observers))


@dataclass
class PackedPrefill:
    plan: PrefillPlan
    tokens: torch.Tensor  # [1, N] long
    positions: torch.Tensor  # [1, N] long
    last: torch.Tensor  # [R] long: each chunk's last token, then padding rows of the lm_head
    chunks: int
