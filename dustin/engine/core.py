"""The engine core: requests join a running batch of KV-cache slots and leave when done. The server, offline
generation (`Engine.generate`, `LLM.generate`), evaluation and the end-to-end benchmark all run on it.

    core = EngineCore.from_pretrained("default", "default", device="cuda",
                                      config=GenerationConfig(method="dustin", max_slots=16))
    core.add_request(Request("r1", prompt_ids, SamplingParams(max_tokens=64)))
    while core.has_unfinished():
        for out in core.step():          # schedule -> execute -> update -> collect
            print(out.request_id, out.new_token_ids, out.finished)

It owns the `Scheduler` (requests, rows, prefill chunks, chunked or gang admission, outputs), the `Executor` (the
plan's calls on the runner, dustin/engine/worker/; the step in flight) and the step loop. A `StepPlan` is plain
data: under tensor parallelism rank 0 schedules and broadcasts it and every rank executes it (docs/architecture.md).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from dustin.engine.config import METHODS, GenerationConfig
from dustin.engine.executor import Executor, GangPrefill, TensorParallelExecutor
from dustin.engine.gamma import GammaRule, StepCosts
from dustin.engine.kv_manager import KVManager, cache_capacity, max_tokens_room
from dustin.engine.pair import ModelPair, check_prompts
from dustin.engine.request import Request, RequestOutput, SamplingParams, SamplingRule
from dustin.engine.sampling import GREEDY
from dustin.engine.scheduler import EngineStats, Scheduler, Sequence, StepPlan, check_admission
from dustin.engine.warmup import start_kernel_warmup
from dustin.engine.worker.costs import measure_step_costs
from dustin.engine.worker.runner import Runner
from dustin.engine.worker.staging import RowTokens
from dustin.errors import InputError, OutOfMemoryError
from dustin.models.fetch import resolve_model_path

# prompt tokens per prefill forward on a GPU (the padded size of every prefill step); docs/serving.md has the
# H200 measurement it comes from
DEFAULT_PREFILL_TOKENS_GPU = 8192


class EngineCore:
    def __init__(self, pair: ModelPair, config: GenerationConfig, *, slots: int | None = None,
                 capacity: int | None = None, policy=None, kernel_warmup: bool = True, gang: bool = False,
                 gang_prefill: GangPrefill | None = None, step_costs: StepCosts | None = None,
                 max_new_tokens: int | None = None, shared: SamplingRule = GREEDY) -> None:
        """config: the engine's settings. slots/capacity/policy: an offline batch (one slot per prompt, the capacity
        its prompts need); the server leaves them None. max_new_tokens: the most new tokens a request may ask (None:
        the engine's context). shared: the sampling rule under which rows draw from the engine's generator rather
        than each from its own stream (`RowSampling`): greedy for the server; an offline batch run with one
        `SamplingParams` passes its rule.
        gang: admit the waiting requests together and prefill them at once (always for a policy that is not
        `row_local`). gang_prefill: what makes a gang's prompt caches instead (dustin/engine/offline/prefill.py).
        step_costs: --gamma auto's cost model (None: measured now, `measure_step_costs`).
        kernel_warmup: on a GPU, compile the first prefill's and decode step's kernels in the background
        (dustin/engine/warmup.py: planned for `pair.make_policy`'s policy; not for a gang's prefill)."""
        if pair.draft is None and METHODS[config.method].speculative:
            raise InputError(f"method {config.method!r} needs a draft model (--draft)")
        self.pair, self.config = pair, config
        self.tokenizer = pair.tokenizer
        cuda = pair.device.type == "cuda"
        context = pair.max_context(config.spec.speculative)
        if config.max_context is not None and config.max_context > context:
            raise InputError(f"--max-context {config.max_context} exceeds the models' context ({context} positions): "
                             f"lower it, or extend the context with --rope-scaling")
        self.max_context = min(config.max_context or (context if cuda else min(context, 8192)), context)
        self.max_slots = slots or config.max_slots or (16 if cuda else 8)
        capacity = capacity or cache_capacity([0], [self.max_context], config.gamma if config.spec.speculative else 0)
        try:
            policy = policy or pair.make_policy(config)
            draft = pair.draft if config.spec.speculative else None
            self.kv = KVManager({"target": pair.target} | ({} if draft is None else {"draft": draft}), self.max_slots,
                                capacity)
            runner = Runner(pair.target, draft, config, pair.vocab_limit, policy, kv=self.kv,
                            max_new_tokens=max_new_tokens or self.max_context, shared=shared)
        except (torch.OutOfMemoryError, OutOfMemoryError):
            need = pair.kv_fit(config.spec.speculative).bytes(self.max_slots, capacity)
            raise OutOfMemoryError(f"{self.max_slots} slots of {capacity} positions need {need / 2**30:.1f} GiB of "
                                   f"KV cache on {pair.device}: lower --max-slots or --max-context") from None
        self.gamma_rule: GammaRule | None = None  # --gamma auto: each sequence's Γ per step
        if config.gamma_auto and config.spec.speculative:
            if pair.parallel is not None and pair.parallel.world > 1:
                raise InputError("--gamma auto does not run under tensor parallelism yet: give --gamma an integer")
            self.gamma_rule = GammaRule(step_costs or measure_step_costs(runner), config.gamma, runner.batch.min_gamma)
        self.prefill_tokens = config.prefill_tokens or max(config.prefill_chunk,
                                                           DEFAULT_PREFILL_TOKENS_GPU if cuda else 512)
        self._budget_read, self._budget_cache = -1e9, None
        gang = gang or gang_prefill is not None or not policy.row_local
        self.scheduler = Scheduler(self.kv.table, config.max_waiting, config.prefill_chunk, self.prefill_tokens,
                                   gang=gang)
        # the offline batch `queue` added: each request's outputs so far, accumulated into one (all its tokens)
        self._queued: dict[str, RequestOutput] = {}
        self.eos_ids = set(pair.eos_ids)  # a request with ignore_eos does not stop at them
        self.decode_stats = EngineStats()
        self._step_gamma = config.gamma if config.spec.speculative else 0  # a decode step's Γ (fixed Γ)
        self.model_name = "dustin"  # from_pretrained names it after the target's folder
        self.counters = {"generated_tokens_total": 0, "busy_s": 0.0, "requests_finished": 0, "requests_aborted": 0}
        # the executor of the plans: here, or (tensor parallelism) on every rank of the target's shards
        self.rank, world = (pair.parallel.rank, pair.parallel.world) if pair.parallel is not None else (0, 1)
        if world > 1:
            self.executor: Executor = TensorParallelExecutor(runner, self.prefill_tokens, gang_prefill,
                                                             rank=self.rank, device=pair.device)
        else:  # the first prefill's and decode step's kernels, compiling in the background (GPU; None when off)
            warmup = None
            if kernel_warmup and not gang:
                warmup = start_kernel_warmup(pair, config, self.max_slots, capacity, self.prefill_tokens,
                                             config.prefill_chunk, shared=shared)
            self.executor = Executor(runner, self.prefill_tokens, gang_prefill, warmup)

    @classmethod
    def from_pretrained(cls, target: str = "default", draft: str | None = "default", *, device: str = "cpu",
                        dtype: str | None = None, attention: str = "auto",
                        config: GenerationConfig | None = None, rope_scaling: str | None = None) -> "EngineCore":
        config = config or GenerationConfig()
        pair = ModelPair.from_pretrained(target, draft if config.spec.speculative else None, device=device,
                                         dtype=dtype, attention=attention, rope_scaling=rope_scaling)
        obj = cls(pair, config)
        obj.model_name = Path(resolve_model_path(str(target), "target")).name
        return obj

    @property
    def runner(self) -> Runner:
        """The batch on the device (the executor's: plans change it, the core only reads it)."""
        return self.executor.runner

    def bind_thread(self) -> None:
        """Make the engine's GPU the calling thread's current CUDA device. `torch.cuda.set_device` holds per
        thread, and a new thread starts on GPU 0: the thread that runs `step()` (the server's engine thread) calls
        this first, so kernels, CUDA graphs and (tensor parallelism) NCCL's plan broadcast use the engine's GPU."""
        if self.pair.device.type == "cuda":
            torch.cuda.set_device(self.pair.device)

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> None:
        """The one check of a request (the server's handler runs it, `add_requests` for callers that did not):
        empty prompt, ids outside the vocabulary, prompt + max_tokens past the slot, more sequences (n) than slots,
        or prompt log-probabilities from a gang's prefill: one InputError."""
        if n > self.max_slots:
            raise InputError(f"n = {n} sequences need {n} KV-cache slots; this engine has {self.max_slots} "
                             f"(--max-slots)")
        if params.max_tokens > self.max_context:
            raise InputError(f"max_tokens {params.max_tokens} exceeds the engine's context ({self.max_context})")
        check_admission(params, self.scheduler.gang, self.config.method)
        try:
            check_prompts([prompt_ids], self.config, self.max_context, self.pair.vocab_limit, [params.max_tokens])
        except InputError as e:
            raise InputError(str(e).replace("prompt 0 ", "the prompt ")) from None

    def max_tokens_room(self, prompt_len: int) -> int:
        """The largest max_tokens a prompt of `prompt_len` tokens may ask (`check_request` admits it, and one more
        it refuses): the server's headroom, by the KV manager's rule (`max_tokens_room`), for `n` of any size."""
        return max_tokens_room(self.max_context, prompt_len, self.config.gamma)

    def add_request(self, request: Request) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[Request], checked: bool = False) -> None:
        """One request, or the sequences of one prompt (OpenAI's `n`, each with its own parameters and seed): admitted
        together, the first prefills the prompt and the others copy its prompt cache. checked: the caller already
        ran `check_request` on each (the server's handler, `Engine.generate`)."""
        if any(r.prompt_ids != requests[0].prompt_ids for r in requests):
            raise InputError("the sequences of one group must share their prompt")
        if not checked:
            for r in requests:
                self.check_request(r.prompt_ids, r.params, len(requests))
        now = time.perf_counter()
        seqs = [Sequence(r, now) for r in requests]
        if len(seqs) > 1:
            for seq in seqs:
                seq.group = seqs
        self.scheduler.add(seqs)

    def sequence(self, request_id: str) -> Sequence | None:
        """The request's sequence while it waits or runs (None once it finished or was aborted)."""
        return self.scheduler.requests.get(request_id)

    def abort_request(self, request_id: str) -> None:
        """Waiting or running: the next step() frees its row and reports it finished ("abort")."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests) or self.executor.in_flight is not None

    def drain(self) -> None:
        """Read back the step in flight, if any (its tokens are booked; the next `step()` returns them)."""
        self.update(self.executor.drain())

    def begin_run(self, seed: int) -> None:
        """Start a new offline run on this core (a kept one serves several): fresh statistics and timers, and the
        generators reseeded, so a run's tokens and numbers do not depend on earlier runs."""
        self.decode_stats = EngineStats()
        self.runner.begin_run(seed)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """schedule -> execute (releases, admissions, one packed prefill forward, launch a decode step, read back
        the previous one) -> update -> collect. The device runs a step ahead of the host: the host's work of one
        iteration (detokenizing, HTTP, the next schedule) overlaps the device's step."""
        if self.rank != 0:
            raise RuntimeError("under tensor parallelism only rank 0 steps; the other ranks call follow()")
        t0 = time.perf_counter()
        self.update(self.executor.execute(self.schedule()))
        outputs = self.collect()
        if not self.scheduler.requests:
            # nothing left to serve: read the last launched step back now (its rows have all stopped, it books
            # nothing), so an idle engine holds no step in flight and needs no further step() call
            self.executor.drain()
        b = self.runner.batch
        if outputs or b.active_rows or b.prompt_rows:
            self.counters["busy_s"] += time.perf_counter() - t0
        return outputs

    def schedule(self) -> StepPlan:
        """Rank 0's decisions for one step (`Scheduler.schedule`); only the executor changes the runner."""
        return self.scheduler.schedule(self.executor.compiling, self.gamma_rule, self.decode_stats.gammas)

    def update(self, steps: list[list[RowTokens]]) -> None:
        """Commit the tokens of the steps read back to their sequences, and count them (`Scheduler.update`)."""
        self.scheduler.update(steps, self.eos_ids, self.decode_stats, self._step_gamma)

    def collect(self) -> list[RequestOutput]:
        """New tokens per request, finished requests leaving (`Scheduler.collect`), counted."""
        outputs, c = self.scheduler.collect(self.runner.prompt_logprobs), self.counters
        for o in outputs:
            c["generated_tokens_total"] += len(o.new_token_ids)
            if o.finished:
                c["requests_aborted" if o.finish_reason == "abort" else "requests_finished"] += 1
            if o.request_id in self._queued:
                _accumulate(self._queued[o.request_id], o)
        return outputs

    # ------------------------------------------------------------------ an offline batch on this core
    def queue(self, batch: list[tuple[list[int], SamplingParams]], checked: bool = False) -> list[str]:
        """Offline: add one request per (prompt ids, params), in order; their request ids (`run_queued` collects
        their tokens). checked: as `add_requests`'."""
        ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(batch))]
        for rid, (p, rp) in zip(ids, batch, strict=True):
            self.add_requests([Request(rid, p, rp)], checked)
        self._queued = {rid: RequestOutput(rid, [], False, prompt_tokens=len(p)) for rid, (p, _) in zip(ids, batch,
                                                                                                        strict=True)}
        return ids

    def run_queued(self) -> tuple[list[RequestOutput], dict]:
        """Offline: step until the `queue`d requests (and anything else) finished; each one's whole output (those
        of earlier `step()` calls too), and timings: `prefill_s`, the wall time until every prompt was prefilled
        (decode steps and graph captures meanwhile included), and at that point `produced_after_prefill` (tokens
        booked after it), `capture_total_at_prefill` and `phases_at_prefill` (the runner's totals then)."""
        t0 = time.perf_counter()
        timing = {"prefill_s": 0.0, "produced_after_prefill": 0}
        prefilled = False
        while self.has_unfinished():
            self.step()
            if not prefilled and not self.scheduler.waiting and not self.runner.batch.prompt_rows:
                prefilled = True
                if self.pair.device.type == "cuda":
                    torch.cuda.synchronize(self.pair.device)
                timing["prefill_s"] = time.perf_counter() - t0
                timing["produced_after_prefill"] = -self.decode_stats.produced
                timing["capture_total_at_prefill"] = self.runner.capture_total()
                timing["phases_at_prefill"] = self.runner.timer.totals()
        timing["produced_after_prefill"] += self.decode_stats.produced
        results, self._queued = self._queued, {}
        return list(results.values()), timing

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline: run prompts to completion on this core (a plain loop over `step`); their new token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        self.queue(list(zip(prompts, plist, strict=True)))
        return [o.new_token_ids for o in self.run_queued()[0]]

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        b, sched = self.runner.batch, self.scheduler
        used = list(sched.running)
        c, ex, st = self.counters, self.executor, self.decode_stats
        return {
            "requests_waiting": len(sched.waiting), "requests_running": len(used),
            "kv_slots_used": len(used), "kv_slots_total": self.max_slots,
            "kv_usage": sum(b.host_lengths[r] for r in used) / (self.max_slots * b.target_cache.capacity),
            "prompt_tokens_total": ex.prompt_tokens, "generated_tokens_total": c["generated_tokens_total"],
            "steps_total": ex.steps, "tau": st.tau,
            "tokens_per_s": c["generated_tokens_total"] / c["busy_s"] if c["busy_s"] > 0 else 0.0,
            "requests_finished": c["requests_finished"], "requests_aborted": c["requests_aborted"],
            "budget_k": self._budget_k(),
            # speculative decoding (vLLM's spec_decode counters): verify steps of a sequence with drafts, the draft
            # tokens they proposed and those accepted
            "spec_drafts_total": st.drafts, "spec_draft_tokens_total": st.drafted,
            "spec_accepted_tokens_total": st.step_tokens - st.active_seq_steps,
        }

    BUDGET_REFRESH_S = 2.0  # /metrics' k statistics are at most this old

    def _budget_k(self) -> dict | None:
        """--budget auto: the k used so far (mean, percentiles). Reading the device histogram waits for the
        step in flight, so it is refreshed at most every BUDGET_REFRESH_S seconds, not after every step."""
        now = time.monotonic()
        if now - self._budget_read >= self.BUDGET_REFRESH_S:
            self._budget_read = now
            self._budget_cache = self.runner.policy.budget_stats()
        return self._budget_cache


def _accumulate(total: RequestOutput, o: RequestOutput) -> None:
    """Add one step's output of a request to its whole output so far."""
    total.new_token_ids += o.new_token_ids
    total.finished, total.finish_reason, total.completion_tokens = o.finished, o.finish_reason, o.completion_tokens
    if o.logprobs is not None:
        total.logprobs = (total.logprobs or []) + o.logprobs
    if o.prompt_logprobs is not None:
        total.prompt_logprobs = o.prompt_logprobs
