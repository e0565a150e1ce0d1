"""Offline generation: the model pair, and batches of prompts run to completion on an `EngineCore`.

    engine = Engine.from_pretrained("default", "default", device="cuda")
    result = engine.generate(["def quicksort(xs):"], GenerationConfig(method="classic", gamma=4))

The config is the engine core's own (`GenerationConfig`), with the batch's sizes: one slot per prompt, the
models' whole context, and the capacity its prompts need. How a batch is admitted and where its core comes from
is dustin/engine/offline/batch.py's; every batch runs on the same engine core as the server (dustin/engine/core.py).
This is one edge of the engine: a batch's prompts and limits are checked here, once. The models, tokenizer and what
is asked of them are the engine's `pair` (`ModelPair`).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.offline.batch import OfflineBatches
from dustin.engine.offline.prefill import PrefillCache
from dustin.engine.pair import ModelPair, check_prompts
from dustin.engine.request import Logprob, SamplingParams
from dustin.errors import InputError, OutOfMemoryError
from dustin.selection.base import SelectionPolicy


@dataclass
class SequenceResult:
    prompt_len: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None = None  # "stop" (an EOS id) or "length" (its token limit)
    logprobs: list[Logprob] | None = None  # of token_ids, when its SamplingParams asked (`params`)
    prompt_logprobs: list[Logprob | None] | None = None  # one per prompt token (None for the first), when asked


@dataclass
class GenerationResult:
    method: str
    sequences: list[SequenceResult]
    steps: int
    tau: float
    tokens_per_s: float
    prefill_s: float
    decode_s: float
    time_split_s: dict[str, float]
    sparse_config: dict | None = None  # source, k, m and score heads of a sparse method's config
    capture_s: float = 0.0  # one-time CUDA-graph capture, not in decode_s (nor in tokens_per_s)
    dtype: str = ""  # the weights' dtype (what --dtype auto chose, e.g. "bfloat16")
    budget_k: dict | None = None  # --budget auto: the k used per sequence and step (mean, p50, p90, p99, samples)
    # the background compile of the first prefill's and decode step's kernels (GPU; dustin/engine/warmup.py): kernels
    # planned, threads, plan_s, compile_s, prefill_wait_s, wait_s (what the first decode step waited for it: part of
    # capture_s), errors
    kernel_warmup: dict | None = None

    def to_json(self) -> dict:
        return {
            "method": self.method, "dtype": self.dtype, "sparse_config": self.sparse_config,
            "budget_k": self.budget_k, "steps": self.steps,
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3), "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4), "capture_s": round(self.capture_s, 4),
            "kernel_warmup": self.kernel_warmup,
            "time_split_s": {k: round(v, 4) for k, v in self.time_split_s.items()},
            "sequences": [{"prompt_len": s.prompt_len, "token_ids": s.token_ids, "text": s.text}
                          for s in self.sequences],
        }


class Engine:
    """Offline batch generation over a model pair (`pair`: the models, their tokenizer and EOS ids, the policy of a
    method, KV-memory fit; `ModelPair`). On a GPU one engine core is kept across `generate` calls (KV caches, policy
    buffers and CUDA graphs reused; dustin/engine/offline/batch.py); on a CPU each call allocates its own."""

    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        self.batches = OfflineBatches(pair, keep=pair.device.type == "cuda")

    @classmethod
    def from_models(cls, target, draft=None, tokenizer=None, draft_tokenizer=None, parallel=None) -> "Engine":
        """An engine over models already loaded (`ModelPair`'s arguments)."""
        return cls(ModelPair(target, draft, tokenizer, draft_tokenizer, parallel=parallel))

    @classmethod
    def from_pretrained(cls, target, draft=None, **kwargs) -> "Engine":
        """An engine over a pair loaded from folders, "default" or hub ids (`ModelPair.from_pretrained`)."""
        return cls(ModelPair.from_pretrained(target, draft, **kwargs))

    @property
    def keep_session(self) -> bool:
        """Whether row-local batches keep their engine core across calls (the default on a GPU)."""
        return self.batches.keep

    @keep_session.setter
    def keep_session(self, keep: bool) -> None:
        self.batches.keep = keep

    def release_cached(self) -> None:
        """Free the kept engine core's KV caches and graphs (the next `generate` allocates and captures anew)."""
        self.batches.release()
        gc.collect()
        if self.pair.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kept_core(self):
        """The engine core kept across `generate` calls (a GPU's row-local batches), or None."""
        return self.batches.kept_core

    def start(self, prompts: list[list[int]], cfg: GenerationConfig, policy: SelectionPolicy | None = None,
              prefill_cache: PrefillCache | None = None, fill: str | None = None,
              limits: list[int] | None = None, params: list[SamplingParams] | None = None,
              warmup: bool = True, step_costs=None) -> EngineCore:
        """An engine core with `prompts` queued as one offline batch (one slot each), to drive with `step()`.
        limits: new tokens per prompt (default cfg.max_new_tokens each). params: each prompt's own sampling (its
        max_tokens the limit); default cfg's sampling. prefill_cache: greedy batches given the same one over the
        same prompts share one prefill. fill="noise": the prompt caches are filled with noise instead of computed
        (benchmarks with random weights); fill="whole": the batch is one gang that computes its prompts."""
        if cfg.spec.speculative and self.pair.draft is None:
            raise InputError(f"method {cfg.method!r} needs a draft model (--draft)")
        if params is not None:
            if len(params) != len(prompts):
                raise InputError(f"params: one SamplingParams per prompt ({len(prompts)}), got {len(params)}")
            limits = [p.max_tokens for p in params]
        self._validate(prompts, cfg, limits, "max_tokens" if params is not None else "--max-new-tokens")
        if params is None:
            params = [SamplingParams(max_tokens=m, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
                      for m in (limits if limits is not None else [cfg.max_new_tokens] * len(prompts))]
        return self.batches.start(prompts, cfg, params, policy, prefill_cache, fill, warmup, step_costs)

    def generate(self, prompts: list[str] | list[list[int]], cfg: GenerationConfig,
                 policy: SelectionPolicy | None = None, chat: bool = False,
                 prefill_cache: PrefillCache | None = None, limits: list[int] | None = None,
                 params: list[SamplingParams] | None = None, step_costs=None) -> GenerationResult:
        """Run a batch to completion on an engine core (`start`): each prompt's new tokens and text, and the run's
        statistics. limits: new tokens per prompt (default cfg.max_new_tokens for each, the most any may ask).
        params: each prompt's own sampling, EOS rule and seed (its max_tokens the limit); default cfg's.
        step_costs: `--gamma auto`'s cost model (a `StepCosts`; None: measured when the core starts), e.g. the
        `gamma_rule.costs` of an earlier core, so that runs compare under the same Γ decisions."""
        ids = [self.pair.encode(p, chat) for p in prompts]
        try:
            core = self.start(ids, cfg, policy, prefill_cache, limits=limits, params=params, step_costs=step_costs)
            return core.executor.lead_or_follow(lambda: self._run(core, ids, cfg))
        except torch.OutOfMemoryError:
            self.batches.release()
            raise OutOfMemoryError(f"out of {self.pair.device} memory while decoding a batch of {len(ids)}: "
                                   f"lower the batch size or the context length") from None

    def _run(self, core, ids: list[list[int]], cfg: GenerationConfig) -> GenerationResult:
        """The queued batch to completion on `core`, and its result (under tensor parallelism: rank 0's part)."""
        s = core.runner
        c0 = s.capture_total()
        t0 = time.perf_counter()
        outputs, timing = core.run_queued()
        wall = time.perf_counter() - t0
        warm, core.executor.warmup_stats = core.executor.warmup_stats, None  # this call's only
        st = core.decode_stats
        st.capture_s = s.capture_total() - c0
        st.prefill_s = timing["prefill_s"]
        # captures made while other rows still prefilled are inside prefill_s already: subtract only the later ones
        # (a one-shot batch of long prompts captures its step graph during the prefill of its last rows)
        after_prefill = s.capture_total() - timing.get("capture_total_at_prefill", c0)
        st.decode_s = max(wall - st.prefill_s - after_prefill, 0.0)
        # the phases of the decode steps in decode_s: those that ran before the last prompt was prefilled are in
        # prefill_s (a prompt's first decode step is launched with its last chunk)
        before = timing.get("phases_at_prefill", {})
        st.phases = {k: v - before.get(k, 0.0) for k, v in s.timer.totals().items()}
        seqs = [SequenceResult(len(p), o.new_token_ids, self.pair.decode(o.new_token_ids), o.finish_reason, o.logprobs,
                               o.prompt_logprobs) for p, o in zip(ids, outputs, strict=True)]
        split = dict(st.phases)
        split["other"] = max(st.decode_s - sum(split.values()), 0.0)
        sc = s.policy.cfg
        used = None if sc is None else {"source": sc.source, **sc.to_json()}
        produced = timing["produced_after_prefill"]
        return GenerationResult(cfg.method, seqs, st.steps, st.tau, produced / max(st.decode_s, 1e-9),
                                st.prefill_s, st.decode_s, split, used, st.capture_s, self.pair.dtype_name,
                                s.policy.budget_stats(), warm)

    def _validate(self, prompts: list[list[int]], cfg: GenerationConfig, limits: list[int] | None,
                  name: str) -> None:
        """The batch's one check: a limit per prompt in [1, cfg.max_new_tokens], and the prompts (`check_prompts`);
        name: how the messages call the limit ("max_tokens" for `SamplingParams`)."""
        limits = limits if limits is not None else [cfg.max_new_tokens] * len(prompts)
        if len(limits) != len(prompts) or not all(1 <= m <= cfg.max_new_tokens for m in limits):
            raise InputError(f"limits: one value in [1, {cfg.max_new_tokens}] per prompt")
        try:
            check_prompts(prompts, cfg, self.pair.max_context(cfg.spec.speculative), self.pair.vocab_limit, limits)
        except InputError as e:  # its messages name the command line's flag
            raise InputError(str(e).replace("--max-new-tokens", name)) from None
