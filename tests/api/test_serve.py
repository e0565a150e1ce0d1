"""`dustin serve` against a live server: uvicorn in a background thread, the real `openai` client and raw httpx.

The tiny random pair has a word-level tokenizer ("w0".."w92") and no chat template, so most prompts are token-id
lists; the real default pair (when fetched) checks a chat and a text completion against `Engine.generate`.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest
import torch

try:
    import httpx
except ImportError:  # some environments ship httpx's successor under its own name (the openai client uses it)
    import httpx2 as httpx

import openai

from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.engine import Engine
from dustin.engine.request import SamplingParams
from dustin.serve.async_engine import AsyncEngineCore
from dustin.serve.detokenize import IncrementalDetokenizer
from dustin.serve.local import LocalServer
from tests.offline import offline

MODEL = "tiny"
CONTEXT = 1024
GAMMA = 4


class LiveServer(LocalServer):
    """dustin serve on a free port of 127.0.0.1 in a thread, with an httpx and an openai client."""

    def __init__(self, engine, name: str = MODEL, timeout: float = 60) -> None:
        super().__init__(engine, name)
        self.http = httpx.Client(base_url=self.url, timeout=timeout)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        text = self.http.get("/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.MULTILINE)}

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m["dustin_requests_running"] == 0 and m["dustin_requests_waiting"] == 0:
                return m
            assert time.time() < deadline, f"requests still in flight: {m}"
            time.sleep(0.05)

    def close(self) -> None:
        self.http.close()
        super().close()


def _engine(tiny_pair, **cfg) -> EngineCore:
    target, draft = tiny_pair
    cfg = {"method": "classic", "gamma": GAMMA, "max_slots": 4, "max_context": CONTEXT, "max_waiting": 64, **cfg}
    return EngineCore.from_pretrained(str(target), str(draft), device="cpu", dtype="fp32",
                                      config=GenerationConfig(**cfg))


@pytest.fixture(scope="module")
def live(tiny_pair):
    srv = LiveServer(_engine(tiny_pair))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """The offline Engine on the same checkpoints (the server's output must equal its greedy output)."""
    return Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", dtype="fp32")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def _complete(live, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    return live.http.post("/v1/completions", json=body)


def _sse_events(lines) -> list:
    """The JSON objects of an SSE stream, up to `data: [DONE]` (which must come last)."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: ") and not done, line
        if line == "data: [DONE]":
            done = True
            continue
        events.append(json.loads(line[len("data: "):]))
    assert done, "the stream did not end with data: [DONE]"
    return events


# ------------------------------------------------------------------------------------------ basic endpoints
def test_health_models_and_metrics(live):
    r = live.http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = live.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert live.http.get("/v1/models").json()["data"][0]["max_model_len"] == CONTEXT
    assert _complete(live, prompt=[5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True).status_code == 200
    r = live.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("dustin_requests_waiting", "dustin_requests_running", "dustin_kv_usage", "dustin_tau",
                 "dustin_generated_tokens_total", "dustin_tokens_per_second"):
        assert re.search(rf"^# TYPE {name} (gauge|counter)$", text, re.MULTILINE), name
        assert re.search(rf"^{name} [0-9.e+-]+$", text, re.MULTILINE), name
    assert re.search(r'^dustin_requests_total\{status="success"\} [1-9]', text, re.MULTILINE)
    m = live.metrics()
    assert m["dustin_generated_tokens_total"] >= 3 and m["dustin_tau"] >= 1.0 and 0 <= m["dustin_kv_usage"] <= 1
    assert m["dustin_kv_slots_total"] == 4


def _prometheus(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """A Prometheus text exposition read strictly: each family's `# TYPE`, and every sample (name with its labels
    -> value). A line that is neither a comment nor a sample, or a sample of a family without `# TYPE`, fails."""
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)", line)
        assert m, f"not a sample: {line!r}"
        name = m.group(1)
        family = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
        assert family in types, f"{name} has no # TYPE"
        samples[name + (m.group(2) or "")] = float(m.group(3))
    return types, samples


def _histogram(types: dict, samples: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """A histogram's cumulative (le, count) buckets, its sum and its count, checked for shape: ascending bounds
    ending at +Inf, non-decreasing counts, the +Inf bucket equal to the count."""
    assert types[name] == "histogram"
    buckets = [(float(re.search(r'le="([^"]+)"', k).group(1)), v) for k, v in samples.items()
               if k.startswith(name + "_bucket{")]
    les, counts = [b[0] for b in buckets], [b[1] for b in buckets]
    assert les == sorted(les) and les[-1] == float("inf") and len(les) > 5
    assert counts == sorted(counts) and counts[-1] == samples[name + "_count"]
    return buckets, samples[name + "_sum"], samples[name + "_count"]


TTFT, TPOT, E2E = ("dustin_time_to_first_token_seconds", "dustin_request_time_per_output_token_seconds",
                   "dustin_e2e_request_latency_seconds")


def test_metrics_latency_histograms_and_speculation_counters(live):
    """/metrics against a live server: TTFT, TPOT and end-to-end latency histograms observe each request once, at
    values the client's own clock bounds, in the buckets their values belong to; the speculation counters add up
    to the tokens the request got (classic, Γ = 4)."""
    live.wait_idle()
    types, before = _prometheus(live.http.get("/metrics").text)
    t0 = time.perf_counter()
    r = _complete(live, prompt=[5, 6, 7, 8], max_tokens=24, temperature=0, ignore_eos=True)
    wall = time.perf_counter() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
    types, after = _prometheus(live.http.get("/metrics").text)
    hist = {}
    for name in (TTFT, TPOT, E2E):
        b0, s0, n0 = _histogram(types, before, name)
        b1, s1, n1 = _histogram(types, after, name)
        assert n1 - n0 == 1, name  # one observation for the one request
        value = s1 - s0
        hist[name] = value
        # exactly the buckets whose bound is at or above the value gained it
        assert [round(c1 - c0) for (_, c0), (_, c1) in zip(b0, b1, strict=True)] == [
            int(le >= value) for le, _ in b1], name
    ttft, tpot, e2e = hist[TTFT], hist[TPOT], hist[E2E]
    assert 0 < ttft < e2e <= wall
    assert tpot == pytest.approx((e2e - ttft) / 23, rel=1e-6)  # first to last token over the 23 gaps
    # speculation: every decode step of the request verified Γ = 4 drafts; the prefill gave its first token
    for name in ("dustin_spec_decode_num_drafts_total", "dustin_spec_decode_num_draft_tokens_total",
                 "dustin_spec_decode_num_accepted_tokens_total"):
        assert types[name] == "counter", name
    drafts, proposed, accepted = (after[k] - before[k] for k in (
        "dustin_spec_decode_num_drafts_total", "dustin_spec_decode_num_draft_tokens_total",
        "dustin_spec_decode_num_accepted_tokens_total"))
    assert drafts >= 1 and proposed == GAMMA * drafts and 0 <= accepted <= proposed
    assert 23 <= drafts + accepted <= 23 + GAMMA  # a step gives its accepted drafts + 1; the last may overshoot
    # over the server's life the counters are τ's own terms
    assert after["dustin_tau"] == pytest.approx(
        1 + after["dustin_spec_decode_num_accepted_tokens_total"] / after["dustin_spec_decode_num_drafts_total"])

    # streamed, n = 2: each choice is observed; a 1-token request has no time per output token
    body = {"model": MODEL, "prompt": [9, 10], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream": True}
    with live.http.stream("POST", "/v1/completions", json=body) as resp:
        assert len(_sse_events(resp.iter_lines())) >= 2
    assert _complete(live, prompt=[11], max_tokens=1, temperature=0, ignore_eos=True).status_code == 200
    types, last = _prometheus(live.http.get("/metrics").text)
    assert last[TTFT + "_count"] - after[TTFT + "_count"] == 3
    assert last[E2E + "_count"] - after[E2E + "_count"] == 3
    assert last[TPOT + "_count"] - after[TPOT + "_count"] == 2


def test_speculation_counters_of_a_method_without_drafts(tiny_pair):
    eng = _engine(tiny_pair, method="vanilla")
    eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    st = eng.stats()
    assert (st["spec_drafts_total"], st["spec_draft_tokens_total"], st["spec_accepted_tokens_total"]) == (0, 0, 0)
    assert st["generated_tokens_total"] == 8


def test_models_and_start_line_say_whether_the_output_is_the_targets(live, tiny_pair):
    card = live.http.get("/v1/models").json()["data"][0]
    assert (card["method"], card["lossy"]) == ("classic", False)
    srv = LiveServer(_engine(tiny_pair, method="dustin", budget=24, draft_window=32))
    try:
        card = srv.http.get("/v1/models").json()["data"][0]
        assert (card["method"], card["lossy"]) == ("dustin", True)
        assert srv.client.models.list().data[0].model_extra["lossy"] is True
    finally:
        srv.close()
    from dustin.serve.cli import start_line

    assert start_line("::1", 8000, "m", "dustin", 4096, 16) == (
        "dustin serve: http://[::1]:8000 (model m, method dustin, 4096 context x 16 slots); lossy: sparse "
        "verification, the output can differ from the target's")
    assert start_line("0.0.0.0", 80, "m", "magicdec", 512, 2, world=2).endswith(
        "2 slots, tensor parallel over 2 ranks); lossless: the target's own output")


def test_stream_hands_over_every_waiting_output_at_once():
    """RequestStream.next_batch: the outputs waiting, in order, in one batch; those of an aborted request dropped;
    an engine failure raised after the outputs that came before it."""
    import asyncio

    from dustin.engine.request import RequestOutput
    from dustin.errors import DustinError
    from dustin.serve.async_engine import EngineDeadError, RequestStream, _Stream

    class Owner:
        aborted: ClassVar[list] = []

        def abort(self, rid):
            self.aborted.append(rid)

    async def go():
        st = _Stream(asyncio.get_running_loop())
        stream = RequestStream(Owner(), ["a", "b", "c"], st)
        assert await stream.next_batch(timeout=0.01) == []  # nothing yet: the timeout
        st.push([RequestOutput("a", [1], False), RequestOutput("b", [2], False), RequestOutput("a", [3], False)])
        stream.abort("c")
        st.push([RequestOutput("c", [9], False), RequestOutput("b", [4], True)])
        got = await stream.next_batch(timeout=1)
        assert [(o.request_id, o.new_token_ids) for o in got] == [("a", [1]), ("b", [2]), ("a", [3]), ("b", [4])]
        assert Owner.aborted == ["c"] and list(stream.unfinished) == ["a"]
        waiter = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)
        st.push([RequestOutput("a", [5], False), EngineDeadError("boom")])
        assert [o.new_token_ids for o in await waiter] == [[5]]  # the output first, then the failure
        with pytest.raises(DustinError, match="boom"):
            await stream.next_batch()
        assert stream.finished

    asyncio.run(go())


def test_a_choices_waiting_outputs_go_out_as_one_chunk():
    """What a handler that fell behind sends: each request's outputs of a batch joined, tokens, log-probabilities
    and finish in order, the prompt's log-probabilities kept."""
    from dustin.engine.request import Logprob, RequestOutput
    from dustin.serve.app import _merged

    lp = [Logprob(-float(i), ((i, -float(i)),)) for i in range(5)]
    outs = [RequestOutput("a", [1, 2], False, None, 3, 2, lp[:2], [None, lp[4]]),
            RequestOutput("b", [7], False, None, 2, 1, None),
            RequestOutput("a", [3], True, "length", 3, 3, lp[2:3])]
    a, b = _merged(outs)
    assert (a.request_id, a.new_token_ids, a.finished, a.finish_reason, a.completion_tokens) == (
        "a", [1, 2, 3], True, "length", 3)
    assert a.logprobs == lp[:3] and a.prompt_logprobs == [None, lp[4]]
    assert b is outs[1] and outs[0].new_token_ids == [1, 2]  # a single output passes as it is; none is changed


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("ids", [False, True])
def test_stream_chunks_are_the_response_models(chat, ids):
    """The SSE chunks, built as dicts on the per-token path, are what the response models dump to."""
    from dustin.serve.app import _dump, _Job, _Prompt
    from dustin.serve.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        ChatCompletionRequest,
        ChatLogprobs,
        CompletionChoice,
        CompletionLogprobs,
        CompletionRequest,
        CompletionResponse,
        Delta,
    )

    if chat:
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                     "return_token_ids": ids})
        lp = ChatLogprobs(content=[])
    else:
        body = CompletionRequest.model_validate({"prompt": [5, 6], "return_token_ids": ids})
        lp = CompletionLogprobs(tokens=["w1"], token_logprobs=[-0.5], top_logprobs=[{"w1": -0.5}], text_offset=[0])
    job = _Job("id-1", 123, "m", chat, body, None if ids else object(), [_Prompt([5, 6], None)], False)
    job.add(job.prompts[0], "id-1-0-0")
    c = job.choices[0]
    for text, logprobs, finish, role in (("ab", lp, None, False), ("", None, "length", False), ("", None, None, True)):
        c.finish = finish
        got = job.chunk(c, text, logprobs, [4, 5], role=role)
        if chat:
            d = _dump(ChatCompletionChunk(id="id-1", created=123, model="m", choices=[ChatChunkChoice(
                index=0, delta=Delta(role="assistant" if role else None, content=text), logprobs=logprobs,
                finish_reason=None if role else finish, token_ids=[4, 5] if ids else None)]))
            d["choices"][0]["delta"] = {k: v for k, v in d["choices"][0]["delta"].items() if v is not None}
        else:
            d = _dump(CompletionResponse(id="id-1", created=123, model="m", choices=[CompletionChoice(
                index=0, text=text, logprobs=logprobs, finish_reason=finish, token_ids=[4, 5] if ids else None)]))
        assert got == d and json.dumps(got) == json.dumps(d)  # the same keys in the same order


def test_unknown_path_and_model(live):
    r = live.http.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = _complete(live, model="gpt-4", prompt=[5, 6], max_tokens=2)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ------------------------------------------------------------------------------------------ exactness
def test_greedy_output_equals_engine_generate(live, reference):
    prompts = _prompts([5, 23, 61, 12])
    for p in prompts:
        ref = reference.generate([p], *offline(method="classic", gamma=GAMMA, max_new_tokens=24))
        want = ref.sequences[0]
        resp = live.client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                              extra_body={"return_token_ids": True})
        choice = resp.choices[0]
        assert choice.token_ids == want.token_ids
        assert choice.text == want.text
        assert choice.finish_reason == ("length" if len(want.token_ids) == 24 else "stop")
        assert resp.usage.prompt_tokens == len(p) and resp.usage.completion_tokens == len(want.token_ids)
        assert resp.usage.total_tokens == len(p) + len(want.token_ids)
        assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")


def _text(ids):
    """What the tiny tokenizer decodes ids to: its words ("w0" is id 3) run together, special tokens dropped."""
    return "".join(f"w{i - 3}" for i in ids if i > 2)


def test_prompt_forms(live):
    """Token ids and a one-element batch of them agree; the text is the tokenizer's decoding of the ids. (The
    tiny tokenizer encodes no text: a text prompt is a 400 naming the problem; the real pair checks text.)"""
    outs = []
    for prompt in ([8, 9, 10, 11], [[8, 9, 10, 11]]):
        r = _complete(live, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)
        assert r.status_code == 200, r.text
        outs.append(r.json()["choices"][0])
    assert outs[0] == outs[1] and len(outs[0]["token_ids"]) == 8
    assert outs[0]["text"] == _text(outs[0]["token_ids"])
    r = _complete(live, prompt="w5 w6", max_tokens=2)
    assert r.status_code == 400 and "no tokens" in r.json()["error"]["message"]


def test_max_tokens_default_is_16(live):
    r = _complete(live, prompt=[5, 6, 7], temperature=0, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_seeded_sampling_is_reproducible(live):
    a, b = (_complete(live, prompt=[5, 6, 7, 8], max_tokens=12, temperature=1.0, seed=7, ignore_eos=True,
                      return_token_ids=True).json()["choices"][0]["token_ids"] for _ in range(2))
    assert a == b and len(a) == 12


def test_streaming_returns_the_non_streaming_tokens(live):
    p = _prompts([30], seed=4)[0]
    body = {"model": MODEL, "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    plain = _complete(live, **body).json()["choices"][0]
    with live.http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.iter_lines())
    chunks = [e for e in events if e["choices"]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == plain["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks) > 1  # really streamed, one chunk per engine step
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 40
    # the openai client's stream gives the same text
    stream = live.client.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == plain["text"]


def test_concurrent_requests_all_complete(live, reference):
    """32 requests of mixed prompt lengths and max_tokens at once through 4 slots: each gets exactly its tokens,
    and (greedy output does not depend on the batch) exactly what the offline engine gives it."""
    prompts = _prompts([3 + (i * 37) % 150 for i in range(32)], seed=11)
    limits = [1 + (i * 7) % 40 for i in range(32)]

    def one(i):
        r = live.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=limits[i], temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0], r.usage

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    ref = reference.generate(prompts, *offline(method="classic", gamma=GAMMA, max_new_tokens=max(limits),
                                                       stop_at_eos=False), limits=limits)
    for (choice, usage), limit, want in zip(results, limits, ref.sequences, strict=False):
        assert usage.completion_tokens == limit and choice.finish_reason == "length"
        assert choice.token_ids == want.token_ids
    m = live.wait_idle()
    assert m["dustin_kv_usage"] == 0


# ------------------------------------------------------------------------------------------ stop strings
def test_stop_strings(live):
    body = {"prompt": [9, 20, 31, 42], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = _complete(live, **body, return_token_ids=True).json()["choices"][0]
    stop = _text(full["token_ids"][5:7])  # two tokens' text: the stop string spans a token boundary
    want = full["text"][:full["text"].index(stop)]
    r = _complete(live, **body, stop=[stop, "never-there"]).json()
    assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 30
    with live.http.stream("POST", "/v1/completions", json={**body, "model": MODEL, "stop": stop,
                                                           "stream": True}) as s:
        events = _sse_events(s.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    live.wait_idle()  # the engine request was aborted at the stop string


class _CharTokenizer:
    """Each id decodes to one piece; id 0 and 1 are the two halves of one 2-byte character."""

    pieces: ClassVar[dict[int, bytes]] = {0: b"\xc3", 1: b"\xa9", 2: b"a", 3: b"b", 4: b"c", 5: b"X", 6: b"Y", 7: b"\n"}

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_holds_back_partial_stops_and_characters():
    d = IncrementalDetokenizer(_CharTokenizer(), ["XY", "\n\n"])
    assert d.add([2, 3]) == "ab"
    assert d.add([0]) == ""  # half a character: held back
    assert d.add([1]) == "é"
    assert d.add([5]) == ""  # could start "XY"
    assert d.add([4]) == "Xc"  # it did not
    assert d.add([7]) == ""  # could start "\n\n"
    assert d.add([7, 2]) == "" and d.stopped  # a stop string: dropped, with what follows
    assert d.text == "abéXc" and d.add([2]) == "" and d.finish() == ""
    d = IncrementalDetokenizer(_CharTokenizer(), ["XY"])
    assert d.add([2, 5]) == "a" and d.finish() == "X" and d.text == "aX"
    assert IncrementalDetokenizer(None, ["x"]).add([1, 2]) == ""  # no tokenizer: ids only


# ------------------------------------------------------------------------------------------ bad requests
@pytest.mark.parametrize("body,param", [
    ({"prompt": "5", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": [5, 6], "temperature": "hot"}, "temperature"),
    ({"prompt": [5, 6], "max_tokens": True}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [5, "x"]}, "prompt"),
    ({"prompt": [5, 6], "stream": "yes"}, "stream"),
    ({"prompt": [5, 6], "stop": 3}, "stop"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [5] * (CONTEXT + 10), "max_tokens": 4}, "prompt"),
    ({"prompt": [5, 6], "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": CONTEXT - 3}, "max_tokens"),  # prompt + max_tokens + Γ past the context
    ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5, 6], "n": 0}, "n"),
    ({"prompt": [5, 6], "n": 5}, "n"),  # more choices than the server's 4 slots
    ({"prompt": [5, 6], "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[5], []]}, "prompt"),
    ({"prompt": [[5], [6, 10_000]]}, "prompt"),
    ({"prompt": [5, 10_000]}, "prompt"),
    ({"prompt": [5, 6], "logprobs": 21}, "logprobs"),
    ({"prompt": [5, 6], "logprobs": -1}, "logprobs"),
    ({"prompt": [5, 6], "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": [5, 6], "suffix": "x"}, "suffix"),
    ({"prompt": [5, 6], "top_p": 0}, "top_p"),
    ({"prompt": [5, 6], "temperature": -1}, "temperature"),
    ({"prompt": [5, 6], "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": [5, 6], "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": [5, 6], "stop": [""]}, "stop"),
])
def test_bad_requests_are_400_with_an_openai_error(live, body, param):
    r = live.http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, err


@pytest.mark.parametrize("temperature", [b"1e400", b"Infinity", b"NaN"])
def test_a_temperature_that_is_not_finite_is_400(live, temperature):
    """1e400 is valid JSON that parses to inf (Infinity and NaN are Python's extensions): 400, not random text."""
    raw = b'{"model": "%s", "prompt": [5, 6], "max_tokens": 2, "temperature": %s}' % (MODEL.encode(), temperature)
    r = live.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


@pytest.mark.parametrize("raw", [b'{"prompt": [1, 2', b"not json", b"[1, 2]", b""])
def test_malformed_json_is_400(live, raw):
    r = live.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_bad_requests(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model=MODEL, prompt=[5, 6], n=5)
    assert e.value.body["param"] == "n" and "--max-slots" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model=MODEL, prompt=[5, 6], logprobs=21)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError):
        live.client.completions.create(model=MODEL, prompt=[5] * (CONTEXT + 1), max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="chat template"):  # the tiny tokenizer has none
        live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1 w2"}])
    r = live.http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.fixture
def chat(live, monkeypatch):
    """/v1/chat/completions answering on the tiny pair for this test: its tokenizer gets a chat template, and the
    template's encoding (which the tiny tokenizer cannot do from text) is each message's words "wN" as ids N + 3,
    in turn."""
    from dustin.serve import app as app_module

    def encode_chat(tokenizer, messages):
        return [int(w[1:]) + 3 for m in messages for w in m["content"].split()]
    monkeypatch.setattr(live.async_engine.tokenizer, "chat_template", "{{ messages }}")
    monkeypatch.setattr(app_module, "encode_chat", encode_chat)
    return live


def _chat(live, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": "w1 w2 w3"}])
    return live.http.post("/v1/chat/completions", json=body)


def _ids_of(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("field, value, where", [
    ("min_p", 0.1, "min_p"), ("repetition_penalty", 1.2, "repetition_penalty"),
    ("stop_token_ids", [5], "stop_token_ids"), ("frobnicate", {"a": 1}, "frobnicate"),
    ("min_p", None, "min_p"),  # an undeclared field is refused whatever its value
    ("stream_options", {"include_usage": True, "continuous_usage_stats": True},
     "stream_options.continuous_usage_stats"),
])
def test_undeclared_fields_are_400_naming_the_field(chat, endpoint, field, value, where):
    body = {"max_tokens": 2, "temperature": 0, field: value}
    r = _complete(chat, prompt=[5, 6], **body) if endpoint == "completions" else _chat(chat, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err == {"message": f"{where} is not supported (this server does not implement it)",
                   "type": "invalid_request_error", "param": field, "code": "unsupported_field"}


@pytest.mark.parametrize("messages, needle", [
    ([], "messages"), ([{"role": "wizard", "content": "w1"}], "messages.0.role"),
    ([{"role": "user"}], "a user message needs content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text content parts are supported, got 'image_url'"),
])
def test_bad_messages_are_400_saying_what_is_wrong(chat, messages, needle):
    r = _chat(chat, max_tokens=2, messages=messages)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert needle in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("prompt, needle", [("", "prompt: must not be empty"), ([], "prompt: must not be empty"),
                                            (["w1", ""], "prompt 1 of the batch is empty"),
                                            ([5, -1], "token ids must be >= 0")])
def test_bad_prompts_are_400_saying_what_is_wrong(live, prompt, needle):
    r = live.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_undeclared_fields_inside_messages_are_400(chat):
    r = _chat(chat, messages=[{"role": "user", "content": "w1", "tool_call_id": "x"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert r.json()["error"]["message"].startswith("messages.0.tool_call_id is not supported")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    ("response_format", {"type": "text", "extra": 1}),
    ("store", True),
])
def test_options_we_do_not_implement_are_400(chat, endpoint, field, value):
    body = {"max_tokens": 2, "temperature": 0, field: value}
    r = _complete(chat, prompt=[5, 6], **body) if endpoint == "completions" else _chat(chat, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and field in err["message"], err


def test_tool_choice_without_tools_is_neutral_or_400(chat):
    assert _chat(chat, max_tokens=2, tool_choice="required").json()["error"]["param"] == "tool_choice"
    for neutral in ("none", "auto"):
        assert _chat(chat, max_tokens=2, temperature=0, tool_choice=neutral).status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_ignored_fields_change_nothing(chat, endpoint):
    """Each accepted-and-ignored field (and response_format text, store false) gives the output of the same
    request without it."""
    from dustin.serve.protocol import IGNORED_FIELDS

    send = (lambda **b: _complete(chat, prompt=[7, 8, 9], **b)) if endpoint == "completions" else \
        (lambda **b: _chat(chat, **b))
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    want = _ids_of(send(**base))
    extra = {"user": "someone", "metadata": {"run": "1"}, "service_tier": "auto"}
    assert set(extra) == set(IGNORED_FIELDS)
    for field, value in [*extra.items(), ("response_format", {"type": "text"}), ("store", False)]:
        assert _ids_of(send(**base, **{field: value})) == want, field


def test_ignored_fields_are_the_documented_ones():
    """docs/serving.md lists exactly the fields the server accepts and ignores, each with its reason."""
    from pathlib import Path

    from dustin.serve.protocol import IGNORED_FIELDS

    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = text.split("### Fields accepted and ignored\n", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^- `(\w+)`: \S", section, re.MULTILINE)
    assert listed == list(IGNORED_FIELDS)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_null_means_the_default(chat, endpoint):
    """Optional fields sent as JSON null take their defaults: n 1, not streamed, no echo, no logprobs, no stop,
    max_tokens 16 on completions, temperature 1.0 (a seeded null-temperature request is the same request at 1.0)."""
    own = ("echo", "best_of", "suffix") if endpoint == "completions" else \
        ("top_logprobs", "tools", "tool_choice", "functions", "max_completion_tokens")
    nulls = dict.fromkeys(("n", "stream", "stream_options", "stop", "presence_penalty", "frequency_penalty",
                           "logit_bias", "response_format", "user", "top_p", "top_k", "store", "metadata",
                           "service_tier", "logprobs", *own))
    send = (lambda **b: _complete(chat, prompt=[7, 8, 9], **b)) if endpoint == "completions" else \
        (lambda **b: _chat(chat, **b))
    body = {"return_token_ids": True, "ignore_eos": True, "seed": 3, "temperature": None,
            "max_tokens": None if endpoint == "completions" else 12}
    r = send(**body, **nulls)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    got = r.json()["choices"]
    assert len(got) == 1 and len(got[0]["token_ids"]) == (16 if endpoint == "completions" else 12)
    want = send(**{**body, "temperature": 1.0, "max_tokens": len(got[0]["token_ids"])})
    assert got[0]["token_ids"] == _ids_of(want)
    assert _ids_of(send(**{**body, "temperature": 0})) != got[0]["token_ids"]  # it sampled: not the greedy output


def test_openai_client_nulls_and_refusals(chat):
    """The real client: explicit None for optional arguments is the default; an option we do not implement is a
    BadRequestError naming it."""
    r = chat.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, n=None,
                                       stream=None, echo=None, logprobs=None, user="me")
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    c = chat.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4 w5"}],
                                            max_tokens=4, temperature=0, n=None, stream=None, metadata={"a": "b"},
                                            service_tier="auto", response_format={"type": "text"})
    assert c.choices[0].message.role == "assistant" and c.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        chat.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}],
                                            max_tokens=4, response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        chat.client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, extra_body={"min_p": 0.1})
    assert e.value.body["param"] == "min_p" and "min_p is not supported" in str(e.value)


# ------------------------------------------------------------------------------------------ logprobs, echo, n
@pytest.fixture(scope="module")
def hf(tiny_pair):
    """The Hugging Face model of the tiny target: the reference distribution of log-probabilities."""
    from tests.tiny_models import hf_model

    return hf_model(tiny_pair[0])


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _word(i: int) -> str:
    """The tiny tokenizer's text of token i alone (special tokens included)."""
    return {0: "<unk>", 1: "<s>", 2: "</s>"}.get(i, f"w{i - 3}")


def _check_legacy(lp, ref: torch.Tensor, ids: list[int], k: int, first_offset: int = 0) -> None:
    """OpenAI's legacy logprobs of tokens `ids` (ref row j predicts ids[j]; a None row: the prompt's first)."""
    assert lp.tokens == [_word(i) for i in ids]
    offsets = [first_offset + sum(len(_word(i)) for i in ids[:j]) for j in range(len(ids))]
    assert lp.text_offset == offsets
    for tok, value, top, row in zip(ids, lp.token_logprobs, lp.top_logprobs, ref, strict=True):
        if row is None:
            assert value is None and top is None
            continue
        assert value == pytest.approx(row[tok].item(), abs=2e-4)
        best = row.topk(k)
        want = {_word(i): v for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
        want.setdefault(_word(tok), row[tok].item())  # the chosen token's, too
        assert top.keys() == want.keys() and all(top[w] == pytest.approx(v, abs=2e-4) for w, v in want.items())


@pytest.mark.parametrize("temperature", [0, 0.7])
def test_completion_logprobs_are_the_targets_distribution(live, hf, temperature):
    """logprobs: 3 through the openai client, greedy and sampled (the values are of the raw distribution, before
    temperature): the chosen tokens' log-probabilities, the top 3 (and the chosen one) and the text offsets
    equal the HF model's log-softmax; streamed, the chunks' logprobs add up to the same."""
    p = _prompts([17], seed=21)[0]
    kw = dict(model=MODEL, prompt=p, max_tokens=12, temperature=temperature, seed=5, logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = live.client.completions.create(**kw).choices[0]
    ids = choice.token_ids
    ref = _log_softmax(hf, p + ids)[len(p) - 1:-1]
    _check_legacy(choice.logprobs, ref, ids, 3)
    chunks = [c.choices[0] for c in live.client.completions.create(**kw, stream=True)]
    streamed = {key: [x for c in chunks if c.logprobs for x in getattr(c.logprobs, key)]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == {key: getattr(choice.logprobs, key) for key in streamed}
    assert "".join(c.text for c in chunks) == choice.text


def test_echo_with_prompt_logprobs_as_lm_eval_asks(live, hf):
    """lm-eval's loglikelihood request: several token-id prompts, echo, logprobs 1, max_tokens 1 (and 0): each
    choice holds its prompt and then its token, the prompt's log-probabilities (the first null) from the
    prefill, and the generated token's; with max_tokens 0 the prompt alone."""
    prompts = _prompts([9, 30, 4], seed=22)
    for max_tokens in (1, 0):
        r = live.client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                           temperature=0, seed=1234)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == max_tokens * 3
        for c, p in zip(r.choices, prompts, strict=True):
            lp = c.logprobs
            ids = p + ([] if max_tokens == 0 else [next(i for i in range(96) if _word(i) == lp.tokens[-1])])
            ref = _log_softmax(hf, ids)
            _check_legacy(lp, [None, *ref[:len(ids) - 1]], ids, 1)
            assert c.text == "".join(_word(i) for i in ids if i > 2)
            assert c.finish_reason == "length"
            if max_tokens:  # the generated token is the greedy one
                assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    stream = live.client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=0,
                                            stream=True)
    (chunk,) = [c.choices[0] for c in stream]
    assert chunk.text == _text(prompts[0]) and chunk.logprobs.token_logprobs[0] is None
    assert len(chunk.logprobs.tokens) == len(prompts[0]) and chunk.finish_reason == "length"


def test_n_choices_and_several_prompts(live):
    """n = 2 over two prompts: four choices numbered prompt by prompt, choice i of a prompt seeded with seed + i
    (it equals the single request with that seed), the prompt prefilled once per prompt; streamed, the same
    texts per index."""
    prompts = _prompts([40, 7], seed=23)
    before = live.metrics()["dustin_prompt_tokens_total"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 10, "temperature": 1.2, "seed": 40, "ignore_eos": True,
            "return_token_ids": True}
    r = _complete(live, **body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # each prompt once, plus the last token of its second sequence (which copies the first's prompt cache)
    assert live.metrics()["dustin_prompt_tokens_total"] - before == sum(map(len, prompts)) + 2
    for c in choices:
        j, i = divmod(c["index"], 2)
        alone = _complete(live, **{**body, "prompt": prompts[j], "n": 1, "seed": 40 + i}).json()["choices"][0]
        assert c["token_ids"] == alone["token_ids"] and c["text"] == alone["text"]
    assert choices[0]["token_ids"] != choices[1]["token_ids"]
    assert r.json()["usage"] == {"prompt_tokens": 47, "completion_tokens": 40, "total_tokens": 87}
    stream = live.client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=10, temperature=1.2,
                                            seed=40, stream=True, extra_body={"ignore_eos": True})
    texts = ["", "", "", ""]
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c["text"] for c in choices]
    greedy = live.client.completions.create(model=MODEL, prompt=prompts[0], n=3, max_tokens=8, temperature=0)
    assert len({c.text for c in greedy.choices}) == 1 and len(greedy.choices) == 3


def test_chat_logprobs_and_n(chat):
    """logprobs: true, top_logprobs: 2 on chat: each content entry's token, log-probability, bytes and top 2
    are those of /v1/completions for the same prompt ids (the chat fixture renders "w1 w2 w3" as [4, 5, 6]);
    streamed, the same entries; n = 2 gives two choices; bad combinations are 400s."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=8, temperature=0)
    c = chat.client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, n=2)
    assert [x.index for x in c.choices] == [0, 1] and c.choices[0].message.content == c.choices[1].message.content
    legacy = chat.client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=8, temperature=0,
                                            logprobs=2).choices[0].logprobs
    content = c.choices[0].logprobs.content
    assert [e.token for e in content] == legacy.tokens
    assert [e.logprob for e in content] == pytest.approx(legacy.token_logprobs, abs=1e-5)
    for e, top in zip(content, legacy.top_logprobs, strict=True):
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
        assert {t.token: t.logprob for t in e.top_logprobs} == pytest.approx(
            {k: v for k, v in top.items() if k != e.token or len(top) == 2}, abs=1e-5)
    streamed = [x for ch in chat.client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, stream=True)
                if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = chat.client.chat.completions.create(**kw, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert chat.client.chat.completions.create(**kw).choices[0].logprobs is None
    for bad, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                               "top_logprobs"), ({"n": 0}, "n")):
        r = _chat(chat, max_tokens=2, **bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------------------ tokenizer endpoints
@pytest.fixture(scope="module")
def text_live(text_pair):
    """dustin serve on the tiny pair with a character-level tokenizer, which encodes text."""
    srv = LiveServer(_engine(text_pair, max_context=512))
    yield srv
    srv.close()


def test_tokenize_detokenize_version(text_live):
    """vLLM's /tokenize (a prompt, or messages through the chat template), /detokenize, /version and
    /tokenizer_info."""
    import dustin

    tok = text_live.async_engine.tokenizer
    r = text_live.http.post("/tokenize", json={"model": MODEL, "prompt": "def f(x):", "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tok.encode("def f(x):", add_special_tokens=True)
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                        "token_strs": tok.convert_ids_to_tokens(ids)}
    assert text_live.http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()["tokens"] == \
        tok.encode("ab", add_special_tokens=False)
    r = text_live.http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
    assert text_live.http.get("/version").json() == {"version": dustin.__version__}
    info = text_live.http.get("/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["model_max_length"] == 512 and info["tokenizer_class"]
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "a"}]}, "messages"),
                              ("/tokenize", {"prompt": "a", "min_p": 1}, "min_p"),
                              ("/detokenize", {"tokens": [5, 10_000]}, "tokens"),
                              ("/detokenize", {"tokens": "ab"}, "tokens")):
        r = text_live.http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = text_live.http.post("/tokenize", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_openapi_schema_documents_what_the_server_answers(chat):
    """/openapi.json: every error is a 400 (never FastAPI's 422) with OpenAI's error body; real response models;
    streamed responses as text/event-stream events whose data are chunks of a documented model; optional request
    fields nullable. Real responses of each kind, streamed chunks included, validate against the schema."""
    import jsonschema

    live = chat
    schema = live.http.get("/openapi.json").json()
    comps = schema["components"]["schemas"]
    assert "HTTPValidationError" not in comps and "ValidationError" not in comps
    ops = {(m.upper(), path): op for path, item in schema["paths"].items() for m, op in item.items()}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/health"),
            ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/tokenizer_info"),
            ("GET", "/metrics")} <= ops.keys()
    for (method, path), op in ops.items():
        assert "422" not in op["responses"], path
        if method == "POST":
            assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}, path
    for path, model in (("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionResponse")):
        content = ops["POST", path]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        event = content["text/event-stream"]["schema"]
        assert event["required"] == ["data"] and {"const": "[DONE]"} in event["properties"]["data"]["anyOf"]
    assert {"type": "null"} in comps["CompletionRequest"]["properties"]["n"]["anyOf"]
    assert "prompt" in comps["CompletionRequest"]["required"]

    def valid(body: dict, name: str) -> None:
        jsonschema.validate(body, {"$ref": f"#/components/schemas/{name}", "components": {"schemas": comps}})
    valid(_complete(live, prompt=[[5, 6], [7]], n=2, max_tokens=3, logprobs=2, echo=True,
                    return_token_ids=True).json(), "CompletionResponse")
    valid(_complete(live, prompt=[5], max_tokens=0).json(), "ErrorResponse")
    valid(live.http.get("/v1/models").json(), "ModelList")
    valid(live.http.get("/health").json(), "HealthResponse")
    valid(live.http.get("/version").json(), "VersionResponse")
    valid(live.http.post("/detokenize", json={"tokens": [5, 6]}).json(), "DetokenizeResponse")
    valid(_chat(live, max_tokens=3, logprobs=True, top_logprobs=2, n=2).json(), "ChatCompletionResponse")
    for path, body, name in (
            ("/v1/completions", {"prompt": [[5, 6], [7]], "n": 2, "logprobs": 1, "echo": True}, "CompletionResponse"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "logprobs": True},
             "ChatCompletionChunk")):
        body = {"model": MODEL, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}, **body}
        with live.http.stream("POST", path, json=body) as r:
            events = _sse_events(r.iter_lines())
        assert len(events) > 2
        for e in events:
            valid(e, name)


# ------------------------------------------------------------------------------------------ lm-eval
def test_lm_eval_local_completions_runs_both_request_kinds(text_live, text_pair, monkeypatch, tmp_path):
    """lm-eval's `local-completions` model against the live server on a tiny local task of each kind
    (tests/data/lm_eval), batch size 4: loglikelihood (echo + logprobs, several prompts a request) and
    generate_until (several prompts a request, stop strings). lm-eval finds the server's tokenizer itself
    (/tokenizer_info, /tokenize). Each log-likelihood equals the HF model's; each generation equals the server's
    answer to that prompt alone."""
    import datasets
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import check_remote_tokenizer_support

    from tests.tiny_models import hf_model

    here = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
    monkeypatch.chdir(here)  # the task files name their data relative to this folder
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    url = text_live.url + "/v1/completions"
    assert check_remote_tokenizer_support(url)
    res = lm_eval.simple_evaluate(
        model="local-completions", model_args={"model": MODEL, "base_url": url, "max_length": 512},
        tasks=["dustin_tiny_mc", "dustin_tiny_gen"], task_manager=TaskManager(include_path=str(here),
                                                                                include_defaults=False),
        batch_size=4, log_samples=True)
    assert res["results"]["dustin_tiny_mc"]["acc,none"] in (0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert "exact_match,none" in res["results"]["dustin_tiny_gen"]
    tok = text_live.async_engine.tokenizer
    hf = hf_model(text_pair[0])
    mc = res["samples"]["dustin_tiny_mc"]
    assert sum(len(s["resps"]) for s in mc) == 12
    for s in mc:
        for (context, continuation), ((ll, greedy),) in zip(s["arguments"], s["resps"], strict=True):
            ctx = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + continuation, add_special_tokens=False)
            ref = _log_softmax(hf, whole)
            want = ref[len(ctx) - 1:-1].gather(1, torch.tensor(whole[len(ctx):])[:, None])
            assert ll == pytest.approx(want.sum().item(), abs=1e-3)
            assert greedy == bool((ref[len(ctx) - 1:-1].argmax(-1) == torch.tensor(whole[len(ctx):])).all())
    gen = res["samples"]["dustin_tiny_gen"]
    assert len(gen) == 6
    for s in gen:
        (context, kwargs), = s["arguments"]
        alone = text_live.client.completions.create(model=MODEL, prompt=tok.encode(context, add_special_tokens=False),
                                                    max_tokens=kwargs["max_gen_toks"], temperature=0,
                                                    stop=kwargs["until"])
        assert s["resps"] == [[alone.choices[0].text]]


# ------------------------------------------------------------------------------------------ disconnects
def test_disconnect_mid_stream_aborts_the_request(live):
    before = live.metrics()
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": CONTEXT - 20, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with live.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len("data: "):])["choices"][0]["text"] is not None
        assert live.metrics()["dustin_requests_running"] == 1
    m = live.wait_idle()
    assert m['dustin_requests_total{status="aborted"}'] == before['dustin_requests_total{status="aborted"}'] + 1
    assert m["dustin_generated_tokens_total"] - before["dustin_generated_tokens_total"] < CONTEXT - 20
    r = _complete(live, prompt=[5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_non_streaming_client_that_leaves_is_aborted(live):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": CONTEXT - 20, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.3)
    live.wait_idle()


# ------------------------------------------------------------------------------------------ overload, failure
def test_queue_full_is_429(tiny_pair):
    srv = LiveServer(_ProxyEngine(_engine(tiny_pair, max_slots=1, max_waiting=1), delay=0.02))  # A runs > 10 s
    try:
        long = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": CONTEXT - 20, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with srv.http.stream("POST", "/v1/completions", json=long) as a:
            a_lines = a.iter_lines()  # kept referenced: a collected line iterator closes the response
            assert next(a_lines).startswith("data: ")  # running in the one slot
            with srv.http.stream("POST", "/v1/completions", json=long) as b:
                assert b.status_code == 200  # accepted: waiting
                r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 2})
                assert r.status_code == 429, r.text
                assert r.json()["error"]["message"] and r.json()["error"]["code"] == "queue_full"
                with pytest.raises(openai.RateLimitError):
                    srv.client.completions.create(model=MODEL, prompt=[5], max_tokens=2)
        srv.wait_idle()
        assert srv.metrics()['dustin_requests_total{status="rejected"}'] == 2
        r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 2})
        assert r.status_code == 200
    finally:
        srv.close()


class _ProxyEngine:
    """An EngineCore whose step() takes `delay` seconds longer, and raises once `fail` is set."""

    def __init__(self, engine, delay: float = 0.0) -> None:
        self._engine, self.delay, self.fail = engine, delay, False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        if self.fail:
            raise RuntimeError("simulated CUDA error")
        time.sleep(self.delay)
        return self._engine.step()


def test_engine_failure_fails_requests_and_health(tiny_pair):
    eng = _ProxyEngine(_engine(tiny_pair))
    srv = LiveServer(eng)
    try:
        assert _complete(srv, prompt=[5, 6], max_tokens=3).status_code == 200
        eng.fail = True
        r = _complete(srv, prompt=[5, 6], max_tokens=3)
        assert r.status_code == 500 and "simulated CUDA error" in r.json()["error"]["message"]
        h = srv.http.get("/health")
        assert h.status_code == 503 and "simulated CUDA error" in h.json()["error"]
        r = _complete(srv, prompt=[5, 6], max_tokens=3)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        with pytest.raises(openai.InternalServerError):
            srv.client.completions.create(model=MODEL, prompt=[5], max_tokens=2)
        m = srv.metrics()
        assert m["dustin_engine_healthy"] == 0 and m['dustin_requests_total{status="error"}'] >= 2
    finally:
        srv.close()


def test_stream_gets_an_error_event_when_the_engine_fails(tiny_pair):
    eng = _ProxyEngine(_engine(tiny_pair))
    srv = LiveServer(eng)
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": CONTEXT - 20, "ignore_eos": True,
                "stream": True}
        with srv.http.stream("POST", "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line)
            next(lines)
            eng.fail = True
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["type"] == "server_error"
    finally:
        srv.close()


def test_async_engine_check_runs_before_queueing(tiny_pair):
    """InputError comes back from generate() itself, before any stream exists."""
    import asyncio

    from dustin.errors import InputError

    eng = AsyncEngineCore(_engine(tiny_pair))
    try:
        async def go():
            with pytest.raises(InputError, match="empty"):
                await eng.generate("a", [], SamplingParams(temperature=0, max_tokens=2))
            stream = await eng.generate("b", [5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            outs = [o async for o in stream]
            assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].finished
            assert outs[-1].finish_reason == "length"
        asyncio.run(go())
        assert eng.stats()["requests_running"] == 0 and eng.stats()["error"] is None
    finally:
        eng.shutdown()
    assert eng.wait_stopped(timeout=0)  # shutdown() waited for the engine thread


# ------------------------------------------------------------------------------------------ the command
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv,needle", [
    (["--gamma", "0"], "--gamma must be >= 1"),
    (["--max-slots", "0"], "--max-slots"),
    (["--port", "70000"], "--port"),
])
def test_serve_bad_flags(capsys, tiny_pair, argv, needle):
    from dustin.cli.main import main

    code = main(["serve", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--port",
                 str(_free_port()), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("dustin: error:") and needle in err and err.count("\n") == 1, err


def test_serve_missing_checkpoint_busy_port_and_torchrun(capsys, tmp_path, tiny_pair, monkeypatch):
    from dustin.cli.main import main

    code = main(["serve", "--target", str(tmp_path / "nope"), "--port", str(_free_port())])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = main(["serve", "--target", str(tiny_pair[0]), "--port", str(busy.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 2 and "cannot listen on 127.0.0.1:" in err
    monkeypatch.setenv("WORLD_SIZE", "2")  # a half-set torchrun environment: one line, before anything loads
    code = main(["serve", "--target", str(tiny_pair[0]), "--port", str(_free_port())])
    err = capsys.readouterr().err
    assert code == 2 and "MASTER_ADDR" in err and err.count("\n") == 1


def test_serve_command_end_to_end(tiny_pair):
    """`python -m dustin serve` prints its address, serves, and exits 0 on SIGINT."""
    import signal

    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dustin", "serve", "--target", str(tiny_pair[0]), "--draft",
                             str(tiny_pair[1]), "--method", "classic", "--max-context", "256", "--port", str(port),
                             "--served-model-name", "tiny-e2e"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"dustin serve: http://127.0.0.1:{port} (model tiny-e2e, method classic"), \
            line + proc.stderr.read()
        assert line.rstrip("\n").endswith("slots); lossless: the target's own output"), line
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-e2e", "prompt": [4, 5, 6], "max_tokens": 5,
                                                      "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, proc.stderr.read()


# ------------------------------------------------------------------------------------------ the real pair


@pytest.mark.realmodels
@pytest.mark.slow
def test_real_pair_chat_and_text_completion_equal_engine_generate(real_pair):
    """The server on the shared pair (its own load cost ~20 s and a second 9.7 GB copy while the other was held)
    answers as the offline engine on the same pair does, computed first, before the engine thread starts. Both
    run the same code on the same weights, so the pair's own dtype serves (bf16 where native: each request's
    512-token padded CPU prefill and its decode ran ~2x faster than in fp32). A CPU without native bf16 serves
    the pair in fp32: one request took over a minute there, so the clients wait up to 10 minutes."""
    engine = real_pair
    question = "Write a Python function that reverses a string."
    code = "def fibonacci(n):\n"
    n = 16
    # a short prefill forward, offline as in the server: every prefill is padded to prefill_tokens (512 by default
    # on a CPU: a 512-token forward of target and draft for a 4-token prompt, ~2/3 of an offline run's time)
    short = {"prefill_chunk": 64, "prefill_tokens": 64}
    cfg, params = offline(method="classic", gamma=GAMMA, max_new_tokens=n, **short)
    want_chat = engine.generate([question], cfg, params, chat=True).sequences[0]
    want_text = engine.generate([code], cfg, params).sequences[0]
    # and a short slot: the request without max_tokens runs to the slot's end at worst
    llm = EngineCore(engine.pair, GenerationConfig(method="classic", gamma=GAMMA, max_slots=2, max_context=192,
                                                   **short))
    srv = LiveServer(llm, name="qwen", timeout=600)
    try:
        chat = srv.client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": question}],
                                                  max_tokens=n, temperature=0)
        assert chat.choices[0].message.content == want_chat.text
        assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
        assert chat.usage.completion_tokens == len(want_chat.token_ids)
        text = srv.client.completions.create(model="qwen", prompt=code, max_tokens=n, temperature=0)
        assert text.choices[0].text == want_text.text
        streamed = srv.client.chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": question}], max_tokens=n, temperature=0,
            stream=True)
        chunks = list(streamed)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat.text
        # no max_tokens on chat: the rest of the context (here the model stops at EOS or the slot's end)
        r = srv.http.post("/v1/chat/completions", json={"model": "qwen", "temperature": 0, "messages": [
            {"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "Hi?"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        srv.close()


def test_incremental_detokenizer_equals_a_whole_decode_with_the_real_tokenizer(tok):
    """The detokenizer decodes a short tail and settles the rest only where decoding splits exactly: fed token by
    token or in uneven groups, text with multi-byte characters (split over several byte-level tokens) and code
    comes out exactly as one decode of all ids, and no emitted piece is ever taken back."""
    text = ("def naïve_sum(xs):\n    # Σ over xs — 合計 🙂🙂\n    return sum(x for x in xs)\n" * 6) + "ünïcödé ✓ 終わり"
    ids = tok.encode(text, add_special_tokens=False)
    for group in (1, 3, 7):
        detok = IncrementalDetokenizer(tok)
        out = "".join(detok.add(ids[i:i + group]) for i in range(0, len(ids), group)) + detok.finish()
        assert out == tok.decode(ids, skip_special_tokens=True) == text
        assert detok.settled_tokens > len(ids) // 2  # the decoded tail stayed short
