"""The top-level Python API, in the shape users know from vLLM:

    from dustin import LLM, SamplingParams

    llm = LLM("default", "default", method="dustin")
    for out in llm.generate(["def fib(n):"], SamplingParams(max_tokens=64)):
        print(out.text, out.finish_reason, out.metrics.tau)

`LLM` is a thin layer over `dustin.engine.engine.Engine` (which it keeps as `llm.engine`): it fixes the decoding
method once, passes vLLM's per-request `SamplingParams` straight to the engine core (one batch, each prompt its own
row and rule), and returns one `RequestResult` per prompt. Everything that decodes is the engine core's; nothing
here duplicates its checks.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dustin.defaults import DEFAULT_METHOD, DRAFT_WINDOW, GAMMA
from dustin.engine.config import METHODS, ExecutionOptions, GenerationConfig
from dustin.engine.engine import Engine, GenerationResult
from dustin.engine.request import Logprob, SamplingParams
from dustin.errors import InputError

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Metrics:
    """Statistics of the batch a request was decoded in (see `LLM.generate` for what a batch is): `tau` is the
    mean number of tokens produced per target forward per sequence, `tokens_per_s` the batch's decode-phase
    throughput, `prefill_s` / `decode_s` its wall times, `method` the decoding method and `dtype` the weights'."""

    tau: float
    tokens_per_s: float
    prefill_s: float
    decode_s: float
    steps: int
    method: str
    dtype: str

    @classmethod
    def of(cls, result: GenerationResult) -> "Metrics":
        return cls(result.tau, result.tokens_per_s, result.prefill_s, result.decode_s, result.steps,
                   result.method, result.dtype)


@dataclass
class RequestResult:
    """One prompt's result: its token ids, the generated ids and text (None when the model folder has no
    tokenizer; special tokens are dropped from the text, not from `token_ids`), why it ended ("stop": it emitted an
    EOS id; "length": it reached max_tokens, or it ignores EOS), its batch's `Metrics`, and the log-probabilities
    its SamplingParams asked for: `logprobs`, one `Logprob` per generated token (of the target's distribution before
    temperature, at the verify forward: under sparse verification, the sparse-verified target's), and
    `prompt_logprobs`, one per prompt token (None for the first; from the dense prefill)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: Metrics
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None


class LLM:
    """A target model and its draft, loaded once, that generate with one decoding method.

    target / draft: "default" (the pair fetched by `dustin models fetch`), a local Llama / Qwen2 HF folder, or a
    hub id when the machine is online. The draft is not loaded for non-speculative methods ("vanilla").
    method, gamma (draft tokens per step), budget (sparse verification: KV positions k per sequence; None: the
    sparse config's), config (sparse config: a JSON file, "builtin", or None for the pair's shipped tuned config)
    and draft_window (positions a streaming draft attends) are fixed here, as in `dustin serve`: they decide which
    models load and what the engine allocates, while `SamplingParams` may differ per prompt.
    device: "auto" (cuda when a GPU is available, else cpu), "cpu" or "cuda[:N]"; dtype: "auto" (bf16 on a GPU and
    on CPUs with native bf16, else fp32), "bf16", "fp16" or "fp32".

    Bad settings raise one-line `dustin.errors.InputError`s before any weights load (a sparse config is checked
    against the pair right after loading, not at the first `generate`).
    """

    def __init__(self, target: str | Path = "default", draft: str | Path | None = "default", *,
                 method: str = DEFAULT_METHOD, gamma: int = GAMMA, budget: int | None = None, config: str | None = None,
                 draft_window: int = DRAFT_WINDOW, device: str = "auto", dtype: str = "auto",
                 options: ExecutionOptions | None = None) -> None:
        # GenerationConfig's own checks (unknown method, gamma out of [1, 15], budget < 21, bad window) run here,
        # before the (slow) load; generate() derives every batch's config from this one. options: how batches
        # execute (`ExecutionOptions`: e.g. draft_kernel=True, the draft's layers as one persistent kernel)
        self.base_config = GenerationConfig(method=method, gamma=gamma, budget=budget, sparse_config=config,
                                            draft_window=draft_window, options=options or ExecutionOptions())
        speculative = METHODS[method].speculative
        if speculative and draft is None:
            raise InputError(f"method {method!r} needs a draft model")
        self.engine = Engine.from_pretrained(target, draft if speculative else None, device=device, dtype=dtype)
        if METHODS[method].policy != "full":
            self.engine.pair.make_policy(self.base_config)  # a bad sparse config or budget fails now, not at generate

    @property
    def method(self) -> str:
        return self.base_config.method

    @property
    def tokenizer(self):
        """The target's Hugging Face tokenizer (None when its folder has none)."""
        return self.engine.pair.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, *, chat: bool = False) -> list[RequestResult]:
        """One `RequestResult` per prompt, in the order given.

        prompts: a str or a list of token ids (one prompt), or a list of them. params: one `SamplingParams` for
        every prompt (None: `SamplingParams()`, 16 tokens at temperature 1.0), or one per prompt. chat: wrap text
        prompts in the model's chat template.

        One call is one batch on the engine core, as `dustin serve` runs requests: each prompt takes its own row with
        its own SamplingParams (temperature, top_p, top_k, seed, ignore_eos, max_tokens). A prompt with a `seed`
        draws from its own stream, so its tokens do not depend on the rest of the batch; one without gets a seed
        from the call's stream (seed 0), so a call is reproducible. Greedy output does not depend on the batch.
        A request's `metrics` are its batch's.
        All prompts are checked (empty, outside the vocabulary, too long for the context) before anything runs.
        """
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise InputError("no prompts given")
        plist = _params_list(params, len(prompts))
        for i, p in enumerate(prompts):
            if not (isinstance(p, str) or (isinstance(p, (list, tuple)) and (not p or _is_token_ids(p)))):
                raise InputError(f"prompt {i} is a {type(p).__name__}: pass text or a list of token ids")
        ids = [self.engine.pair.encode(p if isinstance(p, str) else list(p), chat) for p in prompts]
        # the prompts and limits are checked once, by `Engine.generate`
        cfg = replace(self.base_config, max_new_tokens=max(p.max_tokens for p in plist))
        out = self.engine.generate(ids, cfg, params=plist)
        metrics = Metrics.of(out)
        results = []
        for p, seq in zip(ids, out.sequences, strict=True):
            results.append(RequestResult(p, seq.token_ids, seq.text, seq.finish_reason, metrics, seq.logprobs,
                                         seq.prompt_logprobs))
        return results


def _is_token_ids(prompts) -> bool:
    """A non-empty list (or tuple) of ints is ONE prompt of token ids (vLLM's `prompt_token_ids`)."""
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts)


def _params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    plist = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(plist) != n:
        raise InputError(f"got {len(plist)} SamplingParams for {n} prompts: pass one, or one per prompt")
    for i, p in enumerate(plist):
        if not isinstance(p, SamplingParams):
            raise InputError(f"params[{i}] is a {type(p).__name__}, not a SamplingParams")
    return plist
