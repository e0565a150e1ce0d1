"""The serving engine core: requests join a running batch of KV-cache slots and leave when done.

    engine = LLMEngine.from_pretrained("default", "default", device="cuda", config=ServeConfig(method="dustin"))
    engine.add_request(Request("r1", prompt_ids, RequestParams(max_tokens=64)))
    while engine.has_unfinished():
        for out in engine.step():          # schedule -> run -> postprocess
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
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from dustin.engine.config import METHODS, GenerationConfig
from dustin.engine.engine import Engine, check_prompts
from dustin.engine.request import Request, RequestOutput, RequestParams
from dustin.engine.session import Session, cache_capacity
from dustin.errors import DustinError, InputError, OutOfMemoryError

# sparse policies whose per-sequence state is (re)built by a row's own prefill; quest, snapkv, specattn and
# oracle build state for the whole batch at once (or run full forwards) and stay offline-only
SERVABLE = ("vanilla", "classic", "magicdec", "streaming", "dustin", "dustin-t", "dustin-d")


class QueueFullError(DustinError):
    """The waiting queue is full: the server answers 429."""


@dataclass(frozen=True)
class ServeConfig:
    """The engine's fixed settings, validated once. max_context None: the models' context (capped at 8192 on a
    CPU, where the slots' caches live in host memory); max_slots None: 16 on a GPU, 8 on a CPU."""

    method: str = "dustin"
    gamma: int = 4
    budget: int | None = None  # sparse verification: KV positions per sequence (k)
    sparse_config: str | None = None  # file or 'builtin' (None: the pair's tuned config)
    max_slots: int | None = None
    max_context: int | None = None
    prefill_chunk: int = 2048  # prompt tokens prefilled per step at most (over all admitted requests)
    max_waiting: int = 256
    draft_window: int = 512  # positions the streaming draft attends: sinks + recent
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.method not in SERVABLE:
            raise InputError(f"method {self.method!r} is offline-only (evaluation baseline); serve one of "
                             f"{', '.join(SERVABLE)}")
        for name, low in (("max_slots", 1), ("max_context", 16), ("prefill_chunk", 1), ("max_waiting", 1)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < low):
                raise InputError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")

    def generation(self, max_new_tokens: int) -> GenerationConfig:
        return GenerationConfig(method=self.method, gamma=self.gamma, max_new_tokens=max_new_tokens,
                                budget=self.budget, sparse_config=self.sparse_config, seed=self.seed,
                                draft_window=self.draft_window)


@dataclass
class _Sequence:
    request: Request
    arrival: float
    row: int | None = None
    emitted: int = 0  # tokens already returned by step()
    aborted: bool = False


class Scheduler:
    """Waiting requests (bounded FIFO), the rows they run in, and the prefill token budget of each step."""

    def __init__(self, n_rows: int, max_waiting: int, prefill_chunk: int) -> None:
        self.waiting: deque[_Sequence] = deque()
        self.running: dict[int, _Sequence] = {}  # row -> sequence (prefilling or decoding)
        self.free = list(range(n_rows))
        self.max_waiting, self.prefill_chunk = max_waiting, prefill_chunk

    def enqueue(self, seq: _Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting (--max-waiting "
                                 f"{self.max_waiting}): try again later")
        self.waiting.append(seq)

    def admissions(self) -> list[_Sequence]:
        """Waiting requests given a free row now (lowest rows first), in arrival order."""
        out = []
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.row = self.free.pop(0)
            self.running[seq.row] = seq
            out.append(seq)
        return out

    def finish(self, row: int) -> _Sequence:
        seq = self.running.pop(row)
        self.free.append(row)
        self.free.sort()
        return seq


class LLMEngine:
    def __init__(self, engine: Engine, config: ServeConfig) -> None:
        if engine.draft is None and METHODS[config.method].speculative:
            raise InputError(f"method {config.method!r} needs a draft model (--draft)")
        self.engine, self.config = engine, config
        self.tokenizer = engine.tokenizer
        cuda = engine.device.type == "cuda"
        context = engine.target.args.max_position_embeddings
        if METHODS[config.method].speculative:
            context = min(context, engine.draft.args.max_position_embeddings)
        default_context = context if cuda else min(context, 8192)
        self.max_context = min(config.max_context or default_context, context)
        self.max_slots = config.max_slots or (16 if cuda else 8)
        self.gen_cfg = config.generation(self.max_context)
        gamma = self.gen_cfg.gamma if self.gen_cfg.spec.speculative else 0
        capacity = cache_capacity([0], [self.max_context], gamma)
        need = engine.kv_cache_bytes(self.max_slots, capacity, self.gen_cfg.spec.speculative)
        try:
            policy = engine.make_policy(self.gen_cfg)
            self.session = Session(engine.target, engine.draft if self.gen_cfg.spec.speculative else None, [],
                                   self.gen_cfg, engine.eos_ids, engine.vocab_limit, policy, slots=self.max_slots,
                                   capacity=capacity)
        except (torch.OutOfMemoryError, OutOfMemoryError):
            raise OutOfMemoryError(f"{self.max_slots} slots of {capacity} positions need {need / 2**30:.1f} GiB of "
                                   f"KV cache on {engine.device}: lower --max-slots or --max-context") from None
        self.scheduler = Scheduler(self.max_slots, config.max_waiting, config.prefill_chunk)
        self._by_id: dict[str, _Sequence] = {}
        self._aborts: list[str] = []
        self.model_name = "dustin"  # from_pretrained names it after the target's folder
        self.counters = {"prompt_tokens_total": 0, "generated_tokens_total": 0, "steps_total": 0,
                         "busy_s": 0.0, "requests_finished": 0, "requests_aborted": 0}

    @classmethod
    def from_pretrained(cls, target: str = "default", draft: str | None = "default", *, device: str = "cpu",
                        dtype: str | None = None, attention: str = "auto",
                        config: ServeConfig | None = None) -> "LLMEngine":
        config = config or ServeConfig()
        spec = METHODS[config.method]
        from pathlib import Path

        from dustin.models.fetch import resolve_model_path

        engine = Engine.from_pretrained(target, draft if spec.speculative else None, device=device, dtype=dtype,
                                        attention=attention)
        obj = cls(engine, config)
        obj.model_name = Path(resolve_model_path(str(target), "target")).name
        return obj

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt_ids: list[int], params: RequestParams) -> None:
        """Empty prompt, ids outside the vocabulary, or prompt + max_tokens past the slot: one InputError."""
        if params.max_tokens > self.max_context:
            raise InputError(f"max_tokens {params.max_tokens} exceeds the engine's context ({self.max_context})")
        cfg = self.gen_cfg
        try:
            check_prompts([prompt_ids], cfg, self.max_context, self.engine.vocab_limit, [params.max_tokens])
        except InputError as e:
            raise InputError(str(e).replace("prompt 0 ", "the prompt ").replace("--max-new-tokens", "max_tokens")
                             ) from None

    def add_request(self, request: Request) -> None:
        if request.request_id in self._by_id:
            raise InputError(f"request id {request.request_id!r} is already in use")
        self.check_request(request.prompt_ids, request.params)
        seq = _Sequence(request, time.perf_counter())
        self.scheduler.enqueue(seq)
        self._by_id[request.request_id] = seq

    def abort_request(self, request_id: str) -> None:
        """Waiting or running: the next step() frees its row and reports it finished ("abort")."""
        if request_id in self._by_id:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._apply_aborts()
        s, sched = self.session, self.scheduler
        for seq in sched.admissions():
            p = seq.request.params
            s.admit(seq.row, seq.request.prompt_ids, p.max_tokens, p.sampling, p.seed)
            if p.ignore_eos:
                s.ignore_eos_rows.add(seq.row)
        budget = sched.prefill_chunk
        for row in sorted(s.prefilling_rows, key=lambda r: sched.running[r].arrival):
            if budget <= 0:
                break
            n = s.prefill_chunk(row, budget)
            budget -= n
            self.counters["prompt_tokens_total"] += n
        if s.active_rows:
            s.step()
            self.counters["steps_total"] += 1
        outputs += self._collect()
        if outputs or s.active_rows or s.prefilling_rows:
            self.counters["busy_s"] += time.perf_counter() - t0
        return outputs

    def _apply_aborts(self) -> list[RequestOutput]:
        out = []
        for rid in self._aborts:
            seq = self._by_id.pop(rid, None)
            if seq is None:
                continue
            if seq.row is None:
                self.scheduler.waiting.remove(seq)
            else:
                self.session.release(seq.row)
                self.scheduler.finish(seq.row)
            self.counters["requests_aborted"] += 1
            out.append(RequestOutput(rid, [], True, "abort", len(seq.request.prompt_ids), seq.emitted))
        self._aborts.clear()
        return out

    def _collect(self) -> list[RequestOutput]:
        out = []
        s = self.session
        for row, seq in list(self.scheduler.running.items()):
            if row in s.prefilling_rows:
                continue
            toks = s.outputs[row]
            new = toks[seq.emitted:]
            done = s.finished[row]
            if not new and not done:
                continue
            seq.emitted = len(toks)
            self.counters["generated_tokens_total"] += len(new)
            reason = None
            if done:
                reason = "stop" if toks and toks[-1] in s.eos_ids else "length"
                s.release(row)
                self.scheduler.finish(row)
                del self._by_id[seq.request.request_id]
                self.counters["requests_finished"] += 1
            out.append(RequestOutput(seq.request.request_id, list(new), done, reason,
                                     len(seq.request.prompt_ids), len(toks)))
        return out

    def generate(self, prompts: list[list[int]], params: RequestParams | list[RequestParams]) -> list[list[int]]:
        """Offline convenience: run prompts to completion through the serving loop; their new token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        pending = list(zip(ids, prompts, plist))
        results: dict[str, list[int]] = {i: [] for i in ids}
        while pending or self.has_unfinished():
            while pending and len(self.scheduler.waiting) < self.scheduler.max_waiting:
                rid, p, rp = pending.pop(0)
                self.add_request(Request(rid, p, rp))
            for o in self.step():
                if o.request_id in results:
                    results[o.request_id] += o.new_token_ids
        return [results[i] for i in ids]

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        s, sched = self.session, self.scheduler
        used = list(sched.running)
        cap = s.target_cache.capacity
        c = self.counters
        return {
            "requests_waiting": len(sched.waiting), "requests_running": len(used),
            "kv_slots_used": len(used), "kv_slots_total": self.max_slots,
            "kv_usage": sum(s.host_lengths[r] for r in used) / (self.max_slots * cap),
            "prompt_tokens_total": c["prompt_tokens_total"], "generated_tokens_total": c["generated_tokens_total"],
            "steps_total": c["steps_total"], "tau": s.stats.tau,
            "tokens_per_s": c["generated_tokens_total"] / c["busy_s"] if c["busy_s"] > 0 else 0.0,
            "requests_finished": c["requests_finished"], "requests_aborted": c["requests_aborted"],
        }
