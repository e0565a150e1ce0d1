"""Prompt caches of offline batches made another way than by computing them: copied from a batch over the same
prompts (methods compared side by side over one prefill) or filled with noise (benchmarks with random weights).

Both run as the prefill of a gang admission (the whole batch admitted together; `Scheduler`): the engine core is
given one of these objects (`EngineCore(gang_prefill=...)`) and its executor calls it, on every tensor-parallel rank
alike, where it would call `Runner.prefill_gang`. Each uses the runner's public prefill steps (`Prefill.begin_gang`,
`prefill_rows`, `observe_last_tokens`, `activate_gang`) and the `KVManager`'s region copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dustin.engine.kv_manager import KVSnapshot
from dustin.engine.worker.runner import Runner


def prefill_key(prompts: list[list[int]], dtype: torch.dtype) -> tuple:
    """What a prefill snapshot is valid for: the rows' prompts and the caches' dtype."""
    return tuple(tuple(p) for p in prompts), dtype


@dataclass
class PrefillState:
    """Prompt K/V of target (and draft: None when the batch that made it did not draft) and the first tokens."""

    key: tuple
    target_kv: KVSnapshot
    draft_kv: KVSnapshot | None
    first_tokens: torch.Tensor


class PrefillCache:
    """A caller-owned store of one prompt batch's prefill, which greedy batches over the same prompts share (the
    prompt caches are copied; how methods are compared side by side). Pass the same object to every
    `Engine.generate(prefill_cache=...)` that may share; without one nothing is kept, so no call's result depends
    on an earlier call."""

    def __init__(self) -> None:
        self.state: PrefillState | None = None

    def lookup(self, key: tuple) -> PrefillState | None:
        return self.state if self.state is not None and self.state.key == key else None

    def store(self, state: PrefillState) -> None:
        self.state = state

    def clear(self) -> None:
        self.state = None


def _key(runner: Runner) -> tuple:
    b = runner.batch
    return prefill_key(b.prompts, b.target_cache.k.dtype)


class SharedPrefill:
    """A gang's prefill through a `PrefillCache`: when the cache holds this batch's prompts, their caches are copied
    in (the target's, and the draft's when kept; else the draft prefills its prompts itself and its caches are added
    to the snapshot) with the first tokens, and a policy that observes the prefill sees each prompt's last query
    again; otherwise the prefill is computed and left in the cache for the next batch. A policy
    that must see its own whole prefill (`needs_own_prefill`, SnapKV's window) always computes it."""

    def __init__(self, cache: PrefillCache) -> None:
        self.cache = cache

    def __call__(self, runner: Runner) -> None:
        b, p, kv = runner.batch, runner.prefiller, runner.kv
        rows = p.begin_gang()
        assert rows == list(range(b.B)), "a shared prefill wants every row admitted"
        key = _key(runner)
        reuse = None if runner.policy.needs_own_prefill else self.cache.lookup(key)
        if reuse is None:
            p.prefill_rows(rows)
            p.activate_gang(rows)
            n = max(len(q) for q in b.prompts)
            draft = kv.snapshot("draft", n) if "draft" in kv.caches else None
            self.cache.store(PrefillState(key, kv.snapshot("target", n), draft, b.pending.clone()))
            return
        kv.restore("target", reuse.target_kv)
        draft_missing = b.draft_cache is not None and reuse.draft_kv is None
        if draft_missing:
            p.prefill_rows(rows, target=False)
        b.pending.copy_(reuse.first_tokens)
        if runner.policy.observes_prefill:
            p.observe_last_tokens(rows)
        if b.draft_cache is not None and reuse.draft_kv:
            kv.restore("draft", reuse.draft_kv)
        p.activate_gang(rows)
        if draft_missing:  # the next batch over these prompts copies the draft's caches too (the target's shared:
            # at 20 x 64k a second copy of a 1.5B target's would be 37 GB)
            n = max(len(q) for q in b.prompts)
            self.cache.store(PrefillState(key, reuse.target_kv, kv.snapshot("draft", n), b.pending.clone()))


class NoisePrefill:
    """A gang's prefill for benchmarks: the prompt caches filled with noise and random first tokens instead of
    computed (a decode step's cost does not depend on the values, and a 70B prefill of 16 x 32k would take
    minutes); a policy that observes the prefill sees each prompt's last query over the noise."""

    def __call__(self, runner: Runner) -> None:
        b, p = runner.batch, runner.prefiller
        rows = p.begin_gang()
        assert rows == list(range(b.B)), "a noise prefill wants every row admitted"
        runner.kv.fill_noise(max(len(q) for q in b.prompts), b.generator)
        b.pending.copy_(torch.randint(0, b.V, (b.B,), device=b.device, generator=b.generator))
        if runner.policy.observes_prefill:  # its first step's state, from the last prompt token's query
            p.observe_last_tokens(rows)
        p.activate_gang(rows)
