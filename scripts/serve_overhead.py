"""What the HTTP path of `dustin serve` costs per token, without a model: a stand-in engine whose step waits a fixed
time (releasing the GIL, as a GPU step does while the host waits for it) and then gives every running request the
same number of tokens, served through the real app (`dustin/serve/app.py`, uvicorn, the engine thread), against
the stand-in's own speed (steps x tokens / wall).

    PYTHONPATH=. python3 scripts/serve_overhead.py --tokenizer FOLDER [--step-ms 2.7] [--tokens-per-step 1]
        [--requests 16] [--max-tokens 512] [--client thread|process] [--profile out.prof] [--json-out out.json]

The decode-heavy case of docs/serving.md: 16 requests of 512 tokens; vanilla gives 1 token per request and step,
a speculative method about tau. `--client process` sends the requests from another process (as a real client
does); `thread` from this process (as `dustin bench serve` does). `--profile` writes cProfile stats of the event
loop's thread and the engine thread (pstats files, `<out>.loop` and `<out>.engine`). CPU only; no GPU needed.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time


class StandInEngine:
    """The methods `AsyncEngineCore` calls, with a step of fixed length and fixed tokens per request."""

    def __init__(self, tokenizer, step_s: float, tokens_per_step: int, slots: int, vocab: int) -> None:
        from types import SimpleNamespace

        self.tokenizer, self.model_name, self.max_context = tokenizer, "stand-in", 1 << 20
        self.pair = SimpleNamespace(vocab_limit=vocab)
        self.executor = SimpleNamespace(heartbeat=lambda: None, stop_followers=lambda: True)
        self.step_s, self.tps, self.slots, self.vocab = step_s, tokens_per_step, slots, vocab
        self.waiting, self.running, self.steps, self.generated = [], {}, 0, 0
        self.rng = random.Random(0)

    def bind_thread(self) -> None:
        pass

    def check_request(self, prompt_ids, params, n: int = 1) -> None:
        pass

    def add_request(self, request) -> None:
        self.waiting.append(request)

    def add_requests(self, requests) -> None:
        self.waiting.extend(requests)

    def abort_request(self, request_id: str) -> None:
        self.running.pop(request_id, None)
        self.waiting = [r for r in self.waiting if r.request_id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self):
        from dustin.engine.request import RequestOutput

        while self.waiting and len(self.running) < self.slots:
            r = self.waiting.pop(0)
            self.running[r.request_id] = [r, 0]
        time.sleep(self.step_s)
        self.steps += 1
        out = []
        for rid, entry in list(self.running.items()):
            r, done = entry
            n = min(self.tps, r.params.max_tokens - done)
            entry[1] += n
            finished = entry[1] >= r.params.max_tokens
            out.append(RequestOutput(rid, [self.rng.randrange(3, self.vocab) for _ in range(n)], finished,
                                     "length" if finished else None, len(r.prompt_ids), entry[1]))
            self.generated += n
            if finished:
                del self.running[rid]
        return out

    def stats(self) -> dict:
        return {"requests_waiting": len(self.waiting), "requests_running": len(self.running), "steps_total": self.steps,
                "generated_tokens_total": self.generated, "tau": float(self.tps)}


async def _client(url: str, requests: int, max_tokens: int) -> tuple[int, float]:
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx

    async def one(client, i):
        body = {"model": "stand-in", "prompt": [5 + i % 50] * 8, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "return_token_ids": True}
        n = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    n += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
        return n

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=requests + 4)) as client:
        counts = await asyncio.gather(*(one(client, i) for i in range(requests)))
    return sum(counts), time.perf_counter() - t0


def _cpu_s(tid: int) -> float:
    """CPU seconds (user + system) a thread of this process has used (Linux)."""
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_process(url: str, requests: int, max_tokens: int, q) -> None:
    q.put(asyncio.run(_client(url, requests, max_tokens)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a model folder with a tokenizer (the stand-in's text)")
    ap.add_argument("--step-ms", type=float, default=2.7)
    ap.add_argument("--tokens-per-step", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--client", choices=["thread", "process"], default="process")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for this process (seconds; default: Python's)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from dustin.serve.local import LocalServer

    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    eng = StandInEngine(tok, a.step_ms / 1e3, a.tokens_per_step, a.requests, len(tok))
    profiles = {}
    if a.profile:  # profile the engine thread and uvicorn's thread from their start
        orig_run = threading.Thread.run

        def run(self):
            if self.name == "dustin-engine" or getattr(self, "_profile_as", None):
                prof = profiles.setdefault(getattr(self, "_profile_as", "engine"), cProfile.Profile())
                prof.runcall(orig_run, self)
            else:
                orig_run(self)
        threading.Thread.run = run
        orig_init = threading.Thread.__init__

        def init(self, *args, **kw):
            orig_init(self, *args, **kw)
            if kw.get("target") is not None and getattr(kw["target"], "__name__", "") == "run" and \
                    "Server" in type(getattr(kw["target"], "__self__", None)).__name__:
                self._profile_as = "loop"
        threading.Thread.__init__ = init
    runs = []
    with LocalServer(eng, "stand-in") as srv:
        threads = {"loop": srv.thread.native_id, "engine": srv.async_engine._thread.native_id}
        for _ in range(a.repeats):
            steps0 = eng.steps
            cpu0 = {k: _cpu_s(t) for k, t in threads.items()}
            if a.client == "process":
                q = mp.get_context("spawn").Queue()
                p = mp.get_context("spawn").Process(target=_client_process,
                                                   args=(srv.url, a.requests, a.max_tokens, q))
                p.start()
                tokens, wall = q.get()
                p.join()
            else:
                tokens, wall = asyncio.run(_client(srv.url, a.requests, a.max_tokens))
            steps = eng.steps - steps0
            cpu = {k: _cpu_s(t) - cpu0[k] for k, t in threads.items()}
            ideal = steps * a.step_ms / 1e3
            runs.append({"tokens": tokens, "wall_s": round(wall, 3), "steps": steps,
                         "stand_in_s": round(ideal, 3), "server_tokens_per_s": round(tokens / wall),
                         "stand_in_tokens_per_s": round(tokens / ideal), "ratio": round(ideal / wall, 3),
                         "loop_cpu_us_per_token": round(1e6 * cpu["loop"] / tokens, 1),
                         "engine_cpu_us_per_step": round(1e6 * cpu["engine"] / steps, 1)})
            print(json.dumps(runs[-1]), flush=True)
    if a.profile:
        for name, prof in profiles.items():
            prof.dump_stats(f"{a.profile}.{name}")
    out = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "settings": vars(a), "runs": runs}
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
