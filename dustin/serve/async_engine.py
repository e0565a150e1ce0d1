"""`AsyncEngineCore`: the thread-safe, asyncio-facing wrapper of `EngineCore` used by the HTTP server.

`EngineCore` is not thread-safe, so exactly one thread, the engine thread owned here, calls its methods. It loops:

    apply pending commands (add / abort) from a thread-safe queue
    -> step() while there is work (else sleep until a command arrives)
    -> refresh the stats snapshot that /metrics and /health read
    -> hand the step's outputs to the event loop in ONE loop.call_soon_threadsafe, which appends each to its
       request's stream and wakes the handlers waiting on them.

Request handlers (on the event loop) only put commands on the queue and await their request's stream, and take
every output waiting there at once (`RequestStream.next_batch`): a loop that falls behind the engine catches up
in fewer, larger chunks instead of one wake-up and one chunk per output. The one exception is
`EngineCore.check_request`, a request's one check, which the caller runs itself so a bad request fails fast even
while the engine thread is busy with a long step; it only reads settings fixed at start (context, vocabulary, Γ).
The engine thread then adds the checked requests without checking them again.

If `step()` raises, every in-flight request fails with `EngineDeadError` (a 500 for its client, no hang), the engine
stops taking requests, and `error` keeps the message for /health (503). The process stays up.

Tensor parallelism (rank 0 of `dustin serve` under torchrun; the other ranks run `Executor.follow()`): the engine
thread is the only one that talks to the followers. It first makes the engine's GPU its current device
(`bind_thread`), calls `heartbeat()` whenever it wakes up idle (so the followers' wait for the next plan never
reaches the process group's timeout), and when it ends, whether shut down or failed, calls `stop_followers()`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dustin.engine.request import Request, RequestOutput, SamplingParams
from dustin.errors import DustinError

log = logging.getLogger("dustin.serve")

_SHUTDOWN_MESSAGE = "the server is shutting down"


class EngineDeadError(DustinError):
    """The engine thread failed (or was shut down): no request can be served."""


class _Stream:
    """Where the outputs of one HTTP request's engine requests go: a buffer on its event loop, and the future a
    handler waiting for it awaits. Touched on the loop only (the engine thread hands items over with one
    `call_soon_threadsafe` per step)."""

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque = deque()  # RequestOutput, or the exception that ended the engine
        self.waiter: asyncio.Future | None = None

    def push(self, items: list) -> None:
        self.items.extend(items)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(True)

    async def wait(self, timeout: float | None) -> bool:
        """Until items are waiting (True) or `timeout` seconds passed (False)."""
        if self.items:
            return True
        fut = self.loop.create_future()
        self.waiter = fut
        handle = None if timeout is None else self.loop.call_later(timeout, _timed_out, fut)
        try:
            return await fut
        finally:
            self.waiter = None
            if handle is not None:
                handle.cancel()


def _timed_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)


@dataclass
class _Add:
    groups: list[list[Request]]  # each one request, or the sequences of one prompt (EngineCore.add_requests)
    stream: _Stream  # where all their outputs go
    future: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str


class RequestStream:
    """The outputs of one request, or of several (the choices of one HTTP request: `RequestOutput.request_id`
    tells them apart), in the order the engine made them, as an async iterator of `RequestOutput`; ends after
    each request's finished one.

    `next(timeout)` is the same with a timeout (None when nothing came), so a handler can poll for a client that
    went away between outputs. Closing (or leaving) a stream before it finished aborts its unfinished requests."""

    def __init__(self, owner: AsyncEngineCore, request_ids: list[str], stream: _Stream) -> None:
        self.owner, self._stream = owner, stream
        self.request_id = request_ids[0]
        self.unfinished = dict.fromkeys(request_ids)
        self._ready: deque[RequestOutput] = deque()  # taken from the stream, not yet returned by next()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.next()
        if out is None:
            raise StopAsyncIteration
        return out

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output; None at the end of the stream or when `timeout` seconds passed without one
        (check `finished` to tell them apart). Raises EngineDeadError when the engine failed."""
        if not self._ready:
            self._ready.extend(await self.next_batch(timeout))
        return self._ready.popleft() if self._ready else None

    async def next_batch(self, timeout: float | None = None) -> list[RequestOutput]:
        """Every output waiting (at least one, in the order the engine made them); [] at the end of the stream or
        when `timeout` seconds passed without one. Raises EngineDeadError when the engine failed (after the
        outputs that came before the failure were returned)."""
        if self._ready:
            out, self._ready = list(self._ready), deque()
            return out
        st = self._stream
        while self.unfinished:
            if not st.items and not await st.wait(timeout):
                return []
            out = []
            while st.items:
                item = st.items.popleft()
                if isinstance(item, BaseException):
                    if out:  # first the outputs that came before it
                        st.items.appendleft(item)
                        return out
                    self.unfinished.clear()
                    raise item
                if item.request_id not in self.unfinished:  # of a request aborted here
                    continue
                if item.finished:
                    del self.unfinished[item.request_id]
                out.append(item)
            if out:
                return out
        return []

    def abort(self, request_id: str | None = None) -> None:
        """Stop generating one request (a choice's stop string) or every unfinished one (client gone).
        Idempotent; no-op for finished requests."""
        for rid in [request_id] if request_id is not None else list(self.unfinished):
            if rid in self.unfinished:
                del self.unfinished[rid]
                self.owner.abort(rid)

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:  # a stream dropped unfinished (e.g. a response that never started) aborts
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.abort()


class AsyncEngineCore:
    def __init__(self, engine: Any, *, idle_poll_s: float = 1.0, start: bool = True) -> None:
        """engine: an EngineCore (or anything with its methods). The engine thread starts at once unless
        `start` is False (call `start()`)."""
        self.engine = engine
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.model_name = getattr(engine, "model_name", "dustin")
        self.method: str | None = getattr(getattr(engine, "config", None), "method", None)  # the decoding method
        self.max_context = int(engine.max_context)
        self.vocab_limit = int(engine.pair.vocab_limit)  # token ids the engine takes: 0..vocab_limit - 1
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()  # guards _stats and _error
        self._stats: dict = {}
        self._error: str | None = None
        self._idle_poll_s = idle_poll_s
        self._thread = threading.Thread(target=self._run, name="dustin-engine", daemon=True)
        self._refresh_stats()
        if start:
            self.start()

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        if self._thread.ident is None and not self._stop.is_set():
            self._thread.start()

    @property
    def error(self) -> str | None:
        """Why the engine stopped serving (None while healthy)."""
        with self._lock:
            return self._error

    def check_request(self, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> None:
        """EngineCore.check_request (InputError), run by the caller: it reads only settings fixed at start."""
        self.engine.check_request(prompt_ids, params, n)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request and return its output stream once the engine accepted it.

        Raises before any output: InputError (bad prompt or parameters), QueueFullError (too many waiting),
        EngineDeadError (the engine failed or is shutting down)."""
        return await self.generate_groups([[Request(request_id, list(prompt_ids), params)]])

    async def generate_groups(self, groups: list[list[Request]]) -> RequestStream:
        """`generate` for several requests at once (all or none are queued), one stream for all their outputs:
        each group is one request, or the n sequences of one prompt, each with its own parameters (seed), whose
        prompt is prefilled once (EngineCore.add_requests)."""
        err = self.error
        if err is not None:
            raise EngineDeadError(err)
        for group in groups:
            for r in group:
                self.check_request(r.prompt_ids, r.params, len(group))
        ids = [r.request_id for group in groups for r in group]
        stream = _Stream(asyncio.get_running_loop())
        cmd = _Add(groups, stream)
        self._commands.put(cmd)
        self._wake.set()
        if self._stop.is_set():  # raced with shutdown: the engine thread may never read the command
            _set_exception(cmd.future, EngineDeadError(_SHUTDOWN_MESSAGE))
        try:
            await asyncio.wrap_future(cmd.future)
        except asyncio.CancelledError:  # the client left while the request was being queued
            for rid in ids:
                self.abort(rid)
            raise
        return RequestStream(self, ids, stream)

    def abort(self, request_id: str) -> None:
        """Abort a waiting or running request (thread-safe, non-blocking, no-op for unknown ids)."""
        self._commands.put(_Abort(request_id))
        self._wake.set()

    def stats(self) -> dict:
        """The engine's stats after its last step (a copy), plus `error` (None while healthy)."""
        with self._lock:
            snap = dict(self._stats)
            snap["error"] = self._error
        return snap

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread after its current step; in-flight requests fail with EngineDeadError. Waits up to
        `timeout` seconds for the thread (None: until it ended, which under tensor parallelism includes stopping the
        followers)."""
        self._stop.set()
        self.wait_stopped(timeout)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: as long as it takes) for the engine thread to end, as it does after
        `shutdown` or when its loop fails (`error` says why); whether it is not running (or never started). Wakes
        the thread first, so an idle one notices at once; called on the engine thread itself it does not wait."""
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self.engine.bind_thread()
            while not self._stop.is_set():
                self._wake.clear()  # before reading commands: a command put after this sets it again
                self._apply_commands()
                if self._error is None and self.engine.has_unfinished():
                    self._step()
                else:
                    self.engine.executor.heartbeat()  # tensor parallelism: the followers wait for a plan meanwhile
                    self._wake.wait(self._idle_poll_s)
        except BaseException as e:  # noqa: BLE001 - a bug here must not leave clients hanging
            self._die(f"engine loop failed: {type(e).__name__}: {e}")
            log.error("dustin serve: engine loop failed\n%s", traceback.format_exc())
        finally:
            with self._lock:
                if self._error is None:
                    self._error = _SHUTDOWN_MESSAGE
            self._fail_all(EngineDeadError(_SHUTDOWN_MESSAGE))
            self._stop_followers()

    def _stop_followers(self) -> None:
        try:
            if not self.engine.executor.stop_followers():
                log.error("dustin serve: the tensor-parallel ranks cannot be stopped (a step failed after its plan "
                          "was sent): they end at the process group's timeout or when this process ends")
        except Exception:  # noqa: BLE001 - a follower already gone: the broadcast fails
            log.error("dustin serve: stopping the tensor-parallel ranks failed\n%s", traceback.format_exc())

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                self._abort(cmd.request_id)

    def _add(self, cmd: _Add) -> None:
        if self._error is not None:
            _set_exception(cmd.future, EngineDeadError(self._error))
            return
        added: list[str] = []
        try:
            for group in cmd.groups:  # each request was checked by `generate_groups` (on the event loop)
                self.engine.add_requests(group, checked=True)
                added += [r.request_id for r in group]
        except Exception as e:  # noqa: BLE001 - InputError, QueueFullError (or a bug): the caller gets it
            for rid in added:  # all or nothing
                self.engine.abort_request(rid)
            _set_exception(cmd.future, e)
            return
        for rid in added:
            self._streams[rid] = cmd.stream
        _set_result(cmd.future, None)
        self._refresh_stats()

    def _abort(self, request_id: str) -> None:
        if self._error is not None:
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:  # unknown or already finished: nothing to abort
            log.debug("abort of %s ignored", request_id, exc_info=True)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            log.error("dustin serve: engine step failed\n%s", traceback.format_exc())
            self._die(f"engine step failed: {type(e).__name__}: {e}")
            return
        self._refresh_stats()  # before delivering: a client that got its last token sees it counted
        batches: dict[_Stream, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream, []).append(out)
        _deliver(batches)

    def _die(self, message: str) -> None:
        with self._lock:
            self._error = message
        self._fail_all(EngineDeadError(message))
        self._refresh_stats()

    def _fail_all(self, exc: BaseException) -> None:
        _deliver({stream: [exc] for stream in self._streams.values()})
        self._streams.clear()
        while True:  # adds that arrived after the failure
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                _set_exception(cmd.future, exc)

    def _refresh_stats(self) -> None:
        try:
            snap = dict(self.engine.stats())
        except Exception:
            log.debug("engine.stats() failed", exc_info=True)
            return
        snap["updated"] = time.time()
        with self._lock:
            self._stats = snap


def _deliver(batches: dict[_Stream, list]) -> None:
    """Hand each stream its items on its event loop: one call_soon_threadsafe (one wake-up of the loop) per loop
    and step, whatever the number of requests."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, list]]] = {}
    for stream, items in batches.items():
        by_loop.setdefault(stream.loop, []).append((stream, items))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_push_all, pairs)
        except RuntimeError:  # the client's event loop is closed: nobody is listening
            pass


def _push_all(pairs: list[tuple[_Stream, list]]) -> None:
    for stream, items in pairs:
        stream.push(items)


def _set_result(fut: Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
