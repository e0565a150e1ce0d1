"""What a serving client asks for and what it gets back, per request (the engine core's public types).

`EngineCore` (engine/core.py) takes `Request`s, schedules them into KV-cache slots and returns
`RequestOutput`s: the new tokens of every request that advanced in one `step()`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dustin.errors import InputError

MAX_LOGPROBS = 20  # most likely tokens a request may ask for per position (OpenAI's cap on top_logprobs)
# a SamplingParams field -> the command-line flag that sets it (`SamplingParams.from_flags`)
_FLAGS = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "ignore_eos": "ignore_eos"}


@dataclass(frozen=True)
class SamplingRule:
    """How a row draws its tokens, in the device's ranges (`SamplingParams.sampling`); dustin/engine/sampling.py
    applies it. Plain data, so that a request's settings are checked without torch."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p cut the distribution (a greedy rule's are never applied)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters, with vLLM's names and defaults (OpenAI's too: `temperature` 1.0, so a
    request samples unless it asks for temperature 0, greedy). The method, Γ and the sparse budget are the
    engine's (chosen at start); these may differ between requests of one batch."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # sampling seed of this request (None: the engine's stream)
    ignore_eos: bool = False
    # log-probabilities (of the target's raw distribution: log-softmax of its logits before temperature, top-k and
    # top-p), with the `logprobs` most likely tokens at each position (0..MAX_LOGPROBS); None: not computed
    logprobs: int | None = None  # of each generated token
    prompt_logprobs: int | None = None  # of each prompt token after the first (the dense prefill's)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0 <= self.temperature < math.inf):  # NaN fails too
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise InputError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")

    @classmethod
    def from_flags(cls, args, **fixed) -> "SamplingParams":
        """The sampling flags of a command line (--max-new-tokens, --temperature, --top-p, --top-k, --ignore-eos;
        those the command lacks keep the defaults above, `fixed` overrides), with a bad value's message naming its
        flag. The checks stay in `__post_init__`, so a value is checked by one rule whichever edge it came through."""
        values = {f: getattr(args, a) for f, a in _FLAGS.items() if getattr(args, a, None) is not None} | fixed
        try:
            return cls(**values)
        except InputError as e:
            msg = str(e)
            for f, a in _FLAGS.items():
                if msg.startswith(f + " "):
                    msg = "--" + a.replace("_", "-") + msg[len(f):]
            raise InputError(msg) from None

    @property
    def sampling(self) -> SamplingRule:
        # values past what the device's float32 / int64 hold are brought within them where that changes nothing:
        # a top_p that float32 rounds to 0 keeps only the most likely token, as float32's smallest normal number
        # does; above 1e30 a temperature makes every kept token equally likely in float32, as 1e30 does; a top_k
        # of at least the vocabulary is off, as 2^31 is
        return SamplingRule(min(self.temperature, 1e30), min(self.top_k, 2**31), max(self.top_p, 2.0 ** -126))


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability and the `logprobs` most likely tokens at its position, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RequestOutput:
    """What one `step()` produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" (EOS) | "length" (max_tokens) | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # all tokens generated so far, new ones included
    logprobs: list[Logprob] | None = None  # of new_token_ids, when the request asked for them
    # the request's first output, when it asked for them: one per prompt token, None for the first
    prompt_logprobs: list[Logprob | None] | None = None
