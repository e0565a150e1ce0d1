"""The OpenAI-compatible HTTP app of `dustin serve` (FastAPI).

    POST /v1/completions        text or token-id prompt (one per request), streamed (SSE) or not
    POST /v1/chat/completions   messages through the tokenizer's chat template, streamed or not
    GET  /v1/models             the one served model
    GET  /health                200 {"status": "ok"}, or 503 with the engine's error
    GET  /metrics               Prometheus text format

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for any bad request (malformed JSON,
wrong field types, undeclared fields, empty or too-long prompt, max_tokens past the context, unsupported options
such as n > 1 or response_format json_object),
404 for an unknown model or path, 429 when the waiting queue is full, 500/503 when the engine failed.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dustin.engine.request import RequestOutput, SamplingParams
from dustin.errors import DustinError, InputError
from dustin.serve.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from dustin.serve.detokenize import IncrementalDetokenizer
from dustin.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    Unsupported,
    Usage,
    error_body,
    new_id,
    now,
)

log = logging.getLogger("dustin.serve")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
POLL_S = 0.5  # how often a request with no new output checks whether its client is still there
STATUSES = ("success", "aborted", "bad_request", "rejected", "error")  # dustin_requests_total{status=...}


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
    for name in ("max_tokens", "temperature", "top_p", "top_k", "prompt"):
        if name in message:
            return name
    return "prompt" if "vocabulary" in message or "context" in message else None


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


class _Server:
    """Request handling shared by the routes; one per app."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model = served_model_name
        self.created = now()
        self.counts: Counter = Counter({s: 0 for s in STATUSES})
        self._headroom: int | None = None

    # ------------------------------------------------------------------ input
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")

    def tokenizer(self, what: str):
        tok = self.engine.tokenizer
        if tok is None:
            raise ApiError(400, f"this model has no tokenizer: {what}; send token ids to /v1/completions",
                           param="prompt" if "prompt" in what else "messages")
        return tok

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            from dustin.engine.engine import encode_prompt
            ids = encode_prompt(self.tokenizer("a text prompt needs one"), prompt)
            if not ids:
                raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
            return ids
        return list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer("chat completions need one")
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions",
                           param="messages")
        from dustin.engine.engine import encode_chat
        try:
            return encode_chat(tok, [m.template_dict() for m in body.messages])
        except Exception as e:  # noqa: BLE001 - jinja raises for message orders the template refuses
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    def room(self, prompt_len: int) -> int:
        """The largest max_tokens a prompt of `prompt_len` tokens may ask for (the engine's context minus the
        prompt and the engine's per-request headroom, found once by asking check_request)."""
        if self._headroom is None:
            self._headroom = self._probe_headroom()
        return self.engine.max_context - prompt_len - self._headroom

    def _probe_headroom(self) -> int:
        ctx = self.engine.max_context

        def fits(m: int) -> bool:
            try:
                self.engine.check_request([0], SamplingParams(max_tokens=m))
                return True
            except DustinError:
                return False

        if not fits(1):
            return ctx
        lo, hi = 1, ctx  # fits(lo); find the largest m that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return ctx - 1 - lo

    def params(self, body, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, **body.sampling_kwargs())
        except InputError as e:
            raise ApiError(400, str(e), param=_param_of(str(e))) from None

    async def start(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        from dustin.engine.llm_engine import QueueFullError

        try:
            return await self.engine.generate(request_id, prompt_ids, params)
        except QueueFullError as e:
            raise ApiError(429, str(e), type="server_overloaded", code="queue_full") from None
        except EngineDeadError as e:
            raise ApiError(503, f"the engine is not serving: {e}", type="server_error", code="engine_dead") from None
        except InputError as e:
            # a prompt that leaves no room for even one token is the prompt's fault, else max_tokens'
            param = "prompt" if prompt_ids and self.room(len(prompt_ids)) < 1 else _param_of(str(e))
            raise ApiError(400, str(e), param=param) from None

    # ------------------------------------------------------------------ output
    async def _outputs(self, stream: RequestStream, request: Request) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finished; returns early (aborting it) when the client went away."""
        while not stream.finished:
            out = await stream.next(timeout=POLL_S)
            if await request.is_disconnected():
                return
            if out is not None:
                yield out

    async def complete(self, request: Request, body, prompt_ids: list[int], params: SamplingParams,
                       chat: bool) -> Any:
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        stops = body.stop_list()
        if stops and self.engine.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer; this model has none", param="stop")
        stream = await self.start(rid, prompt_ids, params)
        detok = IncrementalDetokenizer(self.engine.tokenizer, stops)
        if body.stream:
            return StreamingResponse(self._stream(request, body, stream, detok, rid, created, len(prompt_ids),
                                                  chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finish = None
        try:
            async for out in self._outputs(stream, request):
                detok.add(out.new_token_ids)
                if detok.stopped:
                    stream.abort()
                    finish = "stop"
                    break
                if out.finished:
                    detok.finish()
                    finish = out.finish_reason
        except EngineDeadError as e:
            raise ApiError(500, f"the engine failed while generating: {e}", type="server_error",
                           code="engine_error") from None
        finally:
            if finish is None:  # client gone or cancelled
                stream.abort()
        if finish is None:
            self.counts["aborted"] += 1
            return JSONResponse(error_body("client disconnected", code="client_disconnected"), status_code=499)
        self.counts["success"] += 1
        usage = Usage.of(len(prompt_ids), len(detok.ids))
        token_ids = list(detok.ids) if (body.return_token_ids or self.engine.tokenizer is None) else None
        if chat:
            resp = ChatCompletionResponse(id=rid, created=created, model=self.model, usage=usage, choices=[
                ChatChoice(message=AssistantMessage(content=detok.text), finish_reason=finish, token_ids=token_ids)])
        else:
            resp = CompletionResponse(id=rid, created=created, model=self.model, usage=usage, choices=[
                CompletionChoice(text=detok.text, finish_reason=finish, token_ids=token_ids)])
        return JSONResponse(_dump(resp))

    async def _stream(self, request: Request, body, stream: RequestStream, detok: IncrementalDetokenizer,
                      rid: str, created: int, prompt_len: int, chat: bool) -> AsyncIterator[str]:
        with_ids = body.return_token_ids or self.engine.tokenizer is None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(text: str | None, finish: str | None, ids: list[int] | None, role: bool = False) -> str:
            ids = ids if with_ids else None
            if chat:
                delta = Delta(role="assistant" if role else None, content=text)
                c = ChatCompletionChunk(id=rid, created=created, model=self.model, choices=[
                    ChatChunkChoice(delta=delta, finish_reason=finish, token_ids=ids)])
                d = _dump(c)
                d["choices"][0]["delta"] = {k: v for k, v in d["choices"][0]["delta"].items() if v is not None}
            else:
                c = CompletionResponse(id=rid, created=created, model=self.model, choices=[
                    CompletionChoice(text=text or "", finish_reason=finish, token_ids=ids)])
                d = _dump(c)
            return _sse(d)

        finish = None
        try:
            if chat:
                yield chunk("", None, [] if with_ids else None, role=True)
            async for out in self._outputs(stream, request):
                text = detok.add(out.new_token_ids)
                if detok.stopped:
                    stream.abort()
                    finish = "stop"
                elif out.finished:
                    text += detok.finish()
                    finish = out.finish_reason
                if text or finish or with_ids:
                    yield chunk(text, finish, out.new_token_ids)
                if finish:
                    break
            if finish is None:  # the client went away
                return
            self.counts["success"] += 1
            if include_usage:
                usage = Usage.of(prompt_len, len(detok.ids)).model_dump()
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse({"id": rid, "object": obj, "created": created, "model": self.model, "choices": [],
                            "usage": usage})
            yield "data: [DONE]\n\n"
        except EngineDeadError as e:
            finish = "error"
            self.counts["error"] += 1
            yield _sse(error_body(f"the engine failed while generating: {e}", type="server_error",
                                  code="engine_error"))
            yield "data: [DONE]\n\n"
        finally:  # also on asyncio.CancelledError / GeneratorExit when the client disconnects
            if finish is None:
                stream.abort()
                self.counts["aborted"] += 1

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


def create_app(async_engine: AsyncLLMEngine, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` (whose thread the caller starts and shuts down)."""
    server = _Server(async_engine, served_model_name or async_engine.model_name)
    app = FastAPI(title="dustin serve", description="OpenAI-compatible speculative-decoding server", docs_url=None,
                  redoc_url=None)
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
        return JSONResponse(error_body(str(e.detail), param=None, code=code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("dustin serve: unexpected error")
        server.counts["error"] += 1
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"),
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        err = async_engine.error
        if err is not None:
            return JSONResponse({"status": "error", "error": err}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=server.model, created=server.created, max_model_len=async_engine.max_context)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check_supported()
        server.check_model(body.model)
        prompt_ids = server.completion_prompt(body)
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return await server.complete(request, body, prompt_ids, server.params(body, max_tokens), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check_supported()
        server.check_model(body.model)
        prompt_ids = server.chat_prompt(body)
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:  # the rest of the context (a prompt that leaves none fails with the engine's error)
            max_tokens = max(server.room(len(prompt_ids)), 1)
        return await server.complete(request, body, prompt_ids, server.params(body, max_tokens), chat=True)

    return app


__all__ = ["ApiError", "create_app"]
