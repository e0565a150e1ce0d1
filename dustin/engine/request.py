"""What a serving client asks for and what it gets back, per request (the engine core's public types).

`LLMEngine` (engine/llm_engine.py) takes `Request`s, schedules them into KV-cache slots and returns
`RequestOutput`s: the new tokens of every request that advanced in one `step()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dustin.engine.sampling import SamplingRule
from dustin.errors import InputError


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

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def sampling(self) -> SamplingRule:
        return SamplingRule(self.temperature, self.top_k, self.top_p)


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
