"""The scheduler's half of the engine core: a request's `Sequence`, the waiting queue and the rows, and the
`StepPlan` each step hands to the runner as plain data (dustin/engine/core.py runs it)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dustin.engine.gamma import RowGamma
from dustin.engine.request import Request
from dustin.engine.sampling import SamplingRule
from dustin.errors import DustinError


class QueueFullError(DustinError):
    """The waiting queue is full: the server answers 429."""



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
    """Waiting requests (bounded FIFO), the rows they run in, and each step's prefill.

    Two kinds of admission:
    - chunked (`gang` None): a request joins the running batch as soon as a row is free, and each step prefills
      whole chunks of `chunk` tokens (a prompt is always cut at the same offsets, multiples of `chunk` from its
      start, whatever else runs), oldest request first, at most `budget` tokens in all;
    - gang (`gang` = how the batch is prefilled: "whole", "snapshot" or "noise"; `Session.prefill_gang`): the
      waiting requests are admitted together once every row is free, prefilled at once, and nothing joins them
      until all have finished. Policies whose state spans the whole batch (quest, specattn, snapkv, oracle) run
      this way, and so do method comparisons over one prefill and benchmarks over noise-filled caches."""

    def __init__(self, n_rows: int, max_waiting: int, chunk: int, budget: int, gang: str | None = None) -> None:
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # row -> sequence (prefilling or decoding)
        self.free = list(range(n_rows))
        self.max_waiting, self.chunk, self.budget = max_waiting, chunk, budget
        self.gang = gang
        self.plans = 0  # prefill plans made (`prefill_chunks` calls)

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
        if self.gang is not None and self.running:
            return out  # a gang runs alone until all its sequences finished
        while self.waiting and self.free:
            group = self.waiting[0].group or [self.waiting[0]]
            if len(group) > len(self.free):
                break
            for seq in group:  # a group waits in one piece, its first member first
                popped = self.waiting.popleft()
                assert popped is seq
                seq.row = self.free.pop(0)
                self.running[seq.row] = seq
                if self.gang is not None:  # prefilled by the gang's one prefill (each member its own)
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
        before its prefill completed prefill the prompt themselves (the Session's `release` does the same)."""
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
        self.free.append(row)
        self.free.sort()
        return seq


@dataclass(frozen=True)
class Admission:
    """A waiting request given an idle row: the arguments of `Session.admit`, and whether it ignores EOS."""

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
    """Every call one engine step makes on the Session, in order: freeze rows (a gang's sequences that finished: their
    rows stop decoding and keep their caches until the whole gang finished), release rows (finished last step, or
    aborted), admit requests to rows, prefill chunks of exactly the given sizes (or the gang's whole prompts), then
    one decode step over all rows if `decode`. Plain picklable data, decided by rank 0's scheduler alone, so a
    follower that executes the same plans on the same Session state makes the same calls; the stop rules are the
    scheduler's too (`Sequence.commit`), and a finished sequence's row stops decoding when a plan releases (or
    freezes) it. An empty plan does nothing (the idle heartbeat); `stop` ends the followers' `follow()`
    (dustin/engine/executor.py)."""

    freeze: tuple[int, ...] = ()  # rows whose sequence stopped, kept until their gang finished
    release: tuple[int, ...] = ()
    admit: tuple[Admission, ...] = ()
    prefill: tuple[tuple[int, int], ...] = ()  # (row, prompt tokens)
    gang: str | None = None  # a gang admission: prefill every admitted row at once this way (`Session.prefill_gang`)
    decode: bool = False
    gammas: tuple[tuple[int, int], ...] = ()  # (row, Γ) for the decode step (--gamma auto), set before it
    stop: bool = False
