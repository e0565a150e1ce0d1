"""OpenAI-compatible request and response bodies of `dustin serve` (pydantic v2).

Requests: a field these models do not declare is rejected, and so is a declared field of the wrong type (strict
mode: "5" is not an int, true is not a number); the app turns either into a 400 with OpenAI's error body naming the
field. `null` for an optional field means its default, as OpenAI's schema allows (the JSON schema says so: every
optional field is nullable). Features the engine does not have (penalties, logit_bias, tools, response_format other
than text, store, suffix, best_of other than n) are accepted only at their neutral value and otherwise rejected with
a 400 naming the field, never silently ignored. The fields in IGNORED_FIELDS are accepted and ignored: none of them
changes the output (docs/serving.md says why for each).

Extensions (pass them with the openai client's `extra_body`): `ignore_eos` (always generate max_tokens tokens),
`return_token_ids` (each choice and stream chunk carries the generated `token_ids`).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dustin.engine.request import MAX_LOGPROBS

# accepted on both endpoints and ignored; each is documented in docs/serving.md ("Fields accepted and ignored")
IGNORED_FIELDS = ("user", "metadata", "service_tier")

# value ranges the schema states (a value outside is a 400 naming the field)
TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmpty = Annotated[str, Field(min_length=1)]
TopN = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class Unsupported(ValueError):
    """A known OpenAI field set to a value this server does not implement (-> 400 naming `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _nullable_optionals(schema: dict, cls: type) -> None:
    """JSON schema of a request object: its optional fields also accept null (meaning the default)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        alts = prop.get("anyOf")
        if alts is None:
            meta = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            alts = [dict(prop)]
            prop.clear()
            prop.update(meta, anyOf=alts)
        if {"type": "null"} not in alts:
            alts.append({"type": "null"})


class _Body(BaseModel):
    """A request body, or an object inside one: strict types, no undeclared fields, and a declared field sent as
    `null` is as if it were absent: an optional one takes its default, a required one is missing."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_nullable_optionals)

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
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: completions with echo only
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None  # None: 1.0, OpenAI's default
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM-style extension; 0 or -1: off
    stop: NonEmpty | list[NonEmpty] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] = 1
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
        return list(dict.fromkeys(stops))

    def check_supported(self) -> None:
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
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options is only allowed with stream: true")

    def sampling_kwargs(self, choice: int = 0) -> dict[str, Any]:
        """SamplingParams keyword arguments except max_tokens and log-probabilities (validated there: InputError
        -> 400), for choice `choice` of n: its seed is seed + choice."""
        top_k = self.top_k if self.top_k is not None else 0
        return {"temperature": 1.0 if self.temperature is None else float(self.temperature),
                "top_p": 1.0 if self.top_p is None else float(self.top_p),
                "top_k": 0 if top_k == -1 else top_k, "seed": None if self.seed is None else self.seed + choice,
                "ignore_eos": self.ignore_eos}


class CompletionRequest(_SamplingFields):
    # text, token ids, or a batch of prompts: a list of texts or of token-id lists
    prompt: NonEmpty | TokenIds | Annotated[list[NonEmpty], Field(min_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1)]
    echo: bool = False  # the prompt before the completion (with `logprobs`: the prompt's log-probabilities too)
    logprobs: TopN | None = None  # the chosen tokens' log-probabilities and this many most likely tokens'
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_not_empty(cls, p: Any) -> Any:
        """What the union's own errors would name by a member type ("constrained-str"): an empty prompt, an empty
        one in a batch, a negative token id."""
        def empty(x: Any) -> bool:
            return isinstance(x, (str, list)) and len(x) == 0

        if empty(p):
            raise PydanticCustomError("empty_prompt", "must not be empty")
        for i, x in enumerate(p if isinstance(p, list) else ()):
            if empty(x):
                raise PydanticCustomError("empty_prompt", "prompt {i} of the batch is empty", {"i": i})
            if any(type(t) is int and t < 0 for t in (x if isinstance(x, list) else [x])):
                raise PydanticCustomError("invalid_token_id", "token ids must be >= 0")
        return p

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.n):
            raise Unsupported("best_of", "best_of is not supported (only best_of = n)")
        if self.suffix:
            raise Unsupported("suffix", "suffix is not supported")

    def prompts(self) -> list[str | list[int]]:
        """The prompts (texts or token ids), in order: choices are numbered prompt by prompt."""
        p = self.prompt  # the schema's lengths: no prompt is empty, nor a list of them
        return p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: only an assistant's (a turn with no text)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise PydanticCustomError("unsupported_content", "only text content parts are supported, got "
                                              "{kind}", {"kind": repr(kind)})
        return content

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing_content", "a {role} message needs content", {"role": self.role})
        return self

    def template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: TopN | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        if self.tools or self.functions:
            raise Unsupported("tools", "tools / function calling is not supported")
        if self.tool_choice not in (None, "none", "auto"):  # without tools only the neutral choices mean anything
            raise Unsupported("tool_choice", "tool_choice needs tools, and tools / function calling is not supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise Unsupported("max_tokens", "max_tokens and max_completion_tokens differ")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): exactly one of `prompt` (text) and `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template's own)
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False  # messages only: the last message left open (no generation prompt)
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise Unsupported("prompt", "give exactly one of prompt and messages")
        if self.prompt is None and self.add_generation_prompt and self.continue_final_message:
            raise Unsupported("continue_final_message", "continue_final_message and add_generation_prompt "
                                                        "cannot both be true")


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy form, per token: its text, log-probability (null for a prompt's first token), the
    `logprobs` most likely tokens' (and the chosen one's) and the text offset (cumulative token lengths)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes (a character may span tokens)


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the `top_logprobs` most likely tokens, most likely first


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    # extensions: the decoding method the server was started with, and whether it is lossy (sparse verification:
    # the output can differ from the target model's own) or not (the target's own output)
    method: str | None = None
    lossy: bool | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info (vLLM's, which lm-eval's remote tokenizer reads): the tokenizer's class, special tokens
    and chat template."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    model_max_length: int


class HealthResponse(BaseModel):
    status: Literal["ok", "error"]
    error: str | None = None  # why the engine stopped serving (status "error", HTTP 503)


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
           "ChatCompletionResponse", "ChatLogprobs", "ChatMessage", "CompletionChoice", "CompletionLogprobs",
           "CompletionRequest", "CompletionResponse", "Delta", "DetokenizeRequest", "DetokenizeResponse", "ErrorInfo",
           "ErrorResponse", "HealthResponse", "ModelCard", "ModelList", "StreamOptions", "TokenLogprob",
           "TokenizeRequest", "TokenizeResponse", "TokenizerInfoResponse", "TopLogprob", "Unsupported", "Usage",
           "VersionResponse", "IGNORED_FIELDS", "error_body", "new_id", "now"]
