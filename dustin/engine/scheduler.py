"""The scheduler's half of the engine core (vLLM v1's shape): the requests (`Sequence`), the waiting queue and the
rows, the `StepPlan` each step hands to the executor as plain data, and the tokens read back committed to their
sequences (the stop rules) and returned as outputs. dustin/engine/core.py runs it."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dustin.engine.gamma import GammaRule, RowGamma
from dustin.engine.kv_manager import SlotTable
from dustin.engine.logprobs import to_logprob
from dustin.engine.request import Request, RequestOutput, SamplingParams, SamplingRule
from dustin.engine.worker.staging import RowTokens
from dustin.errors import DustinError, InputError


class QueueFullError(DustinError):
    """The waiting queue is full: the server answers 429."""


def check_admission(params: SamplingParams, gang: bool, method: str) -> None:
    """What a kind of admission cannot serve (part of a request's check at the edge): prompt log-probabilities
    from a gang's prefill, which runs one sequence at a time and computes none."""
    if params.prompt_logprobs is not None and gang:
        raise InputError(f"prompt log-probabilities (echo) are not computed by method {method!r}: its requests are "
                         f"prefilled together as a gang, one sequence at a time")


@dataclass
class EngineStats:
    """Decode statistics of a run: steps, tokens, and (offline) its wall times."""

    steps: int = 0
    active_seq_steps: int = 0  # sum over steps of the number of unfinished sequences
    produced: int = 0  # tokens kept by decode steps (excludes the prefill's first token)
    step_tokens: int = 0  # tokens each active sequence gained per target forward, before truncation
    drafts: int = 0  # active sequence steps that verified drafts (Γ > 0)
    drafted: int = 0  # draft tokens those steps proposed (their Γ); accepted: step_tokens - active_seq_steps
    gammas: dict[int, int] = field(default_factory=dict)  # --gamma auto: Γ -> sequence steps launched with it
    prefill_s: float = 0.0
    decode_s: float = 0.0  # the decode steps' wall time, one-time CUDA-graph capture excluded
    capture_s: float = 0.0  # that one-time capture (graph warm-up runs included)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean tokens produced per target forward per sequence (1.0 for vanilla)."""
        return self.step_tokens / max(self.active_seq_steps, 1)


@dataclass(eq=False)
class Sequence:
    request: Request
    arrival: float
    row: int | None = None
    prefilled: int = 0  # prompt tokens given to prefill chunks of scheduled plans
    output_ids: list[int] = field(default_factory=list)  # the tokens committed so far
    logprobs: list = field(default_factory=list)  # their log-probabilities (when the request asked)
    finish_reason: str | None = None  # "stop" (an EOS id), "length" (max_tokens), once it finished
    emitted: int = 0  # tokens already returned by step()
    aborted: bool = False
    # n sequences of one prompt: the list shared by the group's members still waiting or running (the first
    # prefills the prompt), the member whose prompt cache this one copies, the plan that completed its prefill
    group: list[Sequence] | None = None
    copy_from: Sequence | None = None
    prefill_plan: int | None = None
    gamma: RowGamma | None = None  # --gamma auto: its Γ history (dustin/engine/gamma.py)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, tokens: list[int], eos_ids: set[int]) -> int:
        """Append a step's tokens, stopping at an EOS id (unless the request ignores EOS) or at max_tokens: the
        stop rules. Returns how many were kept (tokens past a stop are dropped)."""
        out, limit = self.output_ids, self.request.params.max_tokens
        eos = () if self.request.params.ignore_eos else eos_ids
        kept = 0
        for tok in tokens:
            if len(out) >= limit:
                break
            out.append(tok)
            kept += 1
            if tok in eos:
                self.finish_reason = "stop"
                return kept
        if len(out) >= limit:
            self.finish_reason = "length"
        return kept


class Scheduler:
    """The requests by id, the waiting ones (bounded FIFO), the rows they run in and each step's prefill (`schedule`
    makes a step's plan); after the step, the tokens read back committed to their sequences (`update`) and the
    outputs (`collect`). Only rank 0 of a tensor-parallel engine has one that schedules.

    Two kinds of admission:
    - chunked (`gang` False): a request joins the running batch as soon as a row is free, and each step prefills
      whole chunks of `chunk` tokens (a prompt is always cut at the same offsets, multiples of `chunk` from its
      start, whatever else runs), oldest request first, at most `budget` tokens in all;
    - gang (`gang` True): the waiting requests are admitted together once every row is free, prefilled at once,
      and nothing joins them until all have finished. Policies whose state spans the whole batch (quest,
      specattn, snapkv, oracle) run this way, and so do offline batches whose prompt caches are copied or filled
      another way (dustin/engine/offline/prefill.py)."""

    def __init__(self, slots: SlotTable, max_waiting: int, chunk: int, budget: int, gang: bool = False) -> None:
        """slots: the KV manager's slot table (which row each sequence holds); the scheduler takes and gives back
        rows through it, and touches no cache."""
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # row -> sequence (prefilling or decoding)
        self.slots = slots
        self.max_waiting, self.chunk, self.budget = max_waiting, chunk, budget
        self.gang = gang
        self.plans = 0  # prefill plans made (`prefill_chunks` calls)
        self.requests: dict[str, Sequence] = {}  # every request waiting or running, by id
        self._aborts: list[str] = []
        self._to_release: list[int] = []  # rows whose requests finished: the next plan releases them
        self._to_freeze: list[int] = []  # a gang's rows whose sequences finished: frozen by the next plan
        self._gang_rows: set[int] = set()  # rows of the running gang that finished (released when all have)
        self._outputs: list[RequestOutput] = []  # outputs decided while scheduling (aborts), returned by collect

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request, or the sequences of one prompt (kept together), under their request ids."""
        ids = [q.request.request_id for q in seqs]
        taken = [i for i in ids if i in self.requests]
        if taken or len(set(ids)) != len(ids):
            raise InputError(f"request id {(taken or ids)[0]!r} is already in use")
        self.enqueue(seqs)
        for seq in seqs:
            self.requests[seq.request.request_id] = seq

    def abort(self, request_id: str) -> None:
        """Waiting or running: the next plan frees its row and the next `collect` reports it ("abort")."""
        if request_id in self.requests:
            self._aborts.append(request_id)

    def schedule(self, compiling: bool = False, gamma_rule: GammaRule | None = None,
                 gamma_counts: dict[int, int] | None = None) -> StepPlan:
        """One step's plan: aborts, releases, admissions, prefill chunk sizes, whether to decode and at which Γ per
        row. compiling: the decode step's kernels are still compiling in the background (prefill now, decode once
        they are ready). gamma_rule: --gamma auto's rule (each sequence's Γ from its own history, `RowGamma`;
        gamma_counts counts the sequence steps of each Γ)."""
        self._outputs += self._apply_aborts()
        admit = tuple(Admission.of(seq) for seq in self.admissions())
        prefill = tuple(self.prefill_chunks())
        freeze, self._to_freeze = tuple(self._to_freeze), []
        release, self._to_release = tuple(self._to_release), []
        # decode when a row is active after this plan: decoding, or its prompt completes now (its first token
        # reaches the host with this step's output)
        decode = any(not seq.prefilling for seq in self.running.values())
        if decode and prefill and compiling:
            decode = False
        gammas = []
        for row, seq in self.running.items() if decode and gamma_rule is not None else ():
            if seq.prefilling or seq.finished:
                continue
            if seq.gamma is None:
                seq.gamma = RowGamma(len(seq.request.prompt_ids))
            g = seq.gamma.next_gamma(gamma_rule)
            gamma_counts[g] = gamma_counts.get(g, 0) + 1
            gammas.append((row, g))
        return StepPlan(freeze=freeze, release=release, admit=admit, prefill=prefill, gang=bool(admit) and self.gang,
                        decode=decode, gammas=tuple(gammas))

    def enqueue(self, seqs: Sequence | list[Sequence]) -> None:
        """One request, or a group of sequences of one prompt (kept together: admitted at once)."""
        seqs = [seqs] if isinstance(seqs, Sequence) else seqs
        if len(self.waiting) + len(seqs) > self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting (--max-waiting "
                                 f"{self.max_waiting}): try again later")
        self.waiting.extend(seqs)

    def admissions(self) -> list[Sequence]:
        """Waiting requests given a free row now (lowest rows first), in arrival order; a group only when a row is
        free for each member (FIFO: nothing behind it goes first). A group's members after the first copy its
        prompt cache."""
        out = []
        if self.gang and self.running:
            return out  # a gang runs alone until all its sequences finished
        while self.waiting and self.slots.n_free:
            group = self.waiting[0].group or [self.waiting[0]]
            if len(group) > self.slots.n_free:
                break
            for seq in group:  # a group waits in one piece, its first member first
                popped = self.waiting.popleft()
                assert popped is seq
                seq.row = self.slots.allocate()
                self.running[seq.row] = seq
                if self.gang:  # prefilled by the gang's one prefill (each member its own)
                    seq.prefilled = len(seq.request.prompt_ids)
                elif seq is not group[0]:
                    seq.copy_from, seq.prefilled = group[0], len(seq.request.prompt_ids) - 1
                out.append(seq)
        return out

    def prefill_chunks(self) -> list[tuple[int, int]]:
        """This step's prefill: (row, tokens) per chunk, oldest request first, a request's chunks in order (it may
        have several in one step), stopping at the first chunk that does not fit the budget: no younger request
        is prefilled ahead of an older one, and no chunk is cut. Counted as prefilled at once (the plan's
        execution prefills exactly them). A sequence that copies another's prompt cache waits for a plan after
        the one that completed that prefill."""
        self.plans += 1
        left, out = self.budget, []
        for seq in sorted(self.running.values(), key=lambda q: q.arrival):
            src = seq.copy_from
            if src is not None and (src.prefill_plan is None or src.prefill_plan >= self.plans):
                continue
            while seq.prefilling:
                n = min(self.chunk - seq.prefilled % self.chunk, len(seq.request.prompt_ids) - seq.prefilled)
                if n > left:
                    return out
                seq.prefilled += n
                left -= n
                out.append((seq.row, n))
                if not seq.prefilling:
                    seq.prefill_plan = self.plans
        return out

    def drop(self, seq: Sequence) -> None:
        """An aborted sequence leaves the queue or its row. Its group's members that were to copy its prompt cache
        before its prefill completed prefill the prompt themselves (the runner's `release` does the same)."""
        if seq.group is not None:
            seq.group.remove(seq)
        if seq.row is None:
            self.waiting.remove(seq)
            return
        for other in self.running.values():
            if other.copy_from is seq and seq.prefill_plan is None:
                other.copy_from, other.prefilled = None, 0
        self.finish(seq.row)

    def finish(self, row: int) -> Sequence:
        seq = self.running.pop(row)
        self.slots.release(row)
        return seq

    # ---------------------------------------------------------------- after the step
    def _apply_aborts(self) -> list[RequestOutput]:
        out = []
        for rid in self._aborts:
            seq = self.requests.pop(rid, None)
            if seq is None:
                continue
            if seq.row is not None:
                self._leave(seq.row)
            self.drop(seq)
            out.append(RequestOutput(rid, [], True, "abort", len(seq.request.prompt_ids), seq.emitted))
        self._aborts.clear()
        return out

    def update(self, steps: list[list[RowTokens]], eos_ids: set[int], stats: EngineStats,
               step_gamma: int = 0) -> None:
        """Commit the tokens of the steps read back to their sequences (the stop rules: `Sequence.commit`), with
        their log-probabilities, and count them in `stats`. A step in which no row still decoded (the loop's extra
        step after the last stop) is not counted. step_gamma: a decode step's Γ (0: no drafts), where a sequence has
        no Γ of its own (--gamma auto)."""
        for rows in steps:
            active = 0
            for r in rows:
                seq = self.running.get(r.row)
                if seq is None or seq.finished:
                    continue
                lp = r.logprobs
                k = seq.request.params.logprobs
                if r.first is not None:  # the prefill's first token, not a decode step's
                    seq.commit([r.first], eos_ids)
                    if lp is not None:
                        seq.logprobs.append(to_logprob(*lp[0], k))
                        lp = lp[1:]
                    if seq.finished:
                        continue
                g = step_gamma
                if seq.gamma is not None:  # --gamma auto: the Γ this step was launched with for the row
                    g = seq.gamma.launched[len(seq.gamma.results)] if len(seq.gamma.launched) > len(
                        seq.gamma.results) else g
                    seq.gamma.observe(len(r.tokens) - 1)
                stats.drafts += g > 0
                stats.drafted += g
                active += 1
                stats.step_tokens += len(r.tokens)
                kept = seq.commit(r.tokens, eos_ids)
                stats.produced += kept
                if lp is not None:
                    seq.logprobs += [to_logprob(*lp[j], k) for j in range(kept)]
            if active:
                stats.steps += 1
                stats.active_seq_steps += active

    def collect(self, prompt_logprobs: Callable[[int], list | None]) -> list[RequestOutput]:
        """New tokens per request, and the requests aborted since the last call; finished requests leave, and their
        rows are released by the next plan (a gang's are frozen, then released together once the whole gang
        finished). prompt_logprobs(row): the prompt log-probabilities of the row's sequence, for its first output."""
        out, self._outputs = self._outputs, []
        for row, seq in list(self.running.items()):
            if seq.prefilling:
                continue
            toks = seq.output_ids
            new = toks[seq.emitted:]
            done = seq.finished
            if not new and not done:
                continue
            seq.emitted = len(toks)
            if done:
                self._leave(row)
                self.finish(row)
                if seq.group is not None:
                    seq.group.remove(seq)
                del self.requests[seq.request.request_id]
            o = RequestOutput(seq.request.request_id, list(new), done, seq.finish_reason,
                              len(seq.request.prompt_ids), len(toks))
            if seq.request.params.logprobs is not None:
                o.logprobs = seq.logprobs[len(toks) - len(new):len(toks)]
            if len(toks) == len(new):  # the request's first output
                o.prompt_logprobs = prompt_logprobs(row)
            out.append(o)
        return out

    def _leave(self, row: int) -> None:
        """A sequence left its row (finished or aborted): the next plan releases the row; in a gang it freezes the
        row instead, and the gang's rows are released together once none of its sequences runs."""
        if not self.gang:
            self._to_release.append(row)
            return
        self._gang_rows.add(row)
        if all(r == row for r in self.running):  # the gang's last sequence
            self._to_release += sorted(self._gang_rows)
            self._gang_rows.clear()
        else:
            self._to_freeze.append(row)


@dataclass(frozen=True)
class Admission:
    """A waiting request given an idle row: the arguments of `Runner.admit`, and whether it ignores EOS."""

    row: int
    prompt_ids: tuple[int, ...]
    limit: int
    sampling: SamplingRule
    seed: int | None
    ignore_eos: bool
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prefix_from: int | None = None  # the row whose prompt cache this one copies (n sequences of one prompt)

    @classmethod
    def of(cls, seq: Sequence) -> Admission:
        p = seq.request.params
        return cls(seq.row, tuple(seq.request.prompt_ids), p.max_tokens, p.sampling, p.seed, p.ignore_eos,
                   p.logprobs, p.prompt_logprobs, None if seq.copy_from is None else seq.copy_from.row)


@dataclass(frozen=True)
class StepPlan:
    """Every call one engine step makes on the runner, in order: freeze rows (a gang's sequences that finished: their
    rows stop decoding and keep their caches until the whole gang finished), release rows (finished last step, or
    aborted), admit requests to rows, prefill chunks of exactly the given sizes (or the gang's whole prompts), then
    one decode step over all rows if `decode`. Plain picklable data, decided by rank 0's scheduler alone, so a
    follower that executes the same plans on the same runner state makes the same calls; the stop rules are the
    scheduler's too (`Sequence.commit`), and a finished sequence's row stops decoding when a plan releases (or
    freezes) it. An empty plan does nothing (the idle heartbeat); `stop` ends the followers' `follow()`
    (dustin/engine/executor.py)."""

    freeze: tuple[int, ...] = ()  # rows whose sequence stopped, kept until their gang finished
    release: tuple[int, ...] = ()
    admit: tuple[Admission, ...] = ()
    prefill: tuple[tuple[int, int], ...] = ()  # (row, prompt tokens)
    gang: bool = False  # a gang admission: prefill every admitted row at once (`Executor`)
    decode: bool = False
    gammas: tuple[tuple[int, int], ...] = ()  # (row, Γ) for the decode step (--gamma auto), set before it
    stop: bool = False
