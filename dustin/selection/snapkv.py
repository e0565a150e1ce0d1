"""`snapkv`: SnapKV (Li et al. 2024) as a verification policy, a baseline whose per-layer, per-KV-head set is
chosen ONCE from the prompt and then fixed (prompt-time compression).

Selection, at prefill, for every layer l and KV head h of the target: the queries of the prompt's last
W = `SNAPKV_WINDOW` (32) tokens, the observation window, score every earlier prompt position with their exact
softmax attention (`causal_probs`: the softmax runs over all keys each window query sees, as in SnapKV), summed
over the W window queries and over the G = Hq / Hkv query heads of h's group. The row of the n - W earlier
positions is smoothed by a 1-D max-pool (kernel `SNAPKV_KERNEL` = 7, stride 1, same padding: SnapKV's default
pooling) and its top k - W positions plus the window itself form (l, h)'s prompt set. Sinks get no special case
(SnapKV keeps what scores). Ties of the pooled row (the max-pool makes plateaus) go to the lower position (a
stable sort), so the set does not depend on the device's top-k. Prompts of at most k tokens keep every position.
k must exceed W (SnapKV's own requirement: the window alone takes W of the k slots).

Budget accounting. SnapKV evicts the prompt's cache down to its set and appends every generated token
uncompressed. dustin never evicts (the full cache stays; the target verifies against a selected subset), so here
the prompt set stays fixed for the whole generation and every position generated after the prompt,
[prompt_len_b, lengths[b]), is always attended: the verify set of sequence b is min(k, prompt_len_b) prompt
positions + the generated ones, i.e. the effective budget GROWS by one per generated token (up to
k + max_new_tokens + Γ), exactly as SnapKV's cache does. Fixed-k policies at the same --budget read fewer
positions once the generation is long.

Buffers (fixed size, allocated at the session's first prefill call; no host sync afterwards):
- prompt picks `indices` int32 [L, B, Hkv, K_max], sorted ascending, 0 past `counts` int32 [L, B, Hkv];
  `prompt_lengths` int32 [B];
- K_max = min(k, longest prompt) + G_max, where G_max = max_new_tokens + Γ + 1 bounds the generated positions a
  sequence can hold in the cache (an unfinished sequence holds at most max_new_tokens - 2, and the step that
  finishes it adds at most Γ + 1); the generated count is clamped to G_max anyway. Memory: 4·L·B·Hkv·K_max
  bytes per buffer (and per step-temporary of `plan`), e.g. 28 layers x B 16 x Hkv 8 x (512 + 160) x 4 B = 9.2 MiB.
Each step, `plan` assembles the lists of all layers at once with a few elementwise ops on the device: slot s of
(l, b, h) holds prompt pick s while s < counts[l, b, h], then the generated position prompt_len_b + (s - counts)
while that is < lengths[b], then 0 (padding). Prompt picks are < prompt_len_b <= every generated position, so
the list is sorted and every entry is < lengths[b], as `sparse_mask` and `sparse_verify_attention` want.
The planner is per layer (a `LayerPlanner`), so the verify forward runs eagerly (no CUDA graph), like Quest.

A reused prefill (`SharedPrefill`, dustin/engine/offline/prefill.py) copies the prompt caches and re-runs only the
LAST prompt token, so an observer would see one query per sequence, not the window. A policy with `needs_own_prefill`
(this one) therefore never gets one: `Engine.generate(..., prefill_cache=...)` runs snapkv's own full prefill
(identical caches, so its own state is saved for the methods that follow), and its output equals a run without
reuse. A noise-filled prefill leaves it nothing to observe: it raises InputError.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from dustin.attention.context import ForwardContext, SparsePlan
from dustin.errors import InputError
from dustin.scoring import causal_probs
from dustin.selection.base import SelectionPolicy, StepState
from dustin.selection.config import SparseConfig

SNAPKV_WINDOW = 32  # observation window: the prompt's last W queries score the rest, and are always kept
SNAPKV_KERNEL = 7  # max-pool kernel (stride 1, same padding) smoothing the scores before the top-k
_CHUNK_BYTES = 256 * 2**20  # bound on the fp32 window probabilities materialized at once (KV heads per chunk)

_OWN_PREFILL = ("snapkv needs its own prefill: it scores the prompt with the queries of the prompt's last "
                f"{SNAPKV_WINDOW} tokens, which a reused (or random) prefill does not compute; run the session "
                "without a reused / random prefill")


def snapkv_prompt_set(q: torch.Tensor, k_cache: torch.Tensor, budget: int, window: int = SNAPKV_WINDOW,
                      kernel: int = SNAPKV_KERNEL) -> torch.Tensor:
    """SnapKV's prompt set of one sequence at one layer: q [Hq, n, D] the post-RoPE queries of the whole prompt,
    k_cache [Hkv, >= n, D] the layer's keys. Returns int64 [Hkv, min(n, budget)], each row sorted ascending:
    the top budget - window positions of [0, n - window) by max-pooled window attention, then the window."""
    Hq, n, _ = q.shape
    Hkv = k_cache.shape[0]
    if n <= budget:
        return torch.arange(n, device=q.device).expand(Hkv, n)
    G = Hq // Hkv
    prefix = n - window  # n > budget > window
    pos = torch.arange(prefix, n, device=q.device)[None]  # [1, W]
    scores = torch.empty(Hkv, prefix, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_BYTES // (G * window * n * 4))
    for h0 in range(0, Hkv, step):
        h1 = min(Hkv, h0 + step)
        probs = causal_probs(q[None, h0 * G:h1 * G, prefix:], k_cache[None, h0:h1, :n], pos)[0]  # [hG, W, n]
        scores[h0:h1] = probs[:, :, :prefix].unflatten(0, (h1 - h0, G)).sum(dim=(1, 2))
    pooled = F.max_pool1d(scores[None], kernel, stride=1, padding=kernel // 2)[0]  # [Hkv, n - W]
    top = torch.sort(pooled, dim=-1, descending=True, stable=True).indices[:, : budget - window]
    win = torch.arange(prefix, n, device=q.device).expand(Hkv, window)
    return torch.cat([top.sort(dim=-1).values, win], dim=-1)


class SnapKVPrefillObserver:
    """Target `QueryObserver` for the prefill forwards (each row's whole prompt in one piece,
    `ForwardContext.prompt_pieces`): stores each layer's SnapKV prompt set of that row in the fixed buffers
    described in the module docstring."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, budget: int, max_prompt: int,
                 max_generated: int, device) -> None:
        self.layers = frozenset(range(n_layers))
        self.budget = budget
        self.max_generated = max_generated
        self.k_max = min(budget, max_prompt) + max_generated
        self.indices = torch.zeros(n_layers, batch, n_kv_heads, self.k_max, dtype=torch.int32, device=device)
        self.counts = torch.zeros(n_layers, batch, n_kv_heads, dtype=torch.int32, device=device)
        self.prompt_lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.seen = [False] * batch  # host-side: rows whose prefill was observed (no device sync to check)

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext) -> None:
        if not ctx.prompt:  # the reused-prefill path: one query per sequence, not the window
            raise InputError(_OWN_PREFILL)
        for b, q_b, k_b, pos0 in ctx.prompt_pieces(q, k_cache):
            if pos0 != 0:  # a later chunk of a prompt: the window needs the whole prompt in one piece
                raise InputError(_OWN_PREFILL)
            n = q_b.shape[2]
            picks = snapkv_prompt_set(q_b[0], k_b[0], self.budget)
            c = picks.shape[1]
            self.indices[layer, b, :, :c] = picks
            self.indices[layer, b, :, c:] = 0
            self.counts[layer, b] = c
            self.prompt_lengths[b] = n
            self.seen[b] = True


class SnapKVSelection(SelectionPolicy):
    """SnapKV's prompt set per (layer, KV head), fixed after prefill, plus every generated position."""

    name = "snapkv"
    observes_prefill = True
    needs_own_prefill = True  # the Engine never gives it a reused prefill (see the module docstring)

    def __init__(self, cfg: SparseConfig) -> None:
        if cfg.budget <= SNAPKV_WINDOW:
            raise InputError(f"snapkv needs --budget > {SNAPKV_WINDOW} (its observation window of {SNAPKV_WINDOW} "
                             f"positions is always kept), got {cfg.budget}")
        self.cfg = cfg
        self.prefill: SnapKVPrefillObserver | None = None
        self._owner = None  # weakref to the session the buffers belong to
        self._decoding = False
        self._plans: list[SparsePlan] = []

    def begin_gang(self, state: StepState) -> None:
        self.prefill = None  # the new gang's prompts are scored by its own prefill
        self._decoding = False

    def _setup(self, state: StepState) -> SnapKVPrefillObserver:
        if self.prefill is None or self._owner() is not state:
            a = state.target.args
            self.prefill = SnapKVPrefillObserver(
                a.n_layers, state.B, a.n_kv_heads, self.cfg.budget, max(len(p) for p in state.prompts),
                state.max_new_tokens + state.gamma + 1, state.device)
            self._owner = weakref.ref(state)
            self._decoding = False
            self._slots = torch.arange(self.prefill.k_max, dtype=torch.int32, device=state.device)
        return self.prefill

    # the prompt's layers are scored during prefill only; decode steps pass no observer (no per-layer call)
    def target_observers(self, state: StepState):
        obs = self._setup(state)
        return [] if self._decoding else [obs]

    def begin_step(self, state: StepState) -> None:
        obs = self._setup(state)
        if not self._decoding and not all(seen or not p for seen, p in zip(obs.seen, state.prompts, strict=True)):
            raise InputError(_OWN_PREFILL)
        self._decoding = True

    @property
    def indices(self) -> torch.Tensor:
        """Prompt picks int32 [L, B, Hkv, K_max] (sorted, 0 past counts)."""
        return self.prefill.indices

    @property
    def counts(self) -> torch.Tensor:
        """Number of prompt picks int32 [L, B, Hkv]."""
        return self.prefill.counts

    def plan(self, state: StepState) -> SnapKVSelection:
        obs = self._setup(state)
        state.timer.start("select")
        n = obs.prompt_lengths
        gen = (state.target_cache.lengths - n).clamp(0, obs.max_generated)  # [B] generated, cached positions
        t = self._slots - obs.counts[..., None]  # [L, B, Hkv, K_max]: slot index past the prompt picks
        tail = (t >= 0) & (t < gen[None, :, None, None])
        idx = torch.where(tail, n[None, :, None, None] + t, obs.indices)
        counts = obs.counts + gen[None, :, None]
        self._plans = [SparsePlan(idx[layer], counts[layer]) for layer in range(idx.shape[0])]
        state.timer.stop("select")
        return self

    def plan_layer(self, layer: int, q: torch.Tensor, ctx) -> SparsePlan:
        return self._plans[layer]
