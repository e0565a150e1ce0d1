"""A mixed load against a live `dustin serve` (tiny pair, CPU, fp32): 64 concurrent clients, streamed and not,
some that disconnect mid-stream and some with bad requests. Every good request gets exactly its tokens (those of
`Engine.generate`), every bad one a 4xx with OpenAI's error body, the disconnected ones free their slots, and the
server stays healthy with its counters adding up."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.engine import Engine
from dustin.serve.local import LocalServer
from tests.conftest import without_interpreter
from tests.offline import offline

MODEL = "tiny"


@pytest.fixture(scope="module")
def setup(tiny_pair):
    """The server and the reference engine run dustin's selection and score estimation with the CPU's PyTorch
    code (TRITON_INTERPRET unset, as on a user's CPU): this test is about the load (many clients, disconnects, bad
    requests), and the interpreted selection kernel (one program per sequence) made the 48-prompt reference alone
    take most of its time (test_serve and test_engine_core serve with the interpreted kernels)."""
    with pytest.MonkeyPatch.context() as mp:
        without_interpreter(mp)
        yield from _setup(tiny_pair)


def _setup(tiny_pair):
    target, draft = tiny_pair
    cfg = GenerationConfig(method="dustin", gamma=3, budget=24, draft_window=32, max_slots=4, max_context=512,
                           max_waiting=64, prefill_chunk=32, prefill_tokens=96)
    llm = EngineCore.from_pretrained(str(target), str(draft), device="cpu", dtype="fp32", config=cfg)
    ref = Engine.from_pretrained(str(target), str(draft), device="cpu", dtype="fp32")
    with LocalServer(llm, MODEL) as srv:
        yield srv, ref


BAD = [  # (raw body or JSON, expected status)
    ("{not json", 400), ({"model": MODEL, "prompt": [], "max_tokens": 4}, 400),
    ({"model": MODEL, "prompt": [5, 6], "max_tokens": 0}, 400),
    ({"model": MODEL, "prompt": [5, 6], "max_tokens": 4, "top_p": 2}, 400),
    ({"model": "other", "prompt": [5, 6], "max_tokens": 4}, 404),
    ({"model": MODEL, "prompt": [5, 10 ** 9], "max_tokens": 4}, 400),
    ({"model": MODEL, "prompt": [5] * 600, "max_tokens": 4}, 400),
    ({"model": MODEL, "prompt": [5, 6], "max_tokens": "4"}, 400),
]


async def _good(client, prompt, n, stream):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["token_ids"], choice["finish_reason"]
    ids, finish = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                ids += c.get("token_ids") or []
                finish = c.get("finish_reason") or finish
    return ids, finish


async def _leaver(client, prompt):
    """A streaming client that reads one chunk and goes away."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    return "left"


async def _bad(client, body, status):
    if isinstance(body, str):
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post("/v1/completions", json=body)
    assert r.status_code == status, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return status


def test_64_clients_mixed_load(setup):
    srv, ref = setup
    rng = random.Random(0)
    good = [([rng.randrange(3, 90) for _ in range(rng.randrange(5, 70))], rng.randrange(3, 12)) for _ in range(48)]
    leavers = [[rng.randrange(3, 90) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    assert len(good) + len(leavers) + len(BAD) == 64

    async def run():
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as client:
            jobs = [_good(client, p, n, stream=i % 4 != 0) for i, (p, n) in enumerate(good)]
            jobs += [_leaver(client, p) for p in leavers] + [_bad(client, b, s) for b, s in BAD]
            order = list(range(len(jobs)))
            rng.shuffle(order)  # arrivals interleaved
            results = await asyncio.gather(*(jobs[i] for i in order))
            out = [None] * len(jobs)
            for i, r in zip(order, results, strict=True):
                out[i] = r
            return out

    results = asyncio.run(run())
    cfg, params = offline(method="dustin", gamma=3, budget=24, draft_window=32, max_new_tokens=12,
                           stop_at_eos=False)
    want = ref.generate([p for p, _ in good], cfg, params, limits=[n for _, n in good]).sequences
    for (ids, finish), w, (_, n) in zip(results[:48], want, good, strict=True):
        assert finish == "length" and len(ids) == n and ids == w.token_ids
    assert results[48:56] == ["left"] * 8
    assert results[56:] == [s for _, s in BAD]
    # the server is healthy, the disconnected requests were aborted and their slots freed
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        deadline = time.time() + 10  # a disconnect is noticed between chunks or within 0.5 s
        while True:
            text = c.get("/metrics").text
            metrics = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                       if line and not line.startswith("#")}
            if metrics["dustin_requests_running"] == 0 or time.time() > deadline:
                break
            time.sleep(0.1)
    assert metrics['dustin_requests_total{status="success"}'] >= 48
    assert metrics["dustin_requests_running"] == 0 and metrics["dustin_requests_waiting"] == 0
    assert metrics['dustin_requests_total{status="aborted"}'] >= 8
