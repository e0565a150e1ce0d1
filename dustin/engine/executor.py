"""The executor: it carries out the engine core's step plans on the batch's runner (dustin/engine/worker/), in one
process or on every rank of a tensor-parallel engine.

The core decides and the executor acts. `EngineCore.schedule()` turns the requests into a `StepPlan`, plain data
that lists every call the step makes on the runner: rows to freeze and release, admissions, prefill chunks of
decided sizes, and whether to decode and at which Γ per row. `execute(plan)` makes those calls, launches the plan's
decode step, reads back the step launched before it, and returns the tokens read back. `EngineCore.update()` then
commits them to the sequences. The device thus runs a step ahead of the host: a step's host work overlaps the
device's next step, and the executor holds the one step in flight.

- `Executor`: one process.
- `TensorParallelExecutor`: rank 0 broadcasts each plan to the other ranks before executing it; every other rank
  runs `follow()`: receive a plan, execute it, until a stop plan. All ranks thus make the same runner calls in the
  same order, so the collectives inside the forwards match, and since every rank seeds its sampling generators
  alike (dustin/parallel/tp.py), sampled tokens agree too. The plans carry no outputs: only rank 0 updates
  sequences, and the rows it frees reach the others as the next plan's releases.

Both have the same four-method protocol for what only tensor parallelism needs (`lead_or_follow`, `follow`,
`heartbeat`, `stop_followers`), so the offline loop and the server call them whatever the executor is.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from dustin.engine.scheduler import StepPlan
from dustin.engine.worker.runner import Runner
from dustin.engine.worker.staging import RowTokens
from dustin.errors import DustinError

GangPrefill = Callable[[Runner], None]  # a gang's prefill made another way (dustin/engine/offline/prefill.py)


class Executor:
    """Executes step plans on `runner` in this process (see the module's docstring)."""

    def __init__(self, runner: Runner, prefill_tokens: int, gang_prefill: GangPrefill | None = None,
                 kernel_warmup=None) -> None:
        """prefill_tokens: the padded size of every packed prefill forward. gang_prefill: what prefills a gang
        admission instead of `Runner.prefill_gang` (an offline batch's copied or noise-filled prompt caches).
        kernel_warmup: the first prefill's and decode step's kernels, compiling in the background
        (dustin/engine/warmup.py), or None."""
        self.runner = runner
        self.prefill_tokens = prefill_tokens
        self.gang_prefill = gang_prefill
        self.kernel_warmup = kernel_warmup
        self.warmup_stats: dict | None = None  # the background compiles' stats, once the first decode step waited
        self.in_flight: int | None = None  # the staging slot of the launched step not yet read back
        self.prompt_tokens = 0  # prompt tokens prefilled
        self.steps = 0  # decode steps launched

    @property
    def compiling(self) -> bool:
        """Whether the decode step's kernels are still compiling in the background (the scheduler then prefills
        and decodes once they are ready)."""
        return self.kernel_warmup is not None and self.kernel_warmup.running

    def execute(self, plan: StepPlan) -> list[list[RowTokens]]:
        """Make the plan's runner calls, launch its decode step and read back the previous one; the tokens of the
        steps read back, in order."""
        s = self.runner
        for row in plan.freeze:
            s.stop(row)
        for row in plan.release:
            s.release(row)
        for a in plan.admit:
            s.admit(a.row, list(a.prompt_ids), a.limit, a.sampling, a.seed, logprobs=a.logprobs,
                    prompt_logprobs=a.prompt_logprobs, prefix_from=a.prefix_from)
        if plan.prefill:
            if self.kernel_warmup is not None:
                self.kernel_warmup.wait_prefill()  # the prefill forward's kernels are compiled first
            s.prefill(list(plan.prefill), pad_to=self.prefill_tokens)
            self.prompt_tokens += sum(n for _, n in plan.prefill)
        if plan.gang:
            if self.gang_prefill is None:
                s.prefill_gang()
            else:
                self.gang_prefill(s)
            self.prompt_tokens += sum(len(a.prompt_ids) for a in plan.admit)
        slot = None
        done = []
        if plan.decode:
            if self.kernel_warmup is not None:
                self._finish_kernel_warmup()
            for row, g in plan.gammas:
                s.set_gamma(row, g)
            if self.in_flight is not None and s.catch_up_pending:  # it feeds the tokens of every earlier step
                done += self.drain()
            slot = s.launch(overlapped=s.overlappable)
            self.steps += 1
        done += self.drain()
        self.in_flight = slot
        if slot is not None and not s.overlappable:
            done += self.drain()
        return done

    def drain(self) -> list[list[RowTokens]]:
        """Read back the step in flight, if any: its tokens (one list), or none."""
        if self.in_flight is None:
            return []
        slot, self.in_flight = self.in_flight, None
        return [self.runner.complete(slot)]

    def _finish_kernel_warmup(self) -> None:
        """Before the first decode step: wait for the background compiles (a one-time cost, reported with the
        first step's and the graph capture's as the runner's capture time)."""
        warmup, self.kernel_warmup = self.kernel_warmup, None
        self.warmup_stats = warmup.wait()
        self.runner.add_one_time_s(self.warmup_stats["wait_s"])

    # ------------------------------------------------------------------ the tensor-parallel protocol
    def lead_or_follow(self, lead):
        """One offline run: `lead()`, which steps the core (see `TensorParallelExecutor` for the ranks)."""
        return lead()

    def follow(self) -> int:
        raise RuntimeError("follow() is for ranks > 0 of a tensor-parallel engine")

    def heartbeat(self) -> None:
        """Nothing to keep alive in one process."""

    def stop_followers(self) -> bool:
        """No followers to stop: True."""
        return True


class TensorParallelExecutor(Executor):
    """One rank's executor of a tensor-parallel engine (see the module's docstring). On rank 0 the followers'
    state: "waiting" (for the next plan), "busy" (a plan was sent and is not finished here: after an error there,
    the followers are somewhere inside a step this rank left, so nothing more can be sent) or "stopped" (they left
    `follow()`; the next `lead_or_follow` of an offline core brings them back)."""

    heartbeat_s = 30.0  # the longest idle gap between plans sent to the followers (`heartbeat`)

    def __init__(self, runner: Runner, prefill_tokens: int, gang_prefill: GangPrefill | None = None, *,
                 rank: int, device) -> None:
        super().__init__(runner, prefill_tokens, gang_prefill)
        self.rank, self.device = rank, device
        self.followers: str | None = "waiting" if rank == 0 else None
        self._last_sent = time.monotonic()

    def execute(self, plan: StepPlan) -> list[list[RowTokens]]:
        """Rank 0: broadcast the plan to the followers, then execute it here. The followers' state is "busy" from
        the broadcast until this rank finished the plan too, so an error in between leaves it "busy". Other
        ranks: execute it (`follow` calls this with each plan received)."""
        if self.rank != 0:
            return super().execute(plan)
        self._send(plan)
        done = super().execute(plan)
        self.followers = "waiting"
        return done

    def _send(self, plan: StepPlan) -> None:
        """Rank 0: broadcast a plan; the followers are "busy" until the caller sets their next state."""
        from dustin.parallel.tp import broadcast_object

        if self.followers != "waiting":
            raise DustinError(f"the tensor-parallel ranks no longer follow this engine ({self.followers})")
        self.followers = "busy"
        broadcast_object(plan, device=self.device)
        self._last_sent = time.monotonic()

    def follow(self) -> int:
        """Ranks > 0: receive rank 0's plans and execute them until the stop plan; the number of plans received
        (heartbeats included)."""
        from dustin.parallel.tp import broadcast_object

        if self.rank == 0:
            raise RuntimeError("follow() is for ranks > 0 of a tensor-parallel engine")
        received = 0
        while True:
            plan = broadcast_object(None, device=self.device)
            received += 1
            if plan.stop:
                return received
            self.execute(plan)

    def lead_or_follow(self, lead):
        """One offline run: rank 0 calls `lead()` (which steps the core: its plans reach the other ranks), then
        ends the others' `follow()` and hands them its result; the other ranks follow the plans and return that
        result. Every rank returns rank 0's."""
        from dustin.parallel.tp import broadcast_object

        if self.rank != 0:
            self.follow()
            return broadcast_object(None, device=self.device)
        if self.followers == "stopped":  # the last run stopped them; they are back in follow()
            self.followers = "waiting"
        result = lead()
        self.stop_followers()
        broadcast_object(result, device=self.device)
        return result

    def heartbeat(self) -> None:
        """Rank 0, idle: send the followers an empty plan when none went out for `heartbeat_s` seconds (a no-op
        when they do not wait for a plan).

        Why: while rank 0 has no work its followers wait inside the plan broadcast, and a collective that waits
        longer than the process group's timeout fails (NCCL's watchdog then ends the process; the default timeout
        is 10 minutes for NCCL and 30 for gloo), which would end an idle server. A very long timeout instead would
        also keep a rank that is really stuck (a peer died mid-step) waiting that long, so the timeout keeps its
        default and an idle server sends one small broadcast per `heartbeat_s` (the server's engine thread calls
        this whenever it wakes up idle, at least once a second)."""
        if self.followers == "waiting" and time.monotonic() - self._last_sent >= self.heartbeat_s:
            self._send(StepPlan())  # an empty plan: nothing to execute here
            self.followers = "waiting"

    def stop_followers(self) -> bool:
        """Rank 0: send the stop plan, so the followers return from `follow()` (idempotent). True when they were
        told to stop; False when they cannot be: a plan failed on this rank after it was sent, so the followers
        are inside a step this rank left and end only at the process group's timeout (or when this process
        ends)."""
        if self.followers == "waiting":
            self._send(StepPlan(stop=True))
            self.followers = "stopped"
        return self.followers in (None, "stopped")
