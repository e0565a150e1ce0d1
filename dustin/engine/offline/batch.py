"""Offline batches on an engine core: the core sized for a batch (one slot per prompt, the capacity its prompts
need), how its prompts are admitted and prefilled, and on a GPU one core kept across calls.

A row-local policy's prompts join one slot each and are prefilled in packed chunks, as served requests are, on the
core kept across calls on a GPU (a later call of the same settings and batch size whose prompts fit pays neither the
allocation nor the CUDA-graph capture again; its capacity is rounded up to `KEPT_ROUNDING` positions so that calls
of similar lengths share it). A policy with whole-batch state, a `PrefillCache` (greedy methods compared over one
prefill: `SharedPrefill`) or noise-filled caches (benchmarks: `NoisePrefill`) make the batch one gang on a core of
its own.
"""
from __future__ import annotations

import gc
from dataclasses import astuple, replace

import torch

from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.kv_manager import cache_capacity
from dustin.engine.offline.prefill import NoisePrefill, PrefillCache, SharedPrefill, prefill_key
from dustin.engine.pair import ModelPair
from dustin.engine.request import SamplingParams, SamplingRule
from dustin.engine.sampling import GREEDY
from dustin.engine.scheduler import check_admission
from dustin.errors import OutOfMemoryError
from dustin.selection.base import SelectionPolicy

KEPT_ROUNDING = 4096  # a kept core's capacity is rounded up to a multiple of this many positions


class OfflineBatches:
    """Engine cores for the offline batches of one model pair (see the module's docstring)."""

    def __init__(self, pair: ModelPair, keep: bool) -> None:
        """keep: keep the core of row-local batches across calls (the default on a GPU)."""
        self.pair, self.keep = pair, keep
        self._kept: tuple[tuple, EngineCore] | None = None

    @property
    def kept_core(self) -> EngineCore | None:
        return None if self._kept is None else self._kept[1]

    def release(self) -> None:
        """Drop the kept core: its KV caches and graphs are freed."""
        self._kept = None

    def start(self, prompts: list[list[int]], cfg: GenerationConfig, params: list[SamplingParams],
              policy: SelectionPolicy | None = None, prefill_cache: PrefillCache | None = None,
              fill: str | None = None, warmup: bool = True, step_costs=None,
              shared: SamplingRule = GREEDY) -> EngineCore:
        """An engine core with `prompts` queued as one batch (checked by the caller), each with its `params`.
        fill: "whole" (a gang computing its prompts), "noise" (a gang of noise-filled caches), or None: a gang over
        `prefill_cache` when given and every row greedy, a gang for a policy with whole-batch state, else chunked.
        shared: the rule of rows drawing from the core's generator (`EngineCore`'s `shared`)."""
        pair = self.pair
        own_policy = policy is None
        policy = policy or pair.make_policy(cfg)
        gang_prefill = None
        if fill == "noise":
            gang_prefill = NoisePrefill()
        elif fill is None and prefill_cache is not None and all(p.sampling.greedy for p in params):
            gang_prefill = SharedPrefill(prefill_cache)
        gang = fill is not None or gang_prefill is not None or not policy.row_local
        for p in params:
            check_admission(p, gang, cfg.method)
        if isinstance(gang_prefill, SharedPrefill):
            if prefill_cache.lookup(prefill_key(prompts, pair.target.embed_tokens.weight.dtype)) is None:
                prefill_cache.clear()  # another batch's caches: free them before allocating
        limits = [p.max_tokens for p in params]
        need = cache_capacity([len(p) for p in prompts], limits, cfg.gamma if cfg.spec.speculative else 0)
        keep = self.keep and not gang
        key = (astuple(replace(cfg, seed=0)), shared, len(prompts))
        kept = self._kept
        if kept is None or not keep or kept[0] != key or kept[1].runner.batch.target_cache.capacity < need:
            self._kept = None
            gc.collect()
            if pair.device.type == "cuda":
                torch.cuda.empty_cache()
            cap = -(-need // KEPT_ROUNDING) * KEPT_ROUNDING if keep else need
            pair.kv_fit(cfg.spec.speculative).require(len(prompts), cap)
            # the batch's sizes: a slot per prompt, all of them waiting at once, the models' whole context (a kept
            # core may later serve calls that ask more tokens: any limit its capacity holds)
            sized = replace(cfg, max_context=pair.max_context(cfg.spec.speculative), max_waiting=len(prompts))
            try:
                core = EngineCore(pair, sized, slots=len(prompts), capacity=cap, policy=policy,
                                  kernel_warmup=warmup and own_policy, gang=gang, gang_prefill=gang_prefill,
                                  step_costs=step_costs, max_new_tokens=cap if keep else max(limits),
                                  shared=shared)
            except torch.OutOfMemoryError:
                raise OutOfMemoryError(f"a batch of {len(prompts)} sequences does not fit in {pair.device} memory: "
                                       f"lower the batch size, the prompt length or --max-new-tokens") from None
            kept = (key, core)
            if keep:
                self._kept = kept
        core = kept[1]
        core.begin_run(cfg.seed)
        core.runner.policy.budget_stats(reset=True)  # a kept core's histogram counts this call only
        if core.rank == 0:  # tensor parallelism: the other ranks follow rank 0's plans (`lead_or_follow`)
            core.queue(list(zip(prompts, params, strict=True)), checked=True)
        return core
