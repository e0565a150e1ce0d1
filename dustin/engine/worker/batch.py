"""The batch's per-row state, on the host and on the device: what the runner's parts share and what the selection
policies read (`BatchState` implements `selection.base.StepState`, so a policy is handed this object, never the
runner).

A row is idle (a 1-position junk context that the step's forwards still run over, masked as done), prefilling
(admitted: its prompt is cached chunk by chunk), decoding, or stopped (its sequence ended; it keeps decoding
masked as done, its length frozen, until it is released). The invariant, for target and draft alike: the KV cache
holds every committed token of a row except the last one, `pending`, which the next forward reads.

Γ per row: each row has its own Γ_r in [min_gamma, gamma] (gamma = cfg.gamma, what the caches are sized for); a
step runs G = the largest Γ_r of its decoding rows (`step_gamma`). A row at Γ_r = 0 takes plain steps; its draft
cache then lags one position per such step (`draft_lag`), which the draft's catch-up writes before the row drafts
again (worker/prefill.py).
"""
from __future__ import annotations

import torch

from dustin.cache.kv_cache import KVCache
from dustin.engine.config import GenerationConfig
from dustin.engine.kv_manager import cache_capacity
from dustin.engine.request import SamplingRule
from dustin.engine.sampling import GREEDY, RowSampling
from dustin.engine.timing import PhaseTimer
from dustin.models.transformer import Transformer


class BatchState:
    """Every row's state (see the module's docstring). Fixed for the batch: B, gamma, max_new_tokens, device,
    target / draft, the caches, cfg, vocab V, min_gamma. Per row on the device: target_cache.lengths, pending, prev,
    done, row_gamma; on the host: finished, prompts, host_lengths, tokens (prompt, then every token read back),
    draft_lag, seeds, and the prompt of each row still prefilling with its count of cached tokens. Set by each
    step before the policy plans: verify_input, verify_positions. The batch's sampling (`sampler`, `generator`)
    and phase timer (`timer`) live here too: the device step, the prefill and the policies all use them.

    `shared`: the rule of the rows that draw from the batch's generator (seeded with cfg.seed) instead of each
    from its own stream, and of idle rows: greedy for the server, whose rows must not depend on each other; an
    offline batch given one `SamplingParams` for all its prompts passes that one's rule."""

    def __init__(self, target: Transformer, draft: Transformer | None, cfg: GenerationConfig, vocab_limit: int,
                 caches: dict[str, KVCache], max_new_tokens: int, min_gamma: int,
                 shared: SamplingRule = GREEDY) -> None:
        self.target, self.draft, self.cfg = target, draft, cfg
        self.V = vocab_limit
        self.device = target.embed_tokens.weight.device
        self.target_cache = caches["target"]
        self.draft_cache = caches.get("draft") if cfg.spec.speculative else None
        self.B = self.target_cache.batch_size
        self.gamma = cfg.gamma if cfg.spec.speculative else 0
        self.max_new_tokens = max_new_tokens
        self.min_gamma = min_gamma
        self._row_gamma = [self.gamma] * self.B  # host copy of `row_gamma`
        self.row_gamma = torch.full((self.B,), self.gamma, dtype=torch.long, device=self.device)
        self.draft_lag = [0] * self.B
        self.tokens: list[list[int]] = [[] for _ in range(self.B)]
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.shared = shared
        self.sampler = RowSampling(self.B, shared, self.generator, seed=cfg.seed)
        self.timer = PhaseTimer(self.device)
        self.finished = [True] * self.B  # rows that do not decode: idle or prefilling
        self.prompts: list[list[int]] = [[] for _ in range(self.B)]
        self.seeds: list[int | None] = [None] * self.B
        self.verify_input: torch.Tensor | None = None
        self.verify_positions: torch.Tensor | None = None
        self.idle()

    def idle(self) -> None:
        """Every row idle: a 1-position junk context (length 1 keeps the first draft forward's [prev, pending]
        positions >= 0), excluded from output and stopping."""
        self.prompt_rows: dict[int, list[int]] = {}  # rows still prefilling: their prompt
        self.prefilled: dict[int, int] = {}  # and how many of its tokens are cached
        self.target_cache.lengths.fill_(1)
        self.host_lengths = [1] * self.B
        self.pending = torch.zeros(self.B, dtype=torch.long, device=self.device)
        self.prev = torch.zeros(self.B, dtype=torch.long, device=self.device)
        self.done = torch.ones(self.B, dtype=torch.bool, device=self.device)

    # ---------------------------------------------------------------- a row's life
    def admit(self, row: int, prompt: list[int], limit: int, params: SamplingRule | None, seed: int | None) -> None:
        """An idle row takes a new sequence (checked at the edge: `EngineCore.check_request`)."""
        assert self.finished[row] and row not in self.prompt_rows, f"row {row} is not idle"
        assert 1 <= limit <= self.max_new_tokens, (limit, self.max_new_tokens)
        assert cache_capacity([len(prompt)], [limit], self.gamma) <= self.target_cache.capacity, (len(prompt), limit)
        self.prompt_rows[row], self.prefilled[row] = list(prompt), 0
        self.prompts[row] = list(prompt)
        self.sampler.set_row(row, params or self.shared, seed, self.device)
        self.seeds[row] = seed

    def reseed(self, row: int) -> None:
        """A seeded row's draws start at its first token: steps that ran while it prefilled advanced its counter
        too, and how many ran depends on what else was running."""
        if self.seeds[row] is not None:
            self.sampler.set_row(row, self.sampler.params[row], self.seeds[row], self.device)

    def activate(self, row: int) -> None:
        """The row's prompt is cached and its first token chosen (in `pending`): it decodes from the next step."""
        prompt = self.prompt_rows.pop(row)
        del self.prefilled[row]
        self.prev[row] = prompt[-1]
        self.target_cache.lengths[row] = self.host_lengths[row] = len(prompt)
        self.done[row] = False
        self.finished[row] = False
        self.tokens[row] = list(prompt)
        self.draft_lag[row] = 0  # the prefill wrote the draft's cache of the whole prompt

    def set_cached(self, row: int, n: int) -> None:
        """A prefilling row has n prompt tokens cached; its length is one past them, so the step's forwards over it
        write their junk past the prefix, where the next chunk overwrites it."""
        self.prefilled[row] = n
        self.target_cache.lengths[row] = self.host_lengths[row] = n + 1

    def stop(self, row: int) -> None:
        """The row's sequence stopped: the row stops decoding (its cache length freezes) until it is released."""
        self.finished[row] = True
        self.done[row] = True

    def release(self, row: int) -> None:
        """The row becomes idle (its sequence finished, or was aborted mid-prefill or mid-decode)."""
        self.prompt_rows.pop(row, None)
        self.prefilled.pop(row, None)
        self.prompts[row] = []
        self.stop(row)
        self.target_cache.lengths[row] = 1
        self.host_lengths[row] = 1
        self.sampler.set_row(row, self.shared, None, self.device)
        self.tokens[row] = []
        self.draft_lag[row] = 0
        if self._row_gamma[row] != self.gamma:
            self.set_gamma(row, self.gamma)

    def book(self, row: int, first: int | None, new: list[int]) -> None:
        """A step's tokens of the row reached the host: its first token (when this step carried it) and the
        accepted drafts with the next token."""
        self.host_lengths[row] += len(new)
        self.tokens[row] += ([first] if first is not None else []) + new

    # ---------------------------------------------------------------- Γ per row
    def set_gamma(self, row: int, gamma: int) -> None:
        """The row's own Γ from its next step on, in [min_gamma, gamma]."""
        if not self.cfg.spec.speculative:
            raise ValueError("a method without a draft has no Γ")
        if not self.min_gamma <= gamma <= self.gamma:
            raise ValueError(f"Γ of row {row} must be in [{self.min_gamma}, {self.gamma}], got {gamma}")
        if gamma != self._row_gamma[row]:
            self._row_gamma[row] = gamma
            self.row_gamma[row] = gamma  # in place, queued behind any step in flight (a graph reads this tensor)

    def row_gamma_of(self, row: int) -> int:
        return self._row_gamma[row]

    def restore_row_gamma(self) -> None:
        """The device copy of every row's Γ from the host's (after a measurement changed it for all rows)."""
        self.row_gamma.copy_(torch.tensor(self._row_gamma))

    @property
    def step_gamma(self) -> int:
        """G of the next step: the largest Γ of the rows that decode (gamma when none does)."""
        if not self.cfg.spec.speculative:
            return 0
        return max((self._row_gamma[b] for b in self.active_rows), default=self.gamma)

    @property
    def active_rows(self) -> list[int]:
        return [b for b in range(self.B) if not self.finished[b]]

    @property
    def prefilling_rows(self) -> set[int]:
        return set(self.prompt_rows)

    def catch_up_rows(self) -> list[int]:
        """Rows that draft in the next step and whose draft cache lags (their plain steps were not written by it)."""
        return [b for b in self.active_rows if self.draft_lag[b] and self._row_gamma[b] > 0]

    def lag_plain_rows(self, rows: list[int]) -> None:
        """A step was launched for `rows`: each at Γ = 0 counts its draft cache as not written at the step's first
        position, whether a draft forward ran for other rows or none ran, so that the catch-up writes it the same
        way whatever ran beside the row."""
        if self.cfg.spec.speculative:
            for b in rows:
                if self._row_gamma[b] == 0:
                    self.draft_lag[b] += 1
