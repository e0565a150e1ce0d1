"""The engine's batch on the device: KV-cache rows that sequences join and leave, and the speculative step.

Invariant (target and draft alike): the KV cache holds every committed token of a sequence except the last
one, `pending`, whose K/V is computed by the next forward. A speculative step:
  1. draft G tokens: the first draft forward re-reads [prev, pending] (two tokens, so the draft cache is
     right whether or not the previous step accepted all drafts), then one token per forward;
  2. the selection policy plans the verify attention (None = full cache);
  3. the target verifies [pending, d1..dG] in one forward and accepts a prefix (greedy or lossless sampling);
  4. cache lengths advance by 1 + accepted; rejected rows are simply overwritten later (rollback is free).
One host sync per step reads the accepted tokens back for stopping and output. The loop that drives the steps is
`EngineCore.step` (dustin/engine/core.py); this module runs none.

Γ per row (`set_gamma`, `--gamma auto`): each row has its own Γ_r in [0, Γ] (Γ = cfg.gamma, what the caches are
sized for). A step runs G = the largest Γ_r of its rows draft forwards (each of the same shape whatever G is), then
one verify forward of Γ + 1 tokens whatever G is (padding past G): so no forward's shape, and no row's numbers,
depend on the G its neighbours chose. A row whose Γ_r < G accepts at most Γ_r drafts, its next token is the
target's at slot Γ_r when it accepted them all, the policy's draft scores leave its lookahead queries past Γ_r out
(`StepState.row_gamma`), and its sampling counter advances by the same number of draws whatever G is: its tokens
are those of a step of Γ_r, whichever rows run beside it. Each G has its own step graph. Γ_r = 0 (a plain step:
no draft forward for the row's sake, its token the target's at slot 0) is for policies that verify against the
full cache (`SelectionPolicy.full_verify`), whose tokens do not depend on the drafts, and under `--gamma auto`
for policies whose plans are one `SparsePlan` (`dense_rows`: dustin, streaming): their plain rows are verified
against the whole cache (`SparsePlan.dense`), since no draft chooses their positions. A step of G = 0 runs no
draft forward, so the draft's cache falls behind by one token per such step, and the next step of G > 0 first
writes the missing positions with one packed draft-only prefill (`catch_up_pending`: it needs every earlier step
read back, since it feeds the tokens those steps chose).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dustin.attention.context import SparsePlan
from dustin.engine.config import GenerationConfig
from dustin.engine.cuda_graphs import StepGraph
from dustin.engine.draft_step import DraftStep, EagerDraftStep
from dustin.engine.kv_manager import KVManager
from dustin.engine.logprobs import HostLogprobs, head_logprobs, token_logprobs
from dustin.engine.model_runner import ModelRunner
from dustin.engine.request import MAX_LOGPROBS, Logprob
from dustin.engine.sampling import RowSampling, SamplingRule, accept_controlled
from dustin.engine.timing import NullTimer, PhaseTimer
from dustin.kernels import draft_decoder
from dustin.models.transformer import Transformer
from dustin.selection.base import FullSelection, SelectionPolicy


@dataclass
class RowTokens:
    """What one step gave a row: the first token (chosen by the row's prefill, read back with its first step) or
    None, then the accepted drafts and the next token; with the row's log-probabilities when it asked for them:
    (values [1 + N], token ids [N]) per token, the first token's first."""

    row: int
    first: int | None
    tokens: list[int]
    logprobs: list[tuple[list[float], list[int]]] | None = None


def cache_capacity(prompt_lens: list[int], limits: list[int], gamma: int) -> int:
    """KV positions per sequence a generation allocates: the longest prompt + its new tokens + 3Γ + 4. The one
    place this arithmetic lives. Why 3Γ + 4, for a prompt of n tokens and a limit of m: a sequence still running
    has at most n + m - 2 cached positions (its newest token, `pending`, is not cached yet); its last step adds
    up to Γ + 1 (drafts accepted past the limit are dropped from the output, not from the cache); in
    the engine loop the device learns of the stop one step late, so one more step adds up to Γ + 1 again: the
    length freezes at <= n + m + 2Γ. A frozen row still runs every step's forwards, which write Γ + 1 junk rows
    from its length on: up to position n + m + 3Γ, so n + m + 3Γ + 1 positions; + 3 spare. (The CUDA-graph
    warm-up scratch of `GraphedForward`, Γ + 1 rows at the tail, is only written at capture, when no row is
    anywhere near the tail; junk of frozen rows may land there later, which is harmless.)"""
    return max(n + m for n, m in zip(prompt_lens, limits, strict=False)) + 3 * gamma + 4


def prefill_key(prompts: list[list[int]], dtype: torch.dtype) -> tuple:
    """What a prefill snapshot is valid for: the rows' prompts and the caches' dtype."""
    return tuple(tuple(p) for p in prompts), dtype


@dataclass
class PrefillState:
    """Prompt K/V of target (and draft) and the first token, reusable by a later greedy session."""

    key: tuple
    target_kv: tuple[torch.Tensor, torch.Tensor]
    draft_kv: tuple[torch.Tensor, torch.Tensor] | None
    first_tokens: torch.Tensor


class PrefillCache:
    """A caller-owned store of one prompt batch's prefill, which greedy sessions over the same prompts share (the
    prompt caches are copied; how methods are compared side by side). Pass the same object to every
    `Engine.session` / `Engine.generate(prefill_cache=...)` that may share; without one nothing is kept, so no
    call's result depends on an earlier call."""

    def __init__(self) -> None:
        self.state: PrefillState | None = None

    def lookup(self, key: tuple) -> "PrefillState | None":
        return self.state if self.state is not None and self.state.key == key else None

    def store(self, state: "PrefillState") -> None:
        self.state = state

    def clear(self) -> None:
        self.state = None


class Session:
    """The device half of the engine's batch: `slots` rows of `capacity` KV positions that sequences join
    (`admit`, then `prefill` chunks or one `prefill_gang`) and leave (`release`) between steps, and the step
    itself (`launch` / `complete`). It holds no request queue and runs no loop: `EngineCore.step` drives it."""

    def __init__(self, target: Transformer, draft: Transformer | None, cfg: GenerationConfig, vocab_limit: int,
                 policy: SelectionPolicy | None = None, *, kv: KVManager, max_new_tokens: int | None = None
                 ) -> None:
        """cfg: the batch's decoding settings (Γ, defaults of the rows' sampling, graphs and overlap). kv: the
        batch's caches (a row per slot): "target", and "draft" when `draft` drafts. max_new_tokens: the most new
        tokens a row may ask (None: cfg.max_new_tokens); a row's prompt and new tokens must also fit its slot."""
        self.target, self.draft, self.cfg = target, draft, cfg
        self.spec = cfg.spec
        self.V = vocab_limit
        self.policy = policy or FullSelection()
        self.device = target.embed_tokens.weight.device
        self.kv = kv
        self.B = kv.slots
        self.gamma = cfg.gamma if self.spec.speculative else 0
        self.max_new_tokens = max_new_tokens or cfg.max_new_tokens
        # each row's own Γ (host, and the device copy the step reads: `set_gamma`); the draft positions each
        # row's cache lacks after steps that ran no draft forward (G = 0), and each row's tokens so far (prompt,
        # then every token read back: what the draft's catch-up feeds)
        self._row_gamma = [self.gamma] * self.B
        self.row_gamma = torch.full((self.B,), self.gamma, dtype=torch.long, device=self.device)
        self._draft_lag = [0] * self.B
        # --gamma auto with a policy of shared sparse plans: rows at Γ = 0 are verified against the whole cache
        self.dense_plain = cfg.gamma_auto and self.policy.dense_rows and not self.policy.full_verify
        self._tokens: list[list[int]] = [[] for _ in range(self.B)]
        self._unread = 0  # steps launched and not yet read back
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.sampler = RowSampling(self.B, cfg.sampling, self.generator, seed=cfg.seed)
        self.timer = PhaseTimer(self.device)
        # rows that do not decode: idle or still prefilling (a row whose sequence stopped decodes until released)
        self.finished = [True] * self.B
        self.prompts: list[list[int]] = [[] for _ in range(self.B)]  # each row's prompt (StepState.prompts)
        # CUDA graphs for the fixed-shape step forwards (GPU + Triton backend; policies whose observers and plans
        # are graph-safe: fixed-address buffers, one index set for all layers)
        self.use_graphs = (self.device.type == "cuda" and cfg.options.cuda_graphs and target.backend.name == "triton"
                           and self.policy.graph_safe)
        self._graphs: dict[tuple[str, int], StepGraph] = {}  # one per (sampling mode (RowSampling.mode), G)
        # host staging of the steps (two of each: a step's output is read back while the next one runs)
        pinned = self.device.type == "cuda"
        self._out_stage = [torch.zeros(self.B, 3 + self.gamma, dtype=torch.long, pin_memory=pinned)
                           for _ in range(2)]
        self._staged_gamma = [0, 0]  # the G of the step staged in each slot
        self._ready = [torch.cuda.Event() if pinned else None for _ in range(2)]
        # per row: an epoch (bumped when a row changes hands, so a step launched before that is not booked to
        # the new request) and whether its first token (chosen by its prefill) is still to be read back: it
        # comes back with the row's next step, so completing a prefill needs no host sync
        self._epoch = [0] * self.B
        self._fresh = [False] * self.B
        self._live: list[list[tuple[int, int, bool]]] = [[], []]  # rows each staged step was launched for
        # log-probabilities (dustin/engine/logprobs.py): rows that asked, with their top-N, for generated and for
        # prompt tokens; the prompt's per row (the generated ones go back with each step's tokens). A step computes
        # them (for every row) only while some row asks: a step graph of its own per sampling mode
        self._lp_rows: dict[int, int] = {}
        self._plp_rows: dict[int, int] = {}
        self._prompt_lp: dict[int, HostLogprobs] = {}
        self._lp_on = False  # whether the step being launched computes them
        self._lp_first: tuple[torch.Tensor, torch.Tensor] | None = None  # a row's first token's, from its prefill
        self._lp_stage: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]  # host, per staged step
        self._lp_staged = [False, False]
        # n sequences of one prompt: rows waiting for a row's prompt cache (copied when its prefill completes)
        self._prefix_wait: dict[int, list[int]] = {}
        self._seeds: list[int | None] = [None] * self.B  # each row's request seed
        self._slot = 0
        self._graph_warm: set[tuple[str, int]] = set()  # (mode, G) whose eager first step ran
        self._warmup_s = 0.0
        for model in (target, draft):
            if model is not None:
                model.set_fused_ops(cfg.options.fused_ops)
        self.runners = {"target": ModelRunner(target, kv.caches["target"], self.use_graphs)}
        if self.spec.speculative:
            self.runners["draft"] = ModelRunner(draft, kv.caches["draft"], self.use_graphs)
            sinks, window = (cfg.draft_sinks, cfg.draft_recent) if cfg.draft_kv == "streaming" else (0, 0)
            # the persistent layer kernel (opt-in); never for the warm-up's fake twin, which leaves the models as
            # they were (dustin/engine/warmup.py), so a real session's kernel stays attached
            if not draft_decoder.is_fake(kv.caches["draft"].k):
                draft.layer_kernel = None
                if cfg.options.draft_kernel and self.device.type == "cuda" and window > 0:
                    # a step's draft forwards; greedy ones also choose their tokens in the launch
                    draft_decoder.attach(draft, sinks, window, rows=(self.B, 2 * self.B), vocab=self.V)
            self.draft_step: DraftStep = EagerDraftStep(self.runners["draft"], self.sampler, self.V, self.gamma,
                                                        sinks, window)
        self.target_cache = self.runners["target"].cache
        self.draft_cache = self.runners["draft"].cache if self.spec.speculative else None
        self._idle_state()

    # ---------------------------------------------------------------- gang prefill
    @torch.inference_mode()
    def prefill_gang(self, fill: str = "whole", reuse: "PrefillState | None" = None) -> "PrefillState | None":
        """Prefill the whole prompt of every admitted row at once: the prefill of a gang admission (a batch that is
        admitted together and that nothing joins; `Scheduler`). `fill`:
        - "whole": each prompt through the target (and the draft), one sequence at a time, with the policy's target
          observers watching: policies with whole-batch state (quest, specattn, snapkv, oracle) build it here;
        - "snapshot": copy the prompt caches of an earlier gang over the same prompts (`reuse`, from
          `prefill_state`), so that methods compared side by side share one prefill; without `reuse`, as "whole";
        - "noise": fill the prompt caches with noise instead of computing them (benchmarks with random weights:
          a decode step's cost does not depend on the values, and a 70B prefill of 16 x 32k would take minutes).
        "snapshot" and "noise" want every row admitted. The rows are active afterwards; their first tokens reach the
        host with the next step, as after a chunked prefill. Returns the snapshot it copied (None: computed)."""
        rows = sorted(self._prompt_rows)
        if not rows or any(self._prefilled[r] for r in rows):
            raise ValueError("prefill_gang wants admitted rows that no chunk prefilled yet")
        if fill not in ("whole", "snapshot", "noise"):
            raise ValueError(f"fill must be whole, snapshot or noise, got {fill!r}")
        if fill != "whole" and rows != list(range(self.B)):
            raise ValueError(f"a {fill} prefill wants every row admitted")
        prompts = [self._prompt_rows[r] for r in rows]
        n_max = max(len(p) for p in prompts)
        self.policy.begin_gang(self)
        if fill == "noise":
            reuse = self._random_prefill_state(n_max)
        elif fill == "whole" or self.policy.needs_own_prefill:  # e.g. snapkv scores the prompt's own prefill
            reuse = None
        for row in rows:
            if self._seeds[row] is not None:  # a seeded row's draws start at its first token
                self.sampler.set_row(row, self.sampler.params[row], self._seeds[row], self.device)
        if reuse is not None and reuse.target_kv is not None:
            self.kv.restore("target", reuse.target_kv)
        run_draft = self.draft_cache is not None and (reuse is None or reuse.draft_kv is None)
        for row, prompt in zip(rows, prompts if reuse is None or run_draft else (), strict=False):
            chunk = [(row, 0, prompt)]  # one sequence at a time: a packed prefill of one whole-prompt chunk
            if reuse is None:
                logits = self.runners["target"].prefill_packed(chunk, 0, 1, self.policy.target_observers(self))
                logits = logits[:, : self.V]
                self.pending[row:row + 1].copy_(self.sampler.choose_row(row, logits))
                if row in self._lp_rows:
                    self._first_logprobs(row, logits[0])
            if run_draft:
                self.runners["draft"].prefill_packed(chunk, 0, 1)
        if reuse is not None:
            self.pending.copy_(reuse.first_tokens)
            if self.policy.observes_prefill:  # let the policy see the last prompt token's query again
                last = torch.tensor([[p[-1]] for p in prompts], device=self.device)
                L = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int32, device=self.device)
                self._forward("target", last, L.long()[:, None], L, n_max, observers=self.policy.target_observers(self))
                self.policy.after_verify(self, torch.zeros(self.B, dtype=torch.long, device=self.device))
            if self.draft_cache is not None and reuse.draft_kv:
                self.kv.restore("draft", reuse.draft_kv)
        for row in rows:
            self._activate(row)
        return None if fill == "noise" else reuse

    def _activate(self, row: int) -> None:
        """The row's prompt is cached and its first token chosen (in `pending`): it decodes from the next step on,
        and its first token reaches the host with that step's output."""
        prompt = self._prompt_rows.pop(row)
        del self._prefilled[row]
        self._plp_rows.pop(row, None)
        self.prev[row] = prompt[-1]
        self.target_cache.lengths[row] = self.host_lengths[row] = len(prompt)
        self.done[row] = False
        self.finished[row] = False
        self._fresh[row] = True
        self._tokens[row] = list(prompt)
        self._draft_lag[row] = 0  # the prefill wrote the draft's cache of the whole prompt

    def _first_logprobs(self, row: int, logits: torch.Tensor) -> None:
        """The log-probabilities of the row's first token (under its prefill's last logits [V]), read back with the
        row's next step."""
        vals, ids = token_logprobs(logits, self.pending[row])
        self._lp_first[0][row].copy_(vals)
        self._lp_first[1][row].copy_(ids)

    # ---------------------------------------------------------------- slots (serving)
    def _idle_state(self) -> None:
        """Every row idle: a 1-position junk context (a step's forwards still run over idle rows; length 1 keeps
        the first draft forward's [prev, pending] positions >= 0), excluded from output and stopping."""
        self._prompt_rows: dict[int, list[int]] = {}
        self._prefilled: dict[int, int] = {}
        self.target_cache.lengths.fill_(1)
        self.host_lengths = [1] * self.B
        self.pending = torch.zeros(self.B, dtype=torch.long, device=self.device)
        self.prev = torch.zeros(self.B, dtype=torch.long, device=self.device)
        self.done = torch.ones(self.B, dtype=torch.bool, device=self.device)

    def admit(self, row: int, prompt: list[int], limit: int, params: SamplingRule | None = None,
              seed: int | None = None, *, logprobs: int | None = None, prompt_logprobs: int | None = None,
              prefix_from: int | None = None) -> None:
        """Give an idle row to a new sequence; its prompt is then prefilled by `prefill` calls.
        logprobs / prompt_logprobs: compute the log-probabilities of its generated / prompt tokens with that many
        most likely tokens each (`token_logprobs`, `prompt_logprobs()`). prefix_from: a row admitted with the same
        prompt and still prefilling; when its prefill completes, its cache of all prompt tokens but the last is
        copied into this row (target and draft), which then prefills only the last token itself (n sequences of
        one prompt share one prefill; this row's numbers are those of its own whole prefill)."""
        if not self.finished[row] or row in self._prompt_rows:
            raise ValueError(f"row {row} is not idle")
        if prefix_from is not None and self._prompt_rows.get(prefix_from) != list(prompt):
            raise ValueError(f"row {prefix_from} is not prefilling the same prompt")
        if not 1 <= limit <= self.max_new_tokens:
            raise ValueError(f"limit must be in [1, {self.max_new_tokens}], got {limit}")
        if cache_capacity([len(prompt)], [limit], self.gamma) > self.target_cache.capacity:
            raise ValueError(f"prompt {len(prompt)} + {limit} new tokens do not fit a slot of "
                             f"{self.target_cache.capacity} positions")
        self._prompt_rows[row], self._prefilled[row] = list(prompt), 0
        self.prompts[row] = list(prompt)
        self._epoch[row] += 1
        self._fresh[row] = False
        self.sampler.set_row(row, params or self.cfg.sampling, seed, self.device)
        self._seeds[row] = seed
        for want, rows in ((logprobs, self._lp_rows), (prompt_logprobs, self._plp_rows)):
            rows.pop(row, None)
            if want is not None:
                if not 0 <= want <= MAX_LOGPROBS:
                    raise ValueError(f"log-probabilities of at most {MAX_LOGPROBS} tokens, got {want}")
                rows[row] = want
        self._prompt_lp.pop(row, None)
        if prompt_logprobs is not None:
            self._prompt_lp[row] = HostLogprobs()
        if logprobs is not None and self._lp_first is None:
            self._lp_first = (torch.zeros(self.B, 1 + MAX_LOGPROBS, device=self.device),
                              torch.zeros(self.B, MAX_LOGPROBS, dtype=torch.long, device=self.device))
        if prefix_from is not None:
            self._prefix_wait.setdefault(prefix_from, []).append(row)

    @torch.inference_mode()
    def prefill(self, pieces: list[tuple[int, int]], pad_to: int = 0) -> None:
        """Prefill the next `n` prompt tokens of each admitted row in `pieces` [(row, n)], all rows in ONE forward
        of the target and one of the draft (dustin/kernels/prefill_attention.py: each chunk attends over its row's
        cached prefix), padded to `pad_to` tokens so the forward's shape does not depend on what is packed. A row
        may appear twice (consecutive chunks). A chunk that completes its prompt chooses the first token on the
        device and makes the row active; the token reaches the host with the row's next step (no sync here).
        Between chunks a row's cache length is one past the prefilled count, so the step's forwards over
        not-yet-active rows write their junk past the prefix, where the next chunk overwrites it."""
        chunks, done_rows = [], []
        for row, n in pieces:
            prompt, n0 = self._prompt_rows[row], self._prefilled[row]
            n1 = n0 + n
            if n < 1 or n1 > len(prompt):
                raise ValueError(f"row {row}: cannot prefill {n} tokens at {n0} of a {len(prompt)}-token prompt")
            chunks.append((row, n0, prompt[n0:n1]))
            self._prefilled[row] = n1
            if n1 == len(prompt):
                done_rows.append((len(chunks) - 1, row))
        observers = self.policy.target_observers(self) if done_rows else []
        at, targets, owners = self._prompt_logprob_positions(chunks)
        out = self.runners["target"].prefill_packed(chunks, pad_to, self.B, observers, hidden_at=at)
        if at:
            logits, hidden, head = out
            k = max(k for _, _, k in owners)
            tgt = torch.tensor(targets, dtype=torch.long).to(self.device)
            vals, ids = head_logprobs(head, hidden, tgt, k, self.V)
            i = 0
            for row, n, k_row in owners:
                self._prompt_lp[row].add(vals[i:i + n], ids[i:i + n], k_row)
                i += n
        else:
            logits = out
        logits = logits[:, : self.V]
        if "draft" in self.runners:
            self.runners["draft"].prefill_packed(chunks, pad_to, self.B)
        for row, _, _ in chunks:
            if row in self._prompt_rows and self._prefilled[row] < len(self._prompt_rows[row]):
                self.target_cache.lengths[row] = self.host_lengths[row] = self._prefilled[row] + 1
        for i, row in done_rows:
            prompt = self._prompt_rows[row]
            if self._seeds[row] is not None:
                # a seeded row's draws start at its first token: the steps that ran while it was prefilling
                # advanced its counter too, and how many ran depends on what else was running
                self.sampler.set_row(row, self.sampler.params[row], self._seeds[row], self.device)
            self.pending[row:row + 1].copy_(self.sampler.choose_row(row, logits[i:i + 1]))
            if row in self._lp_rows:
                self._first_logprobs(row, logits[i])
            self._activate(row)
            for other in self._prefix_wait.pop(row, ()):
                self._copy_prefix(row, other, len(prompt) - 1)

    def _prompt_logprob_positions(self, chunks: list[tuple[int, int, list[int]]]):
        """The packed-token indices whose logits give prompt log-probabilities in this forward (each position of a
        row that asked, but its prompt's last: that one's is its first generated token's), the prompt tokens they
        predict, and (row, positions, top-N) per chunk that has any."""
        at, targets, owners = [], [], []
        offset = 0
        for row, n0, toks in chunks:
            k = self._plp_rows.get(row)
            if k is not None:
                prompt = self._prompt_rows[row]
                stop = min(n0 + len(toks), len(prompt) - 1)
                if stop > n0:
                    at += range(offset, offset + stop - n0)
                    targets += prompt[n0 + 1:stop + 1]
                    owners.append((row, stop - n0, k))
            offset += len(toks)
        return at, targets, owners

    def _copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row `dst` (admitted with `prefix_from=src`) takes `src`'s cache of its first n prompt tokens and prefills
        the rest itself; the prompt's log-probabilities are `src`'s too."""
        self.kv.copy_prefix(src, dst, n)
        self._prefilled[dst] = n
        self.target_cache.lengths[dst] = self.host_lengths[dst] = n + 1
        if dst in self._prompt_lp and src in self._prompt_lp:
            self._prompt_lp[dst] = self._prompt_lp[src]
        self._plp_rows.pop(dst, None)

    def prompt_logprobs(self, row: int) -> list[Logprob | None] | None:
        """The prompt log-probabilities of the row's sequence (None for its first token), once its first token was
        read back (the device passed the prefill by then); None when it did not ask for them."""
        host = self._prompt_lp.get(row)
        return None if host is None else [None, *host.rows()]

    def begin_run(self, seed: int) -> None:
        """Start a new offline run on a kept batch (`Engine.generate` reuses one across calls, graphs and all):
        fresh timers, and the generators reseeded, so a call's result and numbers do not depend on earlier calls."""
        self.timer = PhaseTimer(self.device)
        self.generator.manual_seed(seed)
        self.sampler.reseed(seed)
        for r in self.runners.values():
            r.capture_s = 0.0
        for g in self._graphs.values():
            g.capture_s = 0.0
        self._warmup_s = 0.0

    def release(self, row: int) -> None:
        """Free a row (finished, or aborted mid-prefill or mid-decode): it becomes idle for the next request."""
        self._prompt_rows.pop(row, None)
        self._prefilled.pop(row, None)
        self.prompts[row] = []
        self._epoch[row] += 1
        self._fresh[row] = False
        self.finished[row] = True
        self.done[row] = True
        self.target_cache.lengths[row] = 1
        self.host_lengths[row] = 1
        self.sampler.set_row(row, self.cfg.sampling, None, self.device)
        self._tokens[row] = []
        self._draft_lag[row] = 0
        if self._row_gamma[row] != self.gamma:
            self.set_gamma(row, self.gamma)
        for d in (self._lp_rows, self._plp_rows, self._prompt_lp):
            d.pop(row, None)
        # a row released before its prefill completed leaves the rows waiting for its prompt cache to prefill
        # the whole prompt themselves (their prefilled count is still 0); a waiting row stops waiting
        self._prefix_wait.pop(row, None)
        for waiting in self._prefix_wait.values():
            if row in waiting:
                waiting.remove(row)

    @property
    def prefilling_rows(self) -> set[int]:
        return set(self._prompt_rows)

    @property
    def active_rows(self) -> list[int]:
        return [b for b in range(self.B) if not self.finished[b]]

    def _random_prefill_state(self, n_max: int) -> "PrefillState":
        self.kv.fill_noise(n_max, self.generator)
        first = torch.randint(0, self.V, (self.B,), device=self.device, generator=self.generator)
        return PrefillState(self.prefill_key, None, None if self.draft_cache is None else (), first)

    def prefill_state(self, keep: "PrefillState | None" = None) -> "PrefillState":
        """Snapshot of the prompt caches right after prefill (call before the first step). `keep`: the state this
        session started from; its target caches are shared, not copied again (a speculative session after a
        vanilla one adds only the draft's: at 20 x 64k the second copy of the target's would be 37 GB)."""
        n_max = max(len(p) for p in self.prompts)
        shared = keep is not None and keep.target_kv is not None
        target = keep.target_kv if shared else self.kv.snapshot("target", n_max)
        draft = self.kv.snapshot("draft", n_max) if "draft" in self.kv.caches else None
        return PrefillState(self.prefill_key, target, draft, self.pending.clone())

    @property
    def prefill_key(self) -> tuple:
        return prefill_key(self.prompts, self.target_cache.k.dtype)

    # ---------------------------------------------------------------- decode
    @property
    def min_gamma(self) -> int:
        """The smallest Γ a row may take: 0 (plain steps) when the policy verifies against the full cache, or when a
        plain row can be verified densely (`dense_plain`); else 1 (a sparse method's token depends on its drafts: its
        selection reads their lookahead)."""
        return 0 if self.policy.full_verify or self.dense_plain else 1

    def set_gamma(self, row: int, gamma: int) -> None:
        """The row's own Γ from its next step on (in [min_gamma, cfg.gamma]; see the module's docstring)."""
        if not self.spec.speculative:
            raise ValueError("a method without a draft has no Γ")
        if not self.min_gamma <= gamma <= self.gamma:
            raise ValueError(f"Γ of row {row} must be in [{self.min_gamma}, {self.gamma}], got {gamma}")
        if gamma != self._row_gamma[row]:
            self._row_gamma[row] = gamma
            self.row_gamma[row] = gamma  # in place, queued behind any step in flight (a graph reads this tensor)

    def row_gamma_of(self, row: int) -> int:
        return self._row_gamma[row]

    @property
    def step_gamma(self) -> int:
        """G of the next step: the largest Γ of the rows that decode (cfg.gamma when none does)."""
        if not self.spec.speculative:
            return 0
        return max((self._row_gamma[b] for b in self.active_rows), default=self.gamma)

    def _catch_up_rows(self) -> list[int]:
        """Rows that draft in the next step and whose draft cache lags (their plain steps were not written by it)."""
        return [b for b in self.active_rows if self._draft_lag[b] and self._row_gamma[b] > 0]

    @property
    def catch_up_pending(self) -> bool:
        """Whether the next step first writes draft positions of rows' earlier plain steps: it then needs every
        launched step read back (`complete`) before `launch`."""
        return bool(self._catch_up_rows())

    @torch.inference_mode()
    def launch(self, overlapped: bool = True) -> int:
        """Queue one step's device work and the copy of its output to pinned host memory; returns the staging
        slot to `complete` later. The rows the step runs for (and their epochs) are recorded now, so that its
        tokens are booked to the requests that held the rows at launch, whatever was released or admitted since.
        overlapped: the host may be a step behind the device (attention is then sized by the capacity)."""
        G = self.step_gamma
        live = [(b, self._epoch[b], self._fresh[b]) for b in range(self.B) if not self.finished[b]]
        behind = self._catch_up_rows()
        if behind:
            self._catch_up_draft(behind)
        self._lp_on = bool(self._lp_rows)
        out = self._launch(overlapped, G)
        slot, self._slot = self._slot, self._slot ^ 1
        self._lp_staged[slot] = self._lp_on
        if self._lp_on:
            out, vals, ids = out
            stage = self._lp_stage[slot]
            if stage is None or stage[0].shape != vals.shape:
                pinned = self.device.type == "cuda"
                self._lp_stage[slot] = (torch.empty(vals.shape, dtype=vals.dtype, pin_memory=pinned),
                                        torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pinned))
            self._lp_stage[slot][0].copy_(vals, non_blocking=True)
            self._lp_stage[slot][1].copy_(ids, non_blocking=True)
        self._staged(slot, G).copy_(out, non_blocking=True)
        self._staged_gamma[slot] = G
        if self._ready[slot] is not None:
            self._ready[slot].record()
        for b, _, fresh in live:
            if fresh:
                self._fresh[b] = False  # the first token rides on this step's output
            if self.spec.speculative and self._row_gamma[b] == 0:
                # a plain step of the row: its draft cache counts as not written at this step's first position,
                # whether a draft forward ran for other rows (G > 0) or none ran (G = 0), so that the catch-up
                # writes it the same way, whatever ran beside the row
                self._draft_lag[b] += 1
        self._live[slot] = live
        self._unread += 1
        return slot

    def _staged(self, slot: int, G: int) -> torch.Tensor:
        """The pinned host buffer of a step of G drafts' output [B, 3 + G]: the front of the slot's buffer, contiguous
        (a copy from the device into a strided view of pinned memory would not be asynchronous)."""
        return self._out_stage[slot].view(-1)[:self.B * (3 + G)].view(self.B, 3 + G)

    def _catch_up_draft(self, rows: list[int]) -> None:
        """Write the draft cache positions of `rows`' plain steps, a draft-only prefill per row (its shapes the
        row's own, so its numbers do not depend on the other rows): a row that ran g plain steps lacks positions
        L - 1 - g .. L - 2 (the step re-reads L - 1 and L, [prev, pending], itself)."""
        if self._unread:
            raise RuntimeError("the draft's catch-up needs every launched step read back (complete) first")
        self.timer.start("draft")
        for b in rows:
            L, g = self.host_lengths[b], self._draft_lag[b]
            if len(self._tokens[b]) != L + 1:
                raise RuntimeError(f"row {b}: {len(self._tokens[b])} tokens known for a cache of {L}")
            self.runners["draft"].prefill_packed([(b, L - 1 - g, self._tokens[b][L - 1 - g:L - 1])], 0, 1)
            self._draft_lag[b] = 0
        self.timer.stop("draft")

    @torch.inference_mode()
    def complete(self, slot: int) -> list[RowTokens]:
        """Wait for the step staged in `slot` (the step's one host sync); the tokens it made for the rows it was
        launched for that still hold the same sequence and still decode."""
        if self._ready[slot] is not None:
            self._ready[slot].synchronize()
        self._unread -= 1
        G = self._staged_gamma[slot]
        return self._read_back(self._staged(slot, G).tolist(), self._live[slot],
                               self._lp_stage[slot] if self._lp_staged[slot] else None)

    @property
    def overlappable(self) -> bool:
        """Whether steps may be launched a step ahead of the host (the engine loop)."""
        return self.cfg.options.overlap and self.policy.graph_safe

    def _launch(self, overlapped: bool, G: int) -> torch.Tensor:
        """Queue one step of G drafts' device work; returns its [B, 3 + G] output (not yet read back)."""
        if self._step_graph_eligible():
            mode = (self.sampler.mode + ("+logprobs" if self._lp_on else ""), G)
            graph = self._graphs.get(mode)
            if graph is None and mode in self._graph_warm:
                graph = self._graphs[mode] = StepGraph(lambda: self._capture_step(G), generators=[self.generator])
            if graph is not None:
                self.timer.start("step_graph")
                out = graph.replay()
                self.timer.stop("step_graph")
                return out
            # the eager run before capture, with the captured step's sizes: it compiles every kernel, a
            # one-time cost counted like capture (its tokens count)
            t0 = time.perf_counter()
            out = self._device_step(self._graph_max_len, graphed_forwards=False, G=G)
            torch.cuda.synchronize(self.device)
            self._graph_warm.add(mode)
            self._warmup_s += time.perf_counter() - t0
            return out
        # a step ahead, the host lengths lag the device's by up to Γ + 1: size attention by the capacity then
        max_len = self._graph_max_len if overlapped else max(self.host_lengths)
        return self._device_step(max_len, graphed_forwards=self.use_graphs, G=G)

    def add_one_time_s(self, seconds: float) -> None:
        """Count a one-time cost of the first decode step (the engine loop's wait for background kernel compiles)
        with the capture time, not the decode time."""
        self._warmup_s += seconds

    @property
    def warmup_s(self) -> float:
        """One-time seconds of the steps that ran eagerly before their graph was captured (and of waits counted
        with them, `add_one_time_s`)."""
        return self._warmup_s

    def graph_keys(self) -> list[tuple[str, int]]:
        """(sampling mode, G) of every step graph captured so far."""
        return list(self._graphs)

    def capture_total(self) -> float:
        """One-time graph cost so far: captures plus their warm-up runs (tokens of a warm-up step count)."""
        graphs = sum(r.capture_s for r in self.runners.values()) + sum(g.capture_s for g in self._graphs.values())
        return graphs + self._warmup_s

    def _step_graph_eligible(self) -> bool:
        """Whether this step replays as one CUDA graph (`StepGraph`): graphs on and a graph-safe policy. Each
        sampling mode (`RowSampling.mode`: one rule for the batch, all-greedy rows with their own settings, or
        per-row rules read from device tensors) and each G takes its own code path, so each gets its own graph,
        captured at the second step in that mode and G; the first runs the same code eagerly, which compiles every
        Triton kernel and creates every lazily built buffer, so capture needs no warm-up runs of its own."""
        if not (self.use_graphs and self.cfg.options.step_graph):
            return False
        # the batch's torch generator is drawn from inside the step (uniform sampling, acceptance control)
        draws = (self.sampler.uniform and not self.sampler.greedy) or self.cfg.options.accept_prob is not None
        return not draws or StepGraph.can_register_generators()

    @property
    def _graph_max_len(self) -> int:
        """Attention sized by the cache capacity (the kernels stop at each row's length, so one graph serves
        every step); Γ + 1 below it, the most any of the step's forwards adds."""
        return self.target_cache.capacity - self.gamma - 1

    def dry_step(self, gamma: int | None = None) -> None:
        """The device part of one step of G = gamma (default cfg.gamma), eagerly, at the captured graph's sizes;
        nothing is read back or booked. The warm-up runs it on a twin under FakeTensorMode to learn the step's
        kernel launches (dustin/engine/warmup.py)."""
        self._device_step(self._graph_max_len, graphed_forwards=False, G=self.gamma if gamma is None else gamma)

    def time_steps(self, gamma: int, context: int, repeats: int = 3) -> float:
        """Median seconds of a step of G = gamma with every row at `context` cached positions, run as serving
        runs it (its step graph on a GPU, captured here and kept); for the cost model of `--gamma auto`. Wants
        every row idle, and leaves them so (the rows ride along as stopped rows, so nothing advances)."""
        if any(not f for f in self.finished) or self._prompt_rows:
            raise RuntimeError("time_steps wants every row idle")
        if not 1 <= context <= self._graph_max_len:
            raise ValueError(f"context must be in [1, {self._graph_max_len}], got {context}")
        self.target_cache.lengths.fill_(context)
        self.host_lengths = [context] * self.B
        self.row_gamma.fill_(gamma)  # what a step of G = gamma does with its rows (a plain row may read densely)
        self._lp_on = False
        times = []
        try:
            with torch.inference_mode():
                for i in range(repeats + 2):  # the first runs compile (and capture the graph)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    t0 = time.perf_counter()
                    self._launch(True, gamma)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
        finally:  # idle again, in place: the graphs captured here read these very tensors
            self.row_gamma.copy_(torch.tensor(self._row_gamma))
            self.target_cache.lengths.fill_(1)
            self.host_lengths = [1] * self.B
            for t in (self.pending, self.prev):
                t.zero_()
            self.done.fill_(True)
        return sorted(times)[len(times) // 2]

    def _capture_step(self, G: int) -> torch.Tensor:
        """The device step as captured: no phase timers (a graph replays as one unit, timed as "step_graph")."""
        self.timer, timer = NullTimer(), self.timer
        try:
            return self._device_step(self._graph_max_len, graphed_forwards=False, G=G)
        finally:
            self.timer = timer

    def _device_step(self, max_len: int, graphed_forwards: bool, G: int) -> torch.Tensor:
        """The device part of a step of G drafts (G <= cfg.gamma; 0: a plain decode step): no host sync, and every
        piece of state it changes (cache lengths, `pending`, `prev`, policy buffers) is updated in place, so it can
        be captured once and replayed. Returns [B, 3 + G] = (accepted count, next token, pending at the step's
        start, drafts) per row; while `_lp_on`, also the log-probabilities of the row's first token (its
        prefill's) and of the token chosen at each verify position (`_step_logprobs`)."""
        L = self.target_cache.lengths
        first = self.pending.clone()  # a row's first token (chosen by its prefill) reaches the host with this step
        if self.spec.speculative:
            gmax = self.gamma
            self.policy.begin_step(self)
            timer = self.timer
            if G > 0:
                timer.start("draft")
                drafts, draft_probs = self.draft_step.run(
                    self.prev, self.pending, L, max_len, G, captures=self.policy.draft_captures(self),
                    observers=self.policy.draft_observers(self), graphed=graphed_forwards)
                timer.stop("draft")
            else:  # a plain step: no draft forward (the draft's cache lags; `_catch_up_draft`)
                drafts, draft_probs = self.pending[:, None][:, :0], None
            # the verify forward always takes Γ + 1 tokens (those past G are padding, never accepted): its shapes,
            # and so each row's numbers, do not depend on the G its neighbours chose
            pad = self.pending[:, None].expand(-1, gmax - G)
            inp = torch.cat([self.pending[:, None], drafts, pad], dim=1)
            pos = L.long()[:, None] + torch.arange(gmax + 1, device=self.device)
            self.verify_input, self.verify_positions = inp, pos  # what the policy may look at
            plan = self.policy.plan(self)  # times its own phases ("estimate", "select") with self.timer
            if self.dense_plain:  # a plain row's positions were chosen by no draft: it reads the whole cache
                plain = self.row_gamma == 0
                plan = SparsePlan(plan.indices, plan.counts, plain if plan.dense is None else plan.dense | plain)
            phase = "verify" if plan is None else "sparse_verify"
            timer.start(phase)
            logits = self._forward("target", inp, pos, L, max_len + gmax + 1, sparse=plan,
                                   observers=self.policy.target_observers(self), graphed=graphed_forwards)
            logits = logits[:, :G + 1, : self.V]
            timer.stop(phase)
            limit = self.row_gamma.clamp_max(G)  # rows whose Γ is below G stop at it
            if G == 0:
                self.sampler.skip(2 * gmax)  # the draws a step of G > 0 takes before the next token's
                nxt, _ = self.sampler.choose(logits[:, 0])
                n_acc = torch.zeros_like(nxt)
            elif self.cfg.options.accept_prob is not None:
                n_acc, nxt = accept_controlled(drafts, logits, self.cfg.options.accept_prob, self.generator, limit)
            else:
                n_acc, nxt = self.sampler.accept(drafts, draft_probs, logits, limit, stride=gmax)
            if G == 0:
                new_prev = self.pending
            else:
                last_draft = drafts.gather(1, (n_acc - 1).clamp_min(0)[:, None]).squeeze(1)
                new_prev = torch.where(n_acc == 0, self.pending, last_draft)
        else:
            self.policy.begin_step(self)
            timer = self.timer
            timer.start("verify")
            observers = self.policy.target_observers(self)
            logits = self._forward("target", self.pending[:, None], L.long()[:, None], L, max_len + 1,
                                   observers=observers, graphed=graphed_forwards)[:, 0, : self.V]
            timer.stop("verify")
            nxt, _ = self.sampler.choose(logits)
            n_acc = torch.zeros_like(nxt)
            drafts = nxt[:, None][:, :0]
            new_prev = self.pending
            logits = logits[:, None]
        lp = self._step_logprobs(logits, drafts, n_acc, nxt) if self._lp_on else None
        # rows already finished stay put so they never outgrow the cache
        self.target_cache.lengths.add_(torch.where(self.done, 0, 1 + n_acc).to(torch.int32))
        self.prev.copy_(torch.where(self.done, self.prev, new_prev))
        self.pending.copy_(torch.where(self.done, self.pending, nxt))
        self.policy.after_verify(self, n_acc)  # sees the advanced lengths and the next pending tokens
        out = torch.cat([n_acc[:, None], nxt[:, None], first[:, None], drafts], dim=1)
        return out if lp is None else (out, *lp)

    def _step_logprobs(self, logits: torch.Tensor, drafts: torch.Tensor, n_acc: torch.Tensor, nxt: torch.Tensor):
        """([B, Γ + 2, 1 + K] fp32, [B, Γ + 2, K] long): `token_logprobs` of each row's first token (written by its
        prefill), then of the token chosen at each verify position (the accepted drafts, then the next token at
        position n_acc; positions past it are junk), under the verify forward's logits [B, Γ + 1, V]."""
        chosen = torch.cat([drafts, nxt[:, None]], dim=1).scatter(1, n_acc[:, None].long(), nxt[:, None])
        vals, ids = token_logprobs(logits, chosen)
        return (torch.cat([self._lp_first[0][:, None], vals], dim=1),
                torch.cat([self._lp_first[1][:, None], ids], dim=1))

    def _forward(self, which: str, tokens, positions, lengths, max_len: int, **kw) -> torch.Tensor:
        """A step's forward: logits in the model's dtype (the sampler casts where it computes probabilities;
        greedy choices and acceptance are argmaxes, the same on either dtype)."""
        return self.runners[which].forward(tokens, positions, lengths, max_len, float_logits=False, **kw)

    def _read_back(self, host: list[list[int]], live: list[tuple[int, int, bool]],
                   lp: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[RowTokens]:
        """One step's tokens read back to the host, for the rows it was launched for (`live`: row, epoch, first
        token pending) that still belong to the same sequence and still decode. lp: the step's log-probabilities
        (host), returned for the rows that asked."""
        out = []
        for b, epoch, fresh in live:
            if epoch != self._epoch[b] or self.finished[b]:
                continue
            row = host[b]
            n_acc, nxt, drafts = row[0], row[1], row[3:]
            new = drafts[:n_acc] + [nxt]
            self.host_lengths[b] += len(new)
            self._tokens[b] += ([row[2]] if fresh else []) + new
            logprobs = None
            if lp is not None and b in self._lp_rows:
                vals, ids = lp[0][b].tolist(), lp[1][b].tolist()
                logprobs = list(zip(vals, ids, strict=True))[(0 if fresh else 1):1 + len(new)]
            out.append(RowTokens(b, row[2] if fresh else None, new, logprobs))
        return out

    def stop(self, row: int) -> None:
        """The row's sequence stopped: the row stops decoding (its cache length freezes) until it is released."""
        self.finished[row] = True
        self.done[row] = True
