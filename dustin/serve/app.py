"""The OpenAI-compatible HTTP app of `dustin serve` (FastAPI).

    POST /v1/completions        text or token-id prompts (one or a list), n choices each, echo, logprobs; SSE or not
    POST /v1/chat/completions   messages through the tokenizer's chat template, n choices, logprobs; SSE or not
    GET  /v1/models             the one served model
    POST /tokenize, /detokenize vLLM's tokenizer endpoints (and GET /tokenizer_info, which lm-eval reads)
    GET  /version               dustin's version
    GET  /health                200 {"status": "ok"}, or 503 with the engine's error
    GET  /metrics               Prometheus text format

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for any bad request (malformed JSON,
wrong field types, undeclared fields, values out of range, empty or too-long prompt, max_tokens past the context,
unsupported options such as response_format json_object), 404 for an unknown model or path, 429 when the waiting
queue is full, 500/503 when the engine failed. /openapi.json documents exactly these (FastAPI's 422 is removed).
"""
from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dustin import __version__
from dustin.engine.config import LOSSY_METHODS
from dustin.engine.pair import encode_chat, encode_prompt
from dustin.engine.request import Logprob, RequestOutput, SamplingParams
from dustin.engine.request import Request as EngineRequest
from dustin.engine.scheduler import QueueFullError
from dustin.errors import InputError
from dustin.serve.async_engine import AsyncEngineCore, EngineDeadError, RequestStream
from dustin.serve.detokenize import IncrementalDetokenizer, TokenText, text_decoder
from dustin.serve.logprobs import chat_logprobs, completion_logprobs
from dustin.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    Unsupported,
    Usage,
    VersionResponse,
    error_body,
    new_id,
    now,
)

log = logging.getLogger("dustin.serve")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
POLL_S = 0.5  # how often a request with no new output checks whether its client is still there
STATUSES = ("success", "aborted", "bad_request", "rejected", "error")  # dustin_requests_total{status=...}


# histogram buckets (seconds): vLLM's for TTFT and end-to-end latency; vLLM's for TPOT with finer ones below 10 ms,
# where a speculative step's tokens land
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """A Prometheus histogram (cumulative `le` buckets, `_sum`, `_count`), observed and read on the event loop."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        i = bisect.bisect_left(self.buckets, value)  # the first bucket whose bound is >= value
        if i < len(self.counts):
            self.counts[i] += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, n in zip(self.buckets, self.counts, strict=True):
            total += n
            out.append(f'{self.name}_bucket{{le="{le!r}"}} {total}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {_num(self.sum)}",
                f"{self.name}_count {self.count}"]
        return out


class Latency:
    """Per-request latencies as clients see them, from the handler's arrival to the outputs reaching it (vLLM's
    names after the `dustin_` prefix): per choice of a request."""

    def __init__(self) -> None:
        self.ttft = Histogram("dustin_time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self.tpot = Histogram("dustin_request_time_per_output_token_seconds",
                              "Per finished request: time from its first to its last token / (tokens - 1).",
                              TPOT_BUCKETS)
        self.e2e = Histogram("dustin_e2e_request_latency_seconds",
                             "Time from a request's arrival to its last token, per finished request.", E2E_BUCKETS)

    def lines(self) -> list[str]:
        return self.ttft.lines() + self.tpot.lines() + self.e2e.lines()


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def _status_label(status: int) -> str:
    if status == 429:
        return "rejected"
    return "bad_request" if status < 500 else "error"


def _param_of(message: str) -> str | None:
    """The request field an InputError is about (best effort, for the error body's `param`)."""
    if message.startswith("n = "):
        return "n"
    for name in ("max_tokens", "temperature", "top_p", "top_k", "prompt"):
        if name in message:
            return name
    return "prompt" if "vocabulary" in message or "context" in message else None


def _error(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


_BAD_REQUEST = {400: _error("a bad request (malformed JSON, a wrong field type, an undeclared field, an unsupported "
                            "option, a bad value): `param` names the field"),
                404: _error("an unknown `model` (code `model_not_found`)")}
_ERRORS = {**_BAD_REQUEST,
           429: _error("the waiting queue is full (code `queue_full`): retry later"),
           500: _error("the engine failed while the request ran (code `engine_error`)"),
           503: _error("the engine failed earlier or the server is shutting down (code `engine_dead`)")}
_STREAMED = {200: {"description": "the response; with `stream: true` a text/event-stream of events `data: {chunk}` "
                                  "(one choice each; with stream_options.include_usage a last chunk of no choices "
                                  "and the usage; an error body if the engine fails), then `data: [DONE]`",
                   "content": {"text/event-stream": {}}}}  # its schema: `_stream_schemas`


def _stream_schemas(schema: dict) -> None:
    """The text/event-stream schema of the generation routes: each event (an object with its `data`, as Open API
    before 3.2 has `schema` describe one event) holds a JSON chunk, an error body or [DONE]."""
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, chunk in (("/v1/completions", CompletionResponse), ("/v1/chat/completions", ChatCompletionChunk)):
        js = chunk.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        for name, sub in {**js.pop("$defs", {}), chunk.__name__: js}.items():
            comps.setdefault(name, sub)
        payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                             {"$ref": "#/components/schemas/ErrorResponse"}]}
        data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                                 "contentSchema": payload}]}
        content = schema["paths"][path]["post"]["responses"]["200"]["content"]
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                   "properties": {"data": data}}}


def _dump_none(model) -> dict:
    """A response model without its unset optional fields (None)."""
    return {k: v for k, v in model.model_dump().items() if v is not None}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _dump(model) -> dict:
    """A response model as OpenAI sends it: `usage` and the `token_ids` extension only when set."""
    d = model.model_dump()
    if d.get("usage", 0) is None:
        del d["usage"]
    for c in d.get("choices", []):
        if c.get("token_ids", 0) is None:
            del c["token_ids"]
    return d


@dataclass
class _Prompt:
    ids: list[int]
    text: str | None  # as sent (None: token ids, echoed as their decoding)
    logprobs: list[Logprob | None] | None = None  # from its choices' first output (echo with logprobs)


@dataclass
class _Choice:
    index: int
    request_id: str
    prompt: _Prompt
    detok: IncrementalDetokenizer
    logprobs: list[Logprob] = field(default_factory=list)  # of detok.ids[:detok.kept]
    finish: str | None = None
    sent: int = 0  # streamed: generated tokens whose log-probabilities went out
    echoed: bool = False  # streamed: the prompt went out
    offset: int = 0  # streamed: text_offset of the next token
    first_s: float | None = None  # when its first generated token reached the handler (time.perf_counter)


class _Job:
    """One HTTP generation request: its choices (n per prompt, numbered prompt by prompt), what they asked for,
    and the answer built from the engine's outputs."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, body, tokenizer, prompts: list[_Prompt],
                 zero: bool, latency: Latency | None = None) -> None:
        self.rid, self.created, self.model, self.chat, self.body = rid, created, model, chat, body
        self.arrival = time.perf_counter()
        self.latency = latency  # where each choice's TTFT, TPOT and end-to-end latency are observed
        self.tokenizer, self.prompts = tokenizer, prompts
        self.zero = zero  # echo with max_tokens 0: each choice's one generated token is dropped
        self.stops = body.stop_list()
        self.echo = not chat and body.echo
        self.logprobs = ((body.top_logprobs or 0) if body.logprobs else None) if chat else body.logprobs
        self.prompt_logprobs = self.logprobs if self.echo else None
        self.with_ids = body.return_token_ids or tokenizer is None
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.text = TokenText(tokenizer)
        self.decode = text_decoder(tokenizer)
        self.choices: list[_Choice] = []
        self.by_id: dict[str, _Choice] = {}
        self.failed = False

    def add(self, prompt: _Prompt, request_id: str) -> None:
        c = _Choice(len(self.choices), request_id, prompt, IncrementalDetokenizer(self.tokenizer, self.stops,
                                                                                   self.decode))
        self.choices.append(c)
        self.by_id[request_id] = c

    @property
    def done(self) -> bool:
        return all(c.finish for c in self.choices)

    def take(self, out: RequestOutput, stream: RequestStream) -> tuple[_Choice, str]:
        """Book one output to its choice; the choice and its newly final text. A stop string ends the choice
        (its engine request is aborted)."""
        c = self.by_id[out.request_id]
        if out.prompt_logprobs is not None:
            c.prompt.logprobs = out.prompt_logprobs
        ids, lps = ([], []) if self.zero else (out.new_token_ids, out.logprobs or [])
        before = len(c.detok.ids)
        text = c.detok.add(ids)
        c.logprobs += lps[:c.detok.kept - before]
        if c.detok.stopped:
            stream.abort(c.request_id)
            c.finish = "stop"
        elif out.finished:
            text += c.detok.finish()
            c.finish = "length" if self.zero else out.finish_reason
        if self.latency is not None and not self.zero:
            t = time.perf_counter()
            if c.first_s is None and ids:
                c.first_s = t
                self.latency.ttft.observe(t - self.arrival)
            if c.finish is not None and c.finish != "abort":
                self.latency.e2e.observe(t - self.arrival)
                n = len(c.detok.ids)
                if n > 1 and c.first_s is not None:
                    self.latency.tpot.observe((t - c.first_s) / (n - 1))
        return c, text

    def echo_text(self, c: _Choice) -> str:
        p = c.prompt
        if p.text is not None:
            return p.text
        return "" if self.tokenizer is None else self.tokenizer.decode(p.ids, skip_special_tokens=True)

    def _entries(self, c: _Choice, start: int, echo: bool) -> tuple[list[int], list[Logprob | None]]:
        """Tokens and log-probabilities from generated token `start` on (through a stop), the prompt's first."""
        ids, lps = c.detok.ids[start:c.detok.kept], list(c.logprobs[start:])
        if echo:
            prompt = c.prompt.logprobs or [None] * len(c.prompt.ids)
            ids, lps = c.prompt.ids + ids, prompt + lps
        return ids, lps

    def usage(self) -> Usage:
        return Usage.of(sum(len(p.ids) for p in self.prompts), sum(len(c.detok.ids) for c in self.choices))

    def response(self) -> CompletionResponse | ChatCompletionResponse:
        choices = []
        for c in self.choices:
            ids = list(c.detok.ids) if self.with_ids else None
            if self.chat:
                lp = None if self.logprobs is None else chat_logprobs(*self._entries(c, 0, False), self.text)
                choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=c.detok.text),
                                          logprobs=lp, finish_reason=c.finish, token_ids=ids))
            else:
                lp = None if self.logprobs is None else \
                    completion_logprobs(*self._entries(c, 0, self.echo), self.text)[0]
                text = (self.echo_text(c) if self.echo else "") + c.detok.text
                choices.append(CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=c.finish,
                                                token_ids=ids))
        cls = ChatCompletionResponse if self.chat else CompletionResponse
        return cls(id=self.rid, created=self.created, model=self.model, choices=choices, usage=self.usage())

    def stream_chunk(self, c: _Choice, text: str, out: RequestOutput) -> dict | None:
        """The SSE chunk of one output (None when it carries nothing): the new text, the new tokens'
        log-probabilities, and for an echo the prompt (and its log-probabilities) first."""
        echo = self.echo and not c.echoed
        lp = None
        if self.logprobs is not None and (c.detok.kept > c.sent or echo):
            ids, lps = self._entries(c, c.sent, echo)
            if self.chat:
                lp = chat_logprobs(ids, lps, self.text)
            else:
                lp, c.offset = completion_logprobs(ids, lps, self.text, c.offset)
        c.sent = c.detok.kept
        if echo:
            text, c.echoed = self.echo_text(c) + text, True
        if not (text or c.finish or self.with_ids or lp is not None):
            return None
        return self.chunk(c, text, lp, [] if self.zero else out.new_token_ids)

    def chunk(self, c: _Choice, text: str | None, lp, ids: list[int], role: bool = False) -> dict:
        """One SSE chunk of one choice, as a dict: what `_dump` makes of ChatCompletionChunk / CompletionResponse
        (tests/api/test_serve.py holds the two equal), built directly because it is built once per request and
        engine step."""
        lp = None if lp is None else lp.model_dump()
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": None if role else c.finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": c.index, "text": text or "", "logprobs": lp, "finish_reason": c.finish}
            obj = "text_completion"
        if self.with_ids:
            choice["token_ids"] = list(ids)
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}


def _merged(outs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs of one batch with each request's outputs joined into one, in the order of each request's first
    output: what the engine made for a request since its handler last looked, as one chunk."""
    groups: dict[str, list[RequestOutput]] = {}
    for o in outs:
        groups.setdefault(o.request_id, []).append(o)
    return [g[0] if len(g) == 1 else _joined(g) for g in groups.values()]


def _joined(g: list[RequestOutput]) -> RequestOutput:
    last = g[-1]
    lps = None if all(o.logprobs is None for o in g) else [x for o in g for x in o.logprobs or []]
    prompt = next((o.prompt_logprobs for o in g if o.prompt_logprobs is not None), None)
    return RequestOutput(last.request_id, [t for o in g for t in o.new_token_ids], last.finished, last.finish_reason,
                         last.prompt_tokens, last.completion_tokens, lps, prompt)


class _Server:
    """Request handling shared by the routes; one per app."""

    def __init__(self, engine: AsyncEngineCore, served_model_name: str) -> None:
        self.engine = engine
        self.model = served_model_name
        self.created = now()
        self.counts: Counter = Counter({s: 0 for s in STATUSES})
        self.latency = Latency()

    # ------------------------------------------------------------------ input
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")

    def tokenizer(self, what: str, param: str = "prompt"):
        tok = self.engine.tokenizer
        if tok is None:
            raise ApiError(400, f"this model has no tokenizer: {what}; send token ids to /v1/completions",
                           param=param)
        return tok

    def completion_prompts(self, body: CompletionRequest) -> list[_Prompt]:
        out = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                ids = encode_prompt(self.tokenizer("a text prompt needs one"), prompt)
                if not ids:
                    raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
                out.append(_Prompt(ids, prompt))
            else:
                out.append(_Prompt(list(prompt), None))
        return out

    def chat_ids(self, messages: list, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `messages` through the tokenizer's chat template (the generation prompt added, as chat
        completions render them, unless told otherwise)."""
        tok = self.tokenizer("chat messages need one", "messages")
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions",
                           param="messages")
        dicts = [m.template_dict() for m in messages]
        try:
            if add_generation_prompt and not continue_final_message and not add_special_tokens:
                return encode_chat(tok, dicts)
            text = tok.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message)
        except Exception as e:  # noqa: BLE001 - jinja raises for message orders the template refuses
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return tok.encode(text, add_special_tokens=add_special_tokens, verbose=False)

    def check_ids(self, ids: list[int], param: str) -> None:
        limit = self.engine.vocab_limit
        if any(not 0 <= i < limit for i in ids):
            raise ApiError(400, f"{param} holds token ids outside the vocabulary (0..{limit - 1})", param=param)

    def room(self, prompt_len: int) -> int:
        """The largest max_tokens a prompt of `prompt_len` tokens may ask (the engine's rule, `max_tokens_room`)."""
        return self.engine.max_tokens_room(prompt_len)

    def params(self, body, max_tokens: int, choice: int, logprobs: int | None = None,
               prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  **body.sampling_kwargs(choice))
        except InputError as e:
            raise ApiError(400, str(e), param=_param_of(str(e))) from None

    async def start(self, groups: list[list[EngineRequest]]) -> RequestStream:
        try:
            return await self.engine.generate_groups(groups)
        except QueueFullError as e:
            raise ApiError(429, str(e), type="server_overloaded", code="queue_full") from None
        except EngineDeadError as e:
            raise ApiError(503, f"the engine is not serving: {e}", type="server_error", code="engine_dead") from None
        except InputError as e:
            # a prompt that leaves no room for even one token is the prompt's fault, else max_tokens'
            longest = max(len(g[0].prompt_ids) for g in groups)
            param = "prompt" if longest and self.room(longest) < 1 else _param_of(str(e))
            raise ApiError(400, str(e), param=param) from None

    # ------------------------------------------------------------------ output
    async def _outputs(self, stream: RequestStream, request: Request) -> AsyncIterator[list[RequestOutput]]:
        """The requests' outputs until each finished, every output waiting at once (a loop that fell behind the
        engine catches up in one batch); returns early (aborting them) when the client went away, which is checked
        whenever POLL_S seconds passed without an output and at most every POLL_S seconds otherwise."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        while not stream.finished:
            outs = await stream.next_batch(timeout=POLL_S)
            t = loop.time()
            if not outs or t - checked >= POLL_S:
                checked = t
                if await request.is_disconnected():
                    return
            if outs:
                yield outs

    async def generate(self, request: Request, body, prompts: list[_Prompt], max_tokens: int, chat: bool) -> Any:
        """Run every choice (n per prompt, numbered prompt by prompt) and answer: one JSON response or an SSE
        stream. max_tokens 0 (completions with echo): each choice generates one token, which is dropped."""
        rid = new_id("chatcmpl" if chat else "cmpl")
        zero = max_tokens == 0 and not chat and body.echo
        job = _Job(rid, now(), self.model, chat, body, self.engine.tokenizer, prompts, zero, self.latency)
        if job.stops and self.engine.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer; this model has none", param="stop")
        groups = []
        for j, prompt in enumerate(prompts):
            group = []
            for i in range(body.n):
                params = self.params(body, 1 if zero else max_tokens, i, job.logprobs, job.prompt_logprobs)
                group.append(EngineRequest(f"{rid}-{j}-{i}", prompt.ids, params))
                job.add(prompt, group[-1].request_id)
            groups.append(group)
        stream = await self.start(groups)
        if body.stream:
            return StreamingResponse(self._stream(request, job, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for outs in self._outputs(stream, request):
                for out in outs:
                    job.take(out, stream)
        except EngineDeadError as e:
            raise ApiError(500, f"the engine failed while generating: {e}", type="server_error",
                           code="engine_error") from None
        finally:
            stream.abort()  # client gone or cancelled (a no-op once every choice finished)
        if not job.done:
            self.counts["aborted"] += 1
            return JSONResponse(error_body("client disconnected", code="client_disconnected"), status_code=499)
        self.counts["success"] += 1
        return JSONResponse(_dump(job.response()))

    async def _stream(self, request: Request, job: _Job, stream: RequestStream) -> AsyncIterator[str]:
        try:
            if job.chat:
                for c in job.choices:
                    yield _sse(job.chunk(c, "", None, [], role=True))
            async for outs in self._outputs(stream, request):
                # one chunk per choice and batch: a choice's outputs that waited together go out together
                events = []
                for out in _merged(outs):
                    c, text = job.take(out, stream)
                    chunk = job.stream_chunk(c, text, out)
                    if chunk is not None:
                        events.append(_sse(chunk))
                if events:
                    yield "".join(events)
            if not job.done:  # the client went away
                return
            self.counts["success"] += 1
            if job.include_usage:
                obj = "chat.completion.chunk" if job.chat else "text_completion"
                yield _sse({"id": job.rid, "object": obj, "created": job.created, "model": self.model,
                            "choices": [], "usage": job.usage().model_dump()})
            yield "data: [DONE]\n\n"
        except EngineDeadError as e:
            job.failed = True
            self.counts["error"] += 1
            yield _sse(error_body(f"the engine failed while generating: {e}", type="server_error",
                                  code="engine_error"))
            yield "data: [DONE]\n\n"
        finally:  # also on asyncio.CancelledError / GeneratorExit when the client disconnects
            if not (job.done or job.failed):
                self.counts["aborted"] += 1
            stream.abort()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> str:
        st = self.engine.stats()
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, value: Any) -> None:
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {_num(value)}"])

        metric("dustin_requests_waiting", "gauge", "Requests waiting for a KV-cache slot.",
               st.get("requests_waiting", 0))
        metric("dustin_requests_running", "gauge", "Requests in a KV-cache slot (prefilling or decoding).",
               st.get("requests_running", 0))
        metric("dustin_kv_slots_used", "gauge", "KV-cache slots in use.", st.get("kv_slots_used", 0))
        metric("dustin_kv_slots_total", "gauge", "KV-cache slots.", st.get("kv_slots_total", 0))
        metric("dustin_kv_usage", "gauge", "Fraction of the KV-cache positions in use (0..1).",
               st.get("kv_usage", 0.0))
        metric("dustin_tau", "gauge", "Mean tokens per target forward per sequence (speculative acceptance).",
               st.get("tau", 0.0))
        metric("dustin_tokens_per_second", "gauge", "Generated tokens per second of engine busy time.",
               st.get("tokens_per_s", 0.0))
        metric("dustin_prompt_tokens_total", "counter", "Prompt tokens prefilled.", st.get("prompt_tokens_total", 0))
        metric("dustin_generated_tokens_total", "counter", "Tokens generated.", st.get("generated_tokens_total", 0))
        metric("dustin_steps_total", "counter", "Engine steps run.", st.get("steps_total", 0))
        metric("dustin_engine_healthy", "gauge", "1 while the engine serves, 0 after it failed.",
               0 if st.get("error") else 1)
        budget = st.get("budget_k")
        if budget:  # --budget auto: the k each sequence verified with, per step
            for key, text in (("mean", "mean"), ("p50", "median"), ("p90", "90th percentile"),
                              ("p99", "99th percentile")):
                metric(f"dustin_budget_k_{key}", "gauge",
                       f"--budget auto: {text} of the KV positions verified per sequence and step.", budget[key])
            metric("dustin_budget_dense_share", "gauge", "--budget-dense: share of sequence steps verified against "
                   "the whole cache.", budget.get("dense", 0.0))
        if "spec_draft_tokens_total" in st:  # speculative decoding, vLLM's counters
            metric("dustin_spec_decode_num_drafts_total", "counter",
                   "Sequence steps that verified draft tokens (speculative methods).", st["spec_drafts_total"])
            metric("dustin_spec_decode_num_draft_tokens_total", "counter",
                   "Draft tokens proposed to verification.", st["spec_draft_tokens_total"])
            metric("dustin_spec_decode_num_accepted_tokens_total", "counter",
                   "Draft tokens verification accepted.", st["spec_accepted_tokens_total"])
        lines.extend(self.latency.lines())
        lines.append("# HELP dustin_requests_total HTTP generation requests by outcome.")
        lines.append("# TYPE dustin_requests_total counter")
        for status in STATUSES:
            lines.append(f'dustin_requests_total{{status="{status}"}} {self.counts[status]}')
        return "\n".join(lines) + "\n"


def _num(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    try:
        return repr(float(v))
    except (TypeError, ValueError):
        return "NaN"


def create_app(async_engine: AsyncEngineCore, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` (whose thread the caller starts and shuts down)."""
    server = _Server(async_engine, served_model_name or async_engine.model_name)
    app = FastAPI(title="dustin serve", description="OpenAI-compatible speculative-decoding server", docs_url=None,
                  redoc_url=None, version=__version__)
    app.state.server = server

    def fail(e: ApiError) -> JSONResponse:
        server.counts[_status_label(e.status)] += 1
        return e.response()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return fail(e)

    @app.exception_handler(Unsupported)
    async def _unsupported(request: Request, e: Unsupported) -> JSONResponse:
        return fail(ApiError(400, str(e), param=e.param))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx") or {}
            msg = f"the request body is not valid JSON: {ctx.get('error', first.get('msg', ''))}"
            return fail(ApiError(400, msg, code="invalid_json"))
        if not loc:
            return fail(ApiError(400, "the request body must be a JSON object", code="invalid_body"))
        # a union member's name ("str", "list[int]") may follow the field's: the field is the first element
        field = loc[0]
        where = ".".join(loc)
        msg = f"{where}: {first.get('msg', 'invalid value')}"
        if first.get("type") == "missing":
            msg = f"{field} is required"
        elif first.get("type") == "extra_forbidden":  # a field the request models do not declare
            return fail(ApiError(400, f"{where} is not supported (this server does not implement it)", param=field,
                                 code="unsupported_field"))
        elif "input" in first and first.get("type", "").endswith("_type"):
            msg += f" (got {json.dumps(first['input'])[:60]})"
        return fail(ApiError(400, msg, param=field, code="invalid_type" if "_type" in first.get("type", "")
                             else "invalid_value"))

    @app.exception_handler(json.JSONDecodeError)
    async def _json_error(request: Request, e: json.JSONDecodeError) -> JSONResponse:
        return fail(ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), param=None, code=code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))  # 405's Allow

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("dustin serve: unexpected error")
        server.counts["error"] += 1
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"),
                            status_code=500)

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse, "description":
                                                                         "the engine failed: it serves no more"}})
    async def health() -> JSONResponse:
        err = async_engine.error
        if err is not None:
            return JSONResponse({"status": "error", "error": err}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> JSONResponse:
        method = async_engine.method
        card = ModelCard(id=server.model, created=server.created, max_model_len=async_engine.max_context,
                         method=method, lossy=None if method is None else method in LOSSY_METHODS)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version", response_model=VersionResponse)
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_STREAMED, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        body.check_supported()
        server.check_model(body.model)
        prompts = server.completion_prompts(body)
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be >= 1 (0 only with echo: the prompt alone)", param="max_tokens")
        return await server.generate(request, body, prompts, max_tokens, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_STREAMED, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check_supported()
        server.check_model(body.model)
        prompt_ids = server.chat_ids(body.messages)
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:  # the rest of the context (a prompt that leaves none fails with the engine's error)
            max_tokens = max(server.room(len(prompt_ids)), 1)
        return await server.generate(request, body, [_Prompt(prompt_ids, None)], max_tokens, chat=True)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_BAD_REQUEST)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        body.check_supported()
        server.check_model(body.model)
        if body.prompt is not None:
            tok = server.tokenizer("/tokenize needs one")
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False, verbose=False)
        else:
            tok = server.tokenizer("/tokenize needs one", "messages")
            ids = server.chat_ids(body.messages, body.add_generation_prompt, body.continue_final_message,
                                  bool(body.add_special_tokens))
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(_dump_none(TokenizeResponse(count=len(ids), max_model_len=async_engine.max_context,
                                                        tokens=ids, token_strs=strs)))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_BAD_REQUEST)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        server.check_model(body.model)
        tok = server.tokenizer("/detokenize needs one", "tokens")
        server.check_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": tok.decode(body.tokens)})

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses=_BAD_REQUEST)
    async def tokenizer_info() -> JSONResponse:
        tok = server.tokenizer("/tokenizer_info needs one", None)

        def name(t) -> str | None:
            return None if t is None else str(t)
        template = getattr(tok, "chat_template", None)
        return JSONResponse(TokenizerInfoResponse(
            tokenizer_class=type(tok).__name__, bos_token=name(tok.bos_token), eos_token=name(tok.eos_token),
            pad_token=name(tok.pad_token), unk_token=name(tok.unk_token),
            chat_template=template if isinstance(template, str) else None,
            model_max_length=async_engine.max_context).model_dump())

    base_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's schema without the 422 it adds to every route with a body: this server answers 400 with
        OpenAI's error body instead (documented per route)."""
        if app.openapi_schema is None:
            schema = base_openapi()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            _stream_schemas(schema)
        return app.openapi_schema

    app.openapi = openapi

    return app


__all__ = ["ApiError", "create_app"]
