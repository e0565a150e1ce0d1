"""The engine core: requests join a running batch of KV-cache slots and leave when done. The server, offline
generation (`Engine.generate`, `LLM.generate`), evaluation and the end-to-end benchmark all run on it.

    core = EngineCore.from_pretrained("default", "default", device="cuda",
                                      config=GenerationConfig(method="dustin", max_slots=16))
    core.add_request(Request("r1", prompt_ids, SamplingParams(max_tokens=64)))
    while core.has_unfinished():
        for out in core.step():          # schedule -> execute -> update
            print(out.request_id, out.new_token_ids, out.finished)

Design (nano-vllm's shape, on our speculative step):
- One `Session` in slot mode is the batch: `max_slots` rows of `max_context + 2(Γ+2)` positions, allocated
  once at start (admission by KV memory is admission to a free slot: its size bounds prompt + max_tokens).
  Target and draft caches, score buffers and CUDA graphs live as long as the engine, so graphs are captured
  once (for the one batch size, all slots) and replayed for every request.
- The `Scheduler` keeps a bounded FIFO of waiting requests, gives free rows to them, and hands out at most
  `prefill_chunk` prompt tokens of prefill per step. A long prompt is prefilled in chunks over several steps
  (each chunk attends over the prefix already cached), so running sequences wait at most one chunk's prefill
  per step, not a whole 32k prompt.
- `step()` = schedule (aborts, admissions, prefill chunks) -> one speculative step over every slot (idle and
  prefilling rows ride along masked as done; they cost a few rows of the weight GEMMs and nothing in attention)
  -> postprocess (new tokens per request, finished requests free their rows).
- Greedy output does not depend on the batch: rows never mix, and each row's first tokens come from its own
  prefill. A request with its own `seed` samples from its own generator.
- n sequences of one prompt (`add_requests`, OpenAI's `n`) are admitted together, each to its own row; the first
  is prefilled as usual, and when its prefill completes the others take a copy of its prompt cache and prefill
  only the prompt's last token themselves (their numbers are those of a whole prefill of their own: K/V do not
  depend on how a prompt is cut into chunks), so the prompt is prefilled once.
- Gang admission (`gang`, see `Scheduler`): the waiting requests are admitted together once every row is free and
  prefilled at once; nothing joins them until they have all finished. Policies whose state spans the whole batch
  (quest, specattn, snapkv, oracle: not `row_local`) always run this way; offline method comparisons over one
  prefill ("snapshot", with a `PrefillCache`) and benchmarks over noise-filled caches ("noise") ask for it.

Tensor parallelism (`dustin serve`, offline generation and `bench e2e` under torchrun): a step is split into
`schedule()`, which returns a `StepPlan` (every call the step makes on the Session, as plain picklable data), and
the executor's `execute(plan)`, which makes those calls (dustin/engine/executor.py: rank 0 broadcasts each plan,
the other ranks follow). Postprocessing (new tokens per request, finished requests) is rank 0's alone: the rows it
frees are released by the next plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dustin.engine.config import METHODS, GenerationConfig
from dustin.engine.executor import Executor, TensorParallelExecutor
from dustin.engine.gamma import GammaRule, RowGamma, StepCosts, measure_step_costs
from dustin.engine.kv_manager import KVManager
from dustin.engine.logprobs import to_logprob
from dustin.engine.pair import ModelPair, check_prompts
from dustin.engine.request import Request, RequestOutput, SamplingParams
from dustin.engine.scheduler import Admission, Scheduler, Sequence, StepPlan
from dustin.engine.session import PrefillCache, RowTokens, Session, cache_capacity
from dustin.errors import InputError, OutOfMemoryError

# prompt tokens per prefill forward on a GPU (the padded size of every prefill step); docs/serving.md has the
# H200 measurement it comes from
DEFAULT_PREFILL_TOKENS_GPU = 8192


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



class EngineCore:
    def __init__(self, pair: ModelPair, config: GenerationConfig, *, slots: int | None = None,
                 capacity: int | None = None, policy=None, kernel_warmup: bool = True, gang: str | None = None,
                 prefill_cache: PrefillCache | None = None, step_costs: StepCosts | None = None,
                 max_new_tokens: int | None = None) -> None:
        """config: the engine's settings (method, Γ, budget, serving sizes; its sampling fields are the default of
        rows admitted without SamplingParams).
        slots/capacity/policy: an offline batch on this same loop (one slot per prompt, the capacity its prompts
        need); the server leaves them None.
        max_new_tokens: the most new tokens a request may ask (None: the engine's context, as a server's requests
        may; an offline batch: its largest limit).
        gang: admit the waiting requests together and prefill them this way ("whole", "snapshot" or "noise";
        `Session.prefill_gang`); None: chunked admission, or "whole" for a policy that is not `row_local`.
        prefill_cache: where a "snapshot" gang finds (and leaves) the prompt caches of its prompts.
        step_costs: --gamma auto's cost model (None: measured now, `measure_step_costs`).
        kernel_warmup: on a GPU, compile the kernels of the first prefill forward and decode step in the
        background from now on (dustin/engine/warmup.py; planned for the policy `pair.make_policy` gives, so a
        caller passing another policy may turn it off); the first prefill waits for its own kernels, the first
        decode step for the rest. Not with a gang (its prefill is not the packed one warmed up)."""
        if pair.draft is None and METHODS[config.method].speculative:
            raise InputError(f"method {config.method!r} needs a draft model (--draft)")
        self.pair, self.config = pair, config
        self.tokenizer = pair.tokenizer
        cuda = pair.device.type == "cuda"
        context = pair.max_context(METHODS[config.method].speculative)
        default_context = context if cuda else min(context, 8192)
        if config.max_context is not None and config.max_context > context:
            raise InputError(f"--max-context {config.max_context} exceeds the models' context ({context} positions): "
                             f"lower it, or extend the context with --rope-scaling")
        self.max_context = min(config.max_context or default_context, context)
        self.max_slots = slots or config.max_slots or (16 if cuda else 8)
        gamma = config.gamma if config.spec.speculative else 0
        capacity = capacity or cache_capacity([0], [self.max_context], gamma)
        need = pair.kv_cache_bytes(self.max_slots, capacity, config.spec.speculative)
        try:
            policy = policy or pair.make_policy(config)
            draft = pair.draft if config.spec.speculative else None
            models = {"target": pair.target} | ({} if draft is None else {"draft": draft})
            self.kv = KVManager(models, self.max_slots, capacity)
            session = Session(pair.target, draft, config, pair.vocab_limit, policy, kv=self.kv,
                                   max_new_tokens=max_new_tokens or self.max_context)
        except (torch.OutOfMemoryError, OutOfMemoryError):
            raise OutOfMemoryError(f"{self.max_slots} slots of {capacity} positions need {need / 2**30:.1f} GiB of "
                                   f"KV cache on {pair.device}: lower --max-slots or --max-context") from None
        self.gamma_rule: GammaRule | None = None  # --gamma auto: each sequence's Γ per step
        if config.gamma_auto and config.spec.speculative:
            if pair.parallel is not None and pair.parallel.world > 1:
                raise InputError("--gamma auto does not run under tensor parallelism yet: give --gamma an integer")
            costs = step_costs or measure_step_costs(session)
            self.gamma_rule = GammaRule(costs, config.gamma, session.min_gamma)
        self.prefill_tokens = config.prefill_tokens or max(config.prefill_chunk,
                                                           DEFAULT_PREFILL_TOKENS_GPU if cuda else 512)
        self._budget_read, self._budget_cache = -1e9, None
        if gang is None and not policy.row_local:
            gang = "whole"
        if gang not in (None, "whole", "snapshot", "noise"):
            raise ValueError(f"gang must be whole, snapshot or noise, got {gang!r}")
        self.scheduler = Scheduler(self.max_slots, config.max_waiting, config.prefill_chunk, self.prefill_tokens,
                                   gang=gang)
        self._by_id: dict[str, Sequence] = {}
        self._aborts: list[str] = []
        self._to_release: list[int] = []  # rows whose requests finished: the next plan releases them
        self._outputs: list[RequestOutput] = []  # outputs decided while scheduling (aborts), returned by collect
        # the offline batch `queue` added: each request's outputs so far, accumulated into one (all its tokens)
        self._queued: dict[str, RequestOutput] = {}
        self.eos_ids = set(pair.eos_ids) if config.stop_at_eos else set()
        self.decode_stats = EngineStats()
        self._step_gamma = config.gamma if config.spec.speculative else 0  # a decode step's Γ (fixed Γ)
        self._to_freeze: list[int] = []  # a gang's rows whose sequences finished: frozen by the next plan
        self._gang_rows: set[int] = set()  # rows of the running gang that finished (released when all have)
        self.model_name = "dustin"  # from_pretrained names it after the target's folder
        self.counters = {"generated_tokens_total": 0, "busy_s": 0.0, "requests_finished": 0, "requests_aborted": 0}
        # the executor of the plans: here, or (tensor parallelism) on every rank of the target's shards
        parallel = pair.parallel
        self.rank, world = (parallel.rank, parallel.world) if parallel is not None else (0, 1)
        if world > 1:
            self.executor: Executor = TensorParallelExecutor(session, self.prefill_tokens, prefill_cache,
                                                             rank=self.rank, device=pair.device)
        else:
            # the first prefill's and decode step's kernels, compiling in the background (GPU; None when off)
            warmup = None
            if kernel_warmup and gang is None:
                from dustin.engine.warmup import start_kernel_warmup
                warmup = start_kernel_warmup(pair, config, self.max_slots, capacity, self.prefill_tokens,
                                             config.prefill_chunk)
            self.executor = Executor(session, self.prefill_tokens, prefill_cache, warmup)

    @classmethod
    def from_pretrained(cls, target: str = "default", draft: str | None = "default", *, device: str = "cpu",
                        dtype: str | None = None, attention: str = "auto",
                        config: GenerationConfig | None = None, rope_scaling: str | None = None) -> "EngineCore":
        config = config or GenerationConfig()
        spec = METHODS[config.method]
        from pathlib import Path

        from dustin.models.fetch import resolve_model_path

        pair = ModelPair.from_pretrained(target, draft if spec.speculative else None, device=device, dtype=dtype,
                                         attention=attention, rope_scaling=rope_scaling)
        obj = cls(pair, config)
        obj.model_name = Path(resolve_model_path(str(target), "target")).name
        return obj

    @property
    def session(self) -> Session:
        """The batch on the device (the executor's: plans change it, the core only reads it)."""
        return self.executor.session

    def bind_thread(self) -> None:
        """Make the engine's GPU the calling thread's current CUDA device. `torch.cuda.set_device` holds per
        thread, and a new thread starts on GPU 0: the thread that runs `step()` (the server's engine thread) calls
        this first, so kernels, CUDA graphs and (tensor parallelism) NCCL's plan broadcast use the engine's GPU."""
        if self.pair.device.type == "cuda":
            torch.cuda.set_device(self.pair.device)

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> None:
        """Empty prompt, ids outside the vocabulary, prompt + max_tokens past the slot, more sequences (n) than
        slots, or prompt log-probabilities from a gang's prefill: one InputError."""
        if n > self.max_slots:
            raise InputError(f"n = {n} sequences need {n} KV-cache slots; this engine has {self.max_slots} "
                             f"(--max-slots)")
        if params.max_tokens > self.max_context:
            raise InputError(f"max_tokens {params.max_tokens} exceeds the engine's context ({self.max_context})")
        if params.prompt_logprobs is not None and self.scheduler.gang is not None:
            raise InputError(f"prompt log-probabilities (echo) are not computed by method {self.config.method!r}: its "
                             f"requests are prefilled together as a gang, one sequence at a time")
        try:
            check_prompts([prompt_ids], self.config, self.max_context, self.pair.vocab_limit, [params.max_tokens])
        except InputError as e:
            raise InputError(str(e).replace("prompt 0 ", "the prompt ").replace("--max-new-tokens", "max_tokens")
                             ) from None

    def add_request(self, request: Request) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[Request]) -> None:
        """One request, or several sequences of one prompt (OpenAI's `n`; each its own request, with its own
        parameters and seed): admitted together, the prompt prefilled once (see the module's docstring)."""
        ids = [r.request_id for r in requests]
        taken = [i for i in ids if i in self._by_id]
        if taken or len(set(ids)) != len(ids):
            raise InputError(f"request id {(taken or ids)[0]!r} is already in use")
        if any(r.prompt_ids != requests[0].prompt_ids for r in requests):
            raise InputError("the sequences of one group must share their prompt")
        for r in requests:
            self.check_request(r.prompt_ids, r.params, len(requests))
        now = time.perf_counter()
        seqs = [Sequence(r, now) for r in requests]
        if len(seqs) > 1:
            for seq in seqs:
                seq.group = seqs
        self.scheduler.enqueue(seqs)
        for seq in seqs:
            self._by_id[seq.request.request_id] = seq

    def sequence(self, request_id: str) -> Sequence | None:
        """The request's sequence while it waits or runs (None once it finished or was aborted)."""
        return self._by_id.get(request_id)

    def abort_request(self, request_id: str) -> None:
        """Waiting or running: the next step() frees its row and reports it finished ("abort")."""
        if request_id in self._by_id:
            self._aborts.append(request_id)

    def drain(self) -> None:
        """Read back the step in flight, if any (its tokens are booked; the next `step()` returns them)."""
        self.update(self.executor.drain())

    def begin_run(self, seed: int) -> None:
        """Start a new offline run on this core (a kept one serves several): fresh statistics and timers, and the
        generators reseeded, so a run's tokens and numbers do not depend on earlier runs."""
        self.decode_stats = EngineStats()
        self.session.begin_run(seed)

    def has_unfinished(self) -> bool:
        return bool(self._by_id) or self.executor.in_flight is not None

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """schedule -> execute (tensor parallelism: broadcast the plan first; releases, admissions, one packed
        prefill forward, launch a decode step) -> read back the previous step while this one runs -> update. The
        device runs a step ahead of the host: the host's work of one iteration (detokenizing, HTTP, the next
        schedule) overlaps the device's step."""
        if self.rank != 0:
            raise RuntimeError("under tensor parallelism only rank 0 steps; the other ranks call follow()")
        t0 = time.perf_counter()
        self.update(self.executor.execute(self.schedule()))
        outputs = self.collect()
        if not self._by_id:
            # nothing left to serve: read the last launched step back now (its rows have all stopped, it books
            # nothing), so an idle engine holds no step in flight and needs no further step() call
            self.executor.drain()
        s = self.session
        if outputs or s.active_rows or s.prefilling_rows:
            self.counters["busy_s"] += time.perf_counter() - t0
        return outputs

    def schedule(self) -> StepPlan:
        """Rank 0's decisions for one step (aborts, releases, admissions, prefill chunk sizes, whether to decode),
        as a StepPlan; the bookkeeping here is the scheduler's, the Session is only changed by the executor."""
        self._outputs += self._apply_aborts()
        sched = self.scheduler
        admit = tuple(Admission.of(seq) for seq in sched.admissions())
        prefill = tuple(sched.prefill_chunks())
        gang = sched.gang if admit and sched.gang is not None else None
        freeze, self._to_freeze = tuple(self._to_freeze), []
        release, self._to_release = tuple(self._to_release), []
        # decode when a row is active after this plan: decoding, or its prompt completes now (its first token
        # reaches the host with this step's output)
        decode = any(not seq.prefilling for seq in sched.running.values())
        if decode and prefill and self.executor.compiling:
            decode = False  # the decode step's kernels are still compiling: prefill now, decode once they are ready
        gammas = self._gammas() if decode and self.gamma_rule is not None else ()
        return StepPlan(freeze=freeze, release=release, admit=admit, prefill=prefill, gang=gang, decode=decode,
                        gammas=gammas)

    def _gammas(self) -> tuple[tuple[int, int], ...]:
        """--gamma auto: the Γ of each sequence the step decodes, from its own history (`RowGamma`)."""
        out, counts = [], self.decode_stats.gammas
        for row, seq in self.scheduler.running.items():
            if seq.prefilling or seq.finished:
                continue
            if seq.gamma is None:
                seq.gamma = RowGamma(len(seq.request.prompt_ids))
            g = seq.gamma.next_gamma(self.gamma_rule)
            counts[g] = counts.get(g, 0) + 1
            out.append((row, g))
        return tuple(out)

    # ------------------------------------------------------------------ postprocess (rank 0)
    def _apply_aborts(self) -> list[RequestOutput]:
        out = []
        for rid in self._aborts:
            seq = self._by_id.pop(rid, None)
            if seq is None:
                continue
            if seq.row is not None:
                self._leave(seq.row)
            self.scheduler.drop(seq)
            self.counters["requests_aborted"] += 1
            out.append(RequestOutput(rid, [], True, "abort", len(seq.request.prompt_ids), seq.emitted))
        self._aborts.clear()
        return out

    def update(self, steps: list[list[RowTokens]]) -> None:
        """Commit the tokens of the steps read back to their sequences (the stop rules: `Sequence.commit`), with
        their log-probabilities, and count them. A step in which no row still decoded (the loop's extra step after
        the last stop) is not counted."""
        st, running = self.decode_stats, self.scheduler.running
        for rows in steps:
            active = 0
            for r in rows:
                seq = running.get(r.row)
                if seq is None or seq.finished:
                    continue
                lp = r.logprobs
                k = seq.request.params.logprobs
                if r.first is not None:  # the prefill's first token, not a decode step's
                    seq.commit([r.first], self.eos_ids)
                    if lp is not None:
                        seq.logprobs.append(to_logprob(*lp[0], k))
                        lp = lp[1:]
                    if seq.finished:
                        continue
                g = self._step_gamma
                if seq.gamma is not None:  # --gamma auto: the Γ this step was launched with for the row
                    g = seq.gamma.launched[len(seq.gamma.results)] if len(seq.gamma.launched) > len(
                        seq.gamma.results) else g
                    seq.gamma.observe(len(r.tokens) - 1)
                st.drafts += g > 0
                st.drafted += g
                active += 1
                st.step_tokens += len(r.tokens)
                kept = seq.commit(r.tokens, self.eos_ids)
                st.produced += kept
                if lp is not None:
                    seq.logprobs += [to_logprob(*lp[j], k) for j in range(kept)]
            if active:
                st.steps += 1
                st.active_seq_steps += active

    def collect(self) -> list[RequestOutput]:
        """New tokens per request; finished requests leave the scheduler, and their rows are released by the next
        plan (a gang's are frozen, then released together once the whole gang finished)."""
        out, self._outputs = self._outputs, []
        sched = self.scheduler
        for row, seq in list(sched.running.items()):
            if seq.prefilling:
                continue
            toks = seq.output_ids
            new = toks[seq.emitted:]
            done = seq.finished
            if not new and not done:
                continue
            seq.emitted = len(toks)
            self.counters["generated_tokens_total"] += len(new)
            if done:
                self._leave(row)
                sched.finish(row)
                if seq.group is not None:
                    seq.group.remove(seq)
                del self._by_id[seq.request.request_id]
                self.counters["requests_finished"] += 1
            o = RequestOutput(seq.request.request_id, list(new), done, seq.finish_reason,
                              len(seq.request.prompt_ids), len(toks))
            if seq.request.params.logprobs is not None:
                o.logprobs = seq.logprobs[len(toks) - len(new):len(toks)]
            if len(toks) == len(new):  # the request's first output
                o.prompt_logprobs = self.session.prompt_logprobs(row)
            if o.request_id in self._queued:
                _accumulate(self._queued[o.request_id], o)
            out.append(o)
        return out

    def _leave(self, row: int) -> None:
        """A sequence left its row (finished or aborted): the next plan releases the row; in a gang it freezes the
        row instead, and the gang's rows are released together once none of its sequences runs."""
        if self.scheduler.gang is None:
            self._to_release.append(row)
            return
        self._gang_rows.add(row)
        if all(r == row for r in self.scheduler.running):  # the gang's last sequence
            self._to_release += sorted(self._gang_rows)
            self._gang_rows.clear()
        else:
            self._to_freeze.append(row)

    def queue(self, batch: list[tuple[list[int], SamplingParams]]) -> list[str]:
        """Offline: add one request per (prompt ids, params), in order; their request ids (`run_queued` collects
        their tokens)."""
        ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(batch))]
        for rid, (p, rp) in zip(ids, batch, strict=True):
            self.add_request(Request(rid, p, rp))
        self._queued = {rid: RequestOutput(rid, [], False, prompt_tokens=len(p)) for rid, (p, _) in zip(ids, batch,
                                                                                                        strict=True)}
        return ids

    def run_queued(self) -> tuple[list[RequestOutput], dict]:
        """Offline: step until the `queue`d requests (and anything else) finished; each one's whole output (all its
        tokens, those that earlier `step()` calls returned too, with its finish reason and, when it asked, its
        log-probabilities), and timings:
        `prefill_s`, the wall time until every prompt was prefilled (decode steps of rows that finished their
        prefill earlier run meanwhile, graph captures too), `produced_after_prefill`, tokens booked after that
        point, `capture_total_at_prefill`, the session's graph-capture seconds so far at that point, and
        `phases_at_prefill`, its phase timer's totals then (the decode steps that ran before it, inside `prefill_s`)."""
        t0 = time.perf_counter()
        timing = {"prefill_s": 0.0, "produced_after_prefill": 0}
        prefilled = False
        while self.has_unfinished():
            self.step()
            if not prefilled and not self.scheduler.waiting and not self.session.prefilling_rows:
                prefilled = True
                if self.pair.device.type == "cuda":
                    torch.cuda.synchronize(self.pair.device)
                timing["prefill_s"] = time.perf_counter() - t0
                timing["produced_after_prefill"] = -self.decode_stats.produced
                timing["capture_total_at_prefill"] = self.session.capture_total()
                timing["phases_at_prefill"] = self.session.timer.totals()
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
        s, sched = self.session, self.scheduler
        used = list(sched.running)
        cap = s.target_cache.capacity
        c, ex, st = self.counters, self.executor, self.decode_stats
        return {
            "requests_waiting": len(sched.waiting), "requests_running": len(used),
            "kv_slots_used": len(used), "kv_slots_total": self.max_slots,
            "kv_usage": sum(s.host_lengths[r] for r in used) / (self.max_slots * cap),
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
            self._budget_cache = self.session.policy.budget_stats()
        return self._budget_cache


def _accumulate(total: RequestOutput, o: RequestOutput) -> None:
    """Add one step's output of a request to its whole output so far."""
    total.new_token_ids += o.new_token_ids
    total.finished, total.finish_reason, total.completion_tokens = o.finished, o.finish_reason, o.completion_tokens
    if o.logprobs is not None:
        total.logprobs = (total.logprobs or []) + o.logprobs
    if o.prompt_logprobs is not None:
        total.prompt_logprobs = o.prompt_logprobs
