"""OpenAI-compatible request and response bodies of `dustin serve` (pydantic v2).

Requests: a field these models do not declare is rejected, and so is a declared field of the wrong type (strict
mode: "5" is not an int, true is not a number); the app turns either into a 400 with OpenAI's error body naming the
field. `null` for an optional field means its default, as OpenAI's schema allows. Features the engine does not have
(n > 1, echo, logprobs, penalties, logit_bias, tools, response_format other than text, store) are accepted only at
their neutral value and otherwise rejected with a 400 naming the field, never silently ignored. The fields in
IGNORED_FIELDS are accepted and ignored: none of them changes the output (docs/serving.md says why for each).

Extensions (pass them with the openai client's `extra_body`): `ignore_eos` (always generate max_tokens tokens),
`return_token_ids` (each choice and stream chunk carries the generated `token_ids`).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt, model_validator

# accepted on both endpoints and ignored; each is documented in docs/serving.md ("Fields accepted and ignored")
IGNORED_FIELDS = ("user", "metadata", "service_tier")


class Unsupported(ValueError):
    """A known OpenAI field set to a value this server does not implement (-> 400 naming `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    """A request body, or an object inside one: strict types, no undeclared fields, and a declared field sent as
    `null` is as if it were absent: an optional one takes its default, a required one is missing."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields}


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: int | None = None  # vLLM-style extension; 0 or -1: off
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # only {"type": "text"}, the neutral value
    store: bool = False  # OpenAI keeps the completion for later retrieval; this server keeps none
    # IGNORED_FIELDS: none of them changes what is generated
    user: str | None = None  # an end-user id, for OpenAI's abuse monitoring
    metadata: dict[str, str] | None = None  # tags of a stored completion
    service_tier: str | None = None  # OpenAI's processing tier (latency and price)
    # dustin extensions
    ignore_eos: bool = False
    return_token_ids: bool = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(s == "" for s in stops):
            raise Unsupported("stop", "stop strings must not be empty")
        return list(dict.fromkeys(stops))

    def check_supported(self) -> None:
        if self.n != 1:
            raise Unsupported("n", f"only n = 1 is supported, got n = {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v not in (None, 0, 0.0):
                raise Unsupported(name, f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit_bias is not supported")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            kind = self.response_format.get("type")
            raise Unsupported("response_format", f"response_format {kind!r} is not supported: the output is plain "
                                                 f"text (only {{\"type\": \"text\"}} is accepted)")
        if self.store:
            raise Unsupported("store", "store is not supported: this server keeps no completions")
        self.stop_list()

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments except max_tokens (validated there: InputError -> 400)."""
        top_k = self.top_k if self.top_k is not None else 0
        return {"temperature": 1.0 if self.temperature is None else float(self.temperature),
                "top_p": 1.0 if self.top_p is None else float(self.top_p),
                "top_k": 0 if top_k == -1 else top_k, "seed": self.seed, "ignore_eos": self.ignore_eos}


class CompletionRequest(_SamplingFields):
    # text, token ids, or a batch of exactly one of either
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise Unsupported("echo", "echo is not supported")
        if self.logprobs is not None:
            raise Unsupported("logprobs", "logprobs is not supported")
        if self.best_of not in (None, 1):
            raise Unsupported("best_of", "only best_of = 1 is supported")
        if self.suffix:
            raise Unsupported("suffix", "suffix is not supported")

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a batch of several prompts is rejected."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise Unsupported("prompt", f"only one prompt per request is supported, got {len(p)}")
            p = p[0]
        if len(p) == 0:
            raise Unsupported("prompt", "the prompt is empty")
        return p


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise Unsupported("messages", "messages must hold at least one message")
        if self.logprobs or self.top_logprobs:
            raise Unsupported("logprobs", "logprobs is not supported")
        if self.tools or self.functions:
            raise Unsupported("tools", "tools / function calling is not supported")
        if self.tool_choice not in (None, "none", "auto"):  # without tools only the neutral choices mean anything
            raise Unsupported("tool_choice", "tool_choice needs tools, and tools / function calling is not supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise Unsupported("max_tokens", "max_tokens and max_completion_tokens differ")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # extension: return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dustin"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


__all__ = ["AssistantMessage", "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk", "ChatCompletionRequest",
           "ChatCompletionResponse", "ChatMessage", "CompletionChoice", "CompletionRequest", "CompletionResponse",
           "Delta", "ErrorInfo", "ErrorResponse", "ModelCard", "ModelList", "StreamOptions", "Unsupported",
           "Usage", "IGNORED_FIELDS", "error_body", "new_id", "now"]
