"""The device half of a speculative step, written to be captured: draft -> plan -> verify -> accept, with no host
sync, every piece of state it changes (cache lengths, `pending`, `prev`, the policy's buffers) updated in place.

  1. draft G tokens (`DraftStep`): the first draft forward re-reads [prev, pending] (two tokens, so the draft cache
     is right whether or not the previous step accepted all drafts), then one token per forward;
  2. the selection policy plans the verify attention (None = the full cache);
  3. the target verifies [pending, d1..dΓ] in one forward (positions past G are padding, never accepted: the
     forward's shape, and so each row's numbers, do not depend on the G its neighbours chose) and accepts a prefix
     (greedy, lossless sampling, or acceptance control for benchmarks);
  4. cache lengths advance by 1 + accepted; rejected rows are simply overwritten later (rollback is free).

A row whose Γ_r < G accepts at most Γ_r drafts, its next token is the target's at slot Γ_r when it accepted them
all, and its sampling counter advances by the same number of draws whatever G is: its tokens are those of a step of
Γ_r, whichever rows run beside it. A step of G = 0 is a plain decode step (no draft forward).

On a GPU with a graph-safe policy the whole step is one CUDA graph (`StepGraph`), one per (sampling mode, G),
captured at the second step in that mode and G; the first runs the same code eagerly, which compiles every Triton
kernel and creates every lazily built buffer, so capture needs no warm-up runs of its own. Otherwise each
fixed-shape forward may replay as its own graph (`ModelRunner`).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from dustin.engine.cuda_graphs import StepGraph
from dustin.engine.draft_step import DraftStep
from dustin.engine.logprobs import token_logprobs
from dustin.engine.model_runner import ModelRunner
from dustin.engine.sampling import accept_controlled
from dustin.engine.timing import NullTimer
from dustin.engine.worker.batch import BatchState
from dustin.engine.worker.staging import Staging
from dustin.selection.base import SelectionPolicy


class DeviceStep:
    """The step's device work over `batch` (see the module's docstring) and its graph cache."""

    def __init__(self, batch: BatchState, staging: Staging, policy: SelectionPolicy,
                 models: dict[str, ModelRunner], draft_step: DraftStep | None, use_graphs: bool,
                 dense_plain: bool) -> None:
        """models: the ModelRunner of "target" (and "draft"). dense_plain: rows at Γ = 0 read the whole cache (their
        positions were chosen by no draft: `--gamma auto` with a policy of shared sparse plans)."""
        self.batch, self.staging, self.policy = batch, staging, policy
        self.models, self.draft_step = models, draft_step
        self.cfg = batch.cfg
        self.use_graphs, self.dense_plain = use_graphs, dense_plain
        self._graphs: dict[tuple[str, int], StepGraph] = {}  # one per (sampling mode (RowSampling.mode), G)
        self._graph_warm: set[tuple[str, int]] = set()  # (mode, G) whose eager first step ran
        self.warmup_s = 0.0  # one-time seconds of the eager first steps (and waits counted with them)

    def launch(self, overlapped: bool, G: int, logprobs: bool):
        """Queue one step of G drafts' device work; its output (`run`), not yet read back. overlapped: the host may
        be a step behind the device (attention is then sized by the capacity)."""
        if self.graph_eligible():
            mode = (self.batch.sampler.mode + ("+logprobs" if logprobs else ""), G)
            graph = self._graphs.get(mode)
            if graph is None and mode in self._graph_warm:
                graph = self._graphs[mode] = StepGraph(lambda: self._capture(G, logprobs),
                                                       generators=[self.batch.generator])
            if graph is not None:
                self.batch.timer.start("step_graph")
                out = graph.replay()
                self.batch.timer.stop("step_graph")
                return out
            # the eager run before capture, with the captured step's sizes: it compiles every kernel, a one-time
            # cost counted like capture (its tokens count)
            t0 = time.perf_counter()
            out = self.run(self.graph_max_len, False, G, logprobs)
            torch.cuda.synchronize(self.batch.device)
            self._graph_warm.add(mode)
            self.warmup_s += time.perf_counter() - t0
            return out
        # a step ahead, the host lengths lag the device's by up to Γ + 1: size attention by the capacity then
        max_len = self.graph_max_len if overlapped else max(self.batch.host_lengths)
        return self.run(max_len, self.use_graphs, G, logprobs)

    def graph_eligible(self) -> bool:
        """Whether this step replays as one CUDA graph: graphs on and a graph-safe policy. Each sampling mode
        (`RowSampling.mode`: one rule for the batch, all-greedy rows with their own settings, or per-row rules read
        from device tensors) and each G takes its own code path, so each gets its own graph."""
        if not (self.use_graphs and self.cfg.options.step_graph):
            return False
        # the batch's torch generator is drawn from inside the step (uniform sampling, acceptance control)
        sampler = self.batch.sampler
        draws = (sampler.uniform and not sampler.greedy) or self.cfg.options.accept_prob is not None
        return not draws or StepGraph.can_register_generators()

    @property
    def graph_max_len(self) -> int:
        """Attention sized by the cache capacity (the kernels stop at each row's length, so one graph serves every
        step); Γ + 1 below it, the most any of the step's forwards adds."""
        return self.batch.target_cache.capacity - self.batch.gamma - 1

    def dry(self, G: int) -> None:
        """The device part of one step of G drafts, eagerly, at the captured graph's sizes; nothing is staged."""
        self.run(self.graph_max_len, False, G, False)

    def graph_keys(self) -> list[tuple[str, int]]:
        """(sampling mode, G) of every step graph captured so far."""
        return list(self._graphs)

    def capture_total(self) -> float:
        """One-time graph cost so far: captures plus their warm-up runs (tokens of a warm-up step count)."""
        graphs = sum(r.capture_s for r in self.models.values()) + sum(g.capture_s for g in self._graphs.values())
        return graphs + self.warmup_s

    def reset_capture_time(self) -> None:
        """Count one-time costs from zero again (a new offline run on a kept batch; its graphs stay)."""
        for r in self.models.values():
            r.capture_s = 0.0
        for g in self._graphs.values():
            g.capture_s = 0.0
        self.warmup_s = 0.0

    def _capture(self, G: int, logprobs: bool):
        """The device step as captured: no phase timers (a graph replays as one unit, timed as "step_graph")."""
        batch = self.batch
        batch.timer, timer = NullTimer(), batch.timer
        try:
            return self.run(self.graph_max_len, False, G, logprobs)
        finally:
            batch.timer = timer

    def run(self, max_len: int, graphed_forwards: bool, G: int, logprobs: bool):
        """The device part of a step of G drafts (G <= gamma; 0: a plain decode step). Returns [B, 3 + G] =
        (accepted count, next token, pending at the step's start, drafts) per row; with `logprobs`, also the
        log-probabilities of the row's first token (its prefill's) and of the token chosen at each verify position
        (`_logprobs`)."""
        s, policy = self.batch, self.policy
        L = s.target_cache.lengths
        first = s.pending.clone()  # a row's first token (chosen by its prefill) reaches the host with this step
        policy.begin_step(s)
        timer = s.timer
        if s.cfg.spec.speculative:
            gmax = s.gamma
            if G > 0:
                timer.start("draft")
                drafts, draft_probs = self.draft_step.run(
                    s.prev, s.pending, L, max_len, G, captures=policy.draft_captures(s),
                    observers=policy.draft_observers(s), graphed=graphed_forwards)
                timer.stop("draft")
            else:  # a plain step: no draft forward (the draft's cache lags; the runner's catch-up)
                drafts, draft_probs = s.pending[:, None][:, :0], None
            pad = s.pending[:, None].expand(-1, gmax - G)
            inp = torch.cat([s.pending[:, None], drafts, pad], dim=1)
            pos = L.long()[:, None] + torch.arange(gmax + 1, device=s.device)
            s.verify_input, s.verify_positions = inp, pos  # what the policy may look at
            plan = policy.plan(s)  # times its own phases ("estimate", "select") with the batch's timer
            if self.dense_plain:  # a plain row's positions were chosen by no draft: it reads the whole cache
                plain = s.row_gamma == 0
                plan = replace(plan, dense=plain if plan.dense is None else plan.dense | plain)
            phase = "verify" if plan is None else "sparse_verify"
            timer.start(phase)
            logits = self.forward("target", inp, pos, L, max_len + gmax + 1, sparse=plan,
                                  observers=policy.target_observers(s), graphed=graphed_forwards)
            logits = logits[:, :G + 1, : s.V]
            timer.stop(phase)
            limit = s.row_gamma.clamp_max(G)  # rows whose Γ is below G stop at it
            if G == 0:
                s.sampler.skip(2 * gmax)  # the draws a step of G > 0 takes before the next token's
                nxt, _ = s.sampler.choose(logits[:, 0])
                n_acc = torch.zeros_like(nxt)
            elif self.cfg.options.accept_prob is not None:
                n_acc, nxt = accept_controlled(drafts, logits, self.cfg.options.accept_prob, s.generator, limit)
            else:
                n_acc, nxt = s.sampler.accept(drafts, draft_probs, logits, limit, stride=gmax)
            if G == 0:
                new_prev = s.pending
            else:
                last_draft = drafts.gather(1, (n_acc - 1).clamp_min(0)[:, None]).squeeze(1)
                new_prev = torch.where(n_acc == 0, s.pending, last_draft)
        else:
            timer.start("verify")
            observers = policy.target_observers(s)
            logits = self.forward("target", s.pending[:, None], L.long()[:, None], L, max_len + 1,
                                  observers=observers, graphed=graphed_forwards)[:, 0, : s.V]
            timer.stop("verify")
            nxt, _ = s.sampler.choose(logits)
            n_acc = torch.zeros_like(nxt)
            drafts = nxt[:, None][:, :0]
            new_prev = s.pending
            logits = logits[:, None]
        lp = self._logprobs(logits, drafts, n_acc, nxt) if logprobs else None
        # rows already finished stay put so they never outgrow the cache
        L.add_(torch.where(s.done, 0, 1 + n_acc).to(torch.int32))
        s.prev.copy_(torch.where(s.done, s.prev, new_prev))
        s.pending.copy_(torch.where(s.done, s.pending, nxt))
        policy.after_verify(s, n_acc)  # sees the advanced lengths and the next pending tokens
        out = torch.cat([n_acc[:, None], nxt[:, None], first[:, None], drafts], dim=1)
        return out if lp is None else (out, *lp)

    def _logprobs(self, logits: torch.Tensor, drafts: torch.Tensor, n_acc: torch.Tensor, nxt: torch.Tensor):
        """([B, Γ + 2, 1 + K] fp32, [B, Γ + 2, K] long): `token_logprobs` of each row's first token (written by its
        prefill), then of the token chosen at each verify position (the accepted drafts, then the next token at
        position n_acc; positions past it are junk), under the verify forward's logits [B, Γ + 1, V]."""
        chosen = torch.cat([drafts, nxt[:, None]], dim=1).scatter(1, n_acc[:, None].long(), nxt[:, None])
        vals, ids = token_logprobs(logits, chosen)
        first = self.staging.first_lp
        return torch.cat([first[0][:, None], vals], dim=1), torch.cat([first[1][:, None], ids], dim=1)

    def forward(self, which: str, tokens, positions, lengths, max_len: int, **kw) -> torch.Tensor:
        """A step's forward: logits in the model's dtype (the sampler casts where it computes probabilities; greedy
        choices and acceptance are argmaxes, the same on either dtype)."""
        return self.models[which].forward(tokens, positions, lengths, max_len, float_logits=False, **kw)
