"""Tensor-parallel serving on the CPU (gloo, 2 ranks, the tiny pair, fp32): `torchrun -m dustin serve` with rank 0
serving HTTP and rank 1 following its step plans; and the follower protocol itself (heartbeats, the stop plan when
rank 0's engine thread dies) in two spawned ranks.

Greedy outputs must equal `Engine.generate` (what `dustin generate` runs) of each prompt alone, token for token."""
from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import httpx
except ImportError:  # as in tests/api/test_serve.py
    import httpx2 as httpx

import openai

from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.engine import Engine
from dustin.engine.request import SamplingParams
from tests.offline import offline

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-tp"
SERVE = {"method": "dustin", "budget": 24, "draft_window": 32, "max_context": 256, "max_slots": 4, "prefill_chunk": 32}
PROMPT_LENGTHS = [40, 75, 23, 60]  # most longer than the budget: sparse verification drops positions
LIMITS = [10, 6, 8, 12]
START_TIMEOUT_S = 60
EXIT_TIMEOUT_S = 30
WORKER_TIMEOUT_S = 120

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed (torchrun) is not available"),
              # TRITON_INTERPRET unset (tests/conftest.py): the ranks, which inherit it, and the reference select
              # with the CPU's PyTorch code, as on a user's CPU (the interpreted selection kernel was most of their
              # time; test_engine_core serves on it)
              pytest.mark.usefixtures("cpu_paths")]


def _prompts():
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_pair, cpu_paths):
    """Engine.generate of each prompt alone, on the selection path of the ranks (cpu_paths: TRITON_INTERPRET unset
    for them and here)."""
    engine = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", dtype="fp32")
    out = []
    for p, n in zip(_prompts(), LIMITS, strict=False):
        cfg, params = offline(method="dustin", budget=24, draft_window=32, max_new_tokens=n)
        out.append(engine.generate([p], cfg, params).sequences[0])
    return out


# ------------------------------------------------------------------------------------------ torchrun -m dustin serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of the processes torchrun (pid `launcher`) started."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
                out[int(env["RANK"])] = int(d.name)
        except (OSError, KeyError, ValueError):  # exited meanwhile, or not a rank
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


class TorchrunServer:
    """`torchrun --standalone --nproc-per-node 2 -m dustin serve ...` on a free port, ready once /health is 200."""

    def __init__(self, tiny_pair) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in SERVE.items()]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dustin",
             "serve", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--device", "cpu", "--dtype",
             "fp32", "--port", str(self.port), "--served-model-name", MODEL, *flags],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                raise AssertionError(f"the server did not start:\n{self.proc.stderr.read()}")
            time.sleep(0.2)
        self.ranks = _ranks(self.proc.pid)
        assert sorted(self.ranks) == [0, 1], self.ranks
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def wait(self) -> tuple[int, str, str]:
        """Wait for torchrun and every rank to end; (torchrun's exit code, stdout, stderr)."""
        try:
            out, err = self.proc.communicate(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"torchrun did not exit within {EXIT_TIMEOUT_S} s") from None
        deadline = time.time() + 5
        while any(map(_alive, self.ranks.values())) and time.time() < deadline:
            time.sleep(0.1)
        left = [r for r, pid in self.ranks.items() if _alive(pid)]
        assert not left, f"ranks {left} still running after torchrun exited"
        return self.proc.returncode, out, err

    def kill(self) -> None:
        for pid in [*getattr(self, "ranks", {}).values(), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tiny_pair, cpu_paths):
    srv = TorchrunServer(tiny_pair)
    yield srv
    if srv.proc.poll() is None:
        srv.kill()


def test_tp_server_serves_exactly_the_single_process_output(server, reference):
    prompts = _prompts()

    def one(i):
        r = server.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=LIMITS[i], temperature=0,
                                             extra_body={"return_token_ids": True})
        return r.choices[0]

    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: they share the batch
        choices = list(pool.map(one, range(len(prompts))))
    for choice, want in zip(choices, reference, strict=False):
        assert choice.token_ids == want.token_ids
        assert choice.text == want.text and choice.text
    stream = server.client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=LIMITS[1], temperature=0,
                                              stream=True)
    chunks = [c.choices[0].text for c in stream]
    assert len(chunks) > 1 and "".join(chunks) == reference[1].text
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": [1, 2', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=10**6)
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    again = one(2)
    assert again.token_ids == reference[2].token_ids


def test_stopping_rank_0_ends_every_rank_cleanly(server):
    """Ctrl-C of rank 0's server: it stops, sends the stop plan, and all ranks leave the process group and exit 0
    (torchrun then exits 0); only rank 0 printed."""
    os.kill(server.ranks[0], signal.SIGINT)
    code, out, err = server.wait()
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dustin serve: http://127.0.0.1:{server.port} (model {MODEL}, "
                                                   f"method dustin"), out
    assert lines[0].endswith("tensor parallel over 2 ranks); lossy: sparse verification, the output can differ "
                             "from the target's") and "Traceback" not in err, err


def test_sigterm_to_torchrun_ends_every_rank(tiny_pair):
    """torchrun passes SIGTERM to every rank: rank 0 shuts down as for Ctrl-C and stops the followers, which ignore
    the signal until then; nothing is left running."""
    srv = TorchrunServer(tiny_pair)
    try:
        r = srv.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        srv.proc.send_signal(signal.SIGTERM)
        _, _, err = srv.wait()
        # torchrun itself reports the signal (its SignalException); no rank failed
        assert "dustin: error" not in err and "FAILED" not in err and "tensor-parallel ranks" not in err, err
    finally:
        if srv.proc.poll() is None:
            srv.kill()


def test_half_set_torchrun_environment_is_one_line(capsys, tiny_pair, monkeypatch):
    from dustin.cli.main import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    code = main(["serve", "--target", str(tiny_pair[0]), "--port", str(_free_port())])
    err = capsys.readouterr().err
    assert code == 2 and "RANK, MASTER_ADDR, MASTER_PORT are not set" in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------------ the follower protocol
class _CountingEngine:
    """The rank-0 EngineCore as the async engine sees it: counts step() calls; `fail_loop` makes the engine loop
    itself fail (has_unfinished raises), so the engine thread dies."""

    def __init__(self, llm) -> None:
        self.llm, self.steps, self.fail_loop = llm, 0, False

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def step(self):
        self.steps += 1
        return self.llm.step()

    def has_unfinished(self):
        if self.fail_loop:
            raise RuntimeError("simulated engine loop failure")
        return self.llm.has_unfinished()


def _lead(llm: EngineCore) -> dict:
    """Rank 0: requests through the async engine (greedy, seeded and unseeded sampling), an idle spell of
    heartbeats, then the engine thread dies; its end must have stopped the follower."""
    from dustin.serve.async_engine import AsyncEngineCore

    llm.executor.heartbeat_s = 0.0  # every idle wake-up sends one
    proxy = _CountingEngine(llm)
    eng = AsyncEngineCore(proxy, idle_poll_s=0.02)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in LIMITS]
    params[3] = SamplingParams(max_tokens=LIMITS[3], temperature=0.8, seed=5)
    params.append(SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True))  # the engine's generator

    async def go():
        async def one(i, p, rp):
            return [t async for o in await eng.generate(f"r{i}", p, rp) for t in o.new_token_ids]
        prompts = _prompts() + [[7, 8, 9, 10]]
        tokens = await asyncio.gather(*(one(i, p, rp) for i, (p, rp) in enumerate(zip(prompts, params, strict=False))))
        await asyncio.sleep(0.5)  # idle: heartbeats
        return tokens

    tokens = asyncio.run(go())
    steps = proxy.steps
    proxy.fail_loop = True
    assert eng.wait_stopped(30) and "simulated engine loop failure" in eng.error
    assert llm.executor.stop_followers()  # the dying thread sent the stop plan already (idempotent)
    return {"tokens": tokens, "steps": steps}


def _worker(rank: int, world: int, port: int, target: str, draft: str, out_dir: str) -> None:
    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True)  # a hung collective fails the test, not the suite
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from dustin.parallel.tp import finish_distributed, init_distributed

    assert init_distributed("gloo") == (rank, world)
    try:
        llm = EngineCore.from_pretrained(target, draft, device="cpu", dtype="fp32", config=GenerationConfig(**SERVE))
        read_back, complete = [], llm.runner.complete

        def recording(slot):  # every step's tokens as this rank read them back
            rows = complete(slot)
            read_back.append([(r.row, r.first, r.tokens) for r in rows])
            return rows

        llm.runner.complete = recording
        result = {"received": llm.executor.follow()} if rank else _lead(llm)
        result.update(read_back=read_back, counters=llm.stats())
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        finish_distributed(exit_process=True)
    finally:
        if dist.is_initialized():  # error path: leave without a barrier
            dist.destroy_process_group()


def test_follower_protocol_heartbeats_and_stop_on_engine_death(tiny_pair, reference, tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tiny_pair[0]), str(tiny_pair[1]), str(tmp_path)), nprocs=2,
             join=True)
    lead, follow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    greedy = [0, 1, 2]
    assert [lead["tokens"][i] for i in greedy] == [reference[i].token_ids for i in greedy]
    assert len(lead["tokens"][4]) == 9
    # the follower's runner went through the same states: the same tokens in every row, sampled ones included
    assert follow["read_back"] == lead["read_back"] and len(lead["read_back"]) > 10
    for key in ("prompt_tokens_total", "steps_total"):
        assert follow["counters"][key] == lead["counters"][key]
    # one plan per step, the stop plan, and heartbeats while idle
    assert follow["received"] > lead["steps"] + 1
