"""The engine core (engine/core.py): continuous batching over KV slots must give every request
exactly the tokens an offline `Engine.generate` of that prompt alone gives (fp32, CPU), whatever else runs
beside it, however its prompt is chunked, and however often its slot was used before."""
from __future__ import annotations

import pickle
import random

import pytest
import torch

from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.engine import Engine
from dustin.engine.request import Request, SamplingParams
from dustin.engine.scheduler import QueueFullError
from dustin.errors import InputError
from tests.offline import offline

SPARSE = dict(budget=24, draft_window=32)
# the engine selects with the CPU's PyTorch code (tests/conftest.py), but for one served sparse method below
pytestmark = pytest.mark.usefixtures("cpu_paths")


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return Engine.from_pretrained(str(target), str(draft))


def _prompts(n: int, seed: int = 0, low: int = 5, high: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 90) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def _offline(engine, prompts, method, max_new, **kw):
    cfg, params = offline(method=method, max_new_tokens=max_new, stop_at_eos=False, **kw)
    return [engine.generate([p], cfg, params).sequences[0].token_ids for p in prompts]


@pytest.mark.parametrize("method", ["vanilla", "classic", "magicdec", "dustin", "dustin-t", "streaming"])
def test_continuous_batching_equals_offline_generation(engine, method, monkeypatch):
    """10 requests of 5-120 tokens through 3 slots, prompts prefilled in chunks of 40 between decode steps:
    each request's greedy tokens equal its own offline generation, token for token. Served dustin selects with its
    Triton kernels (the CPU interpreter), as on a GPU, and its offline reference with the CPU's PyTorch code."""
    kw = SPARSE if method in ("dustin", "dustin-t", "streaming") else {"draft_window": 32}
    prompts = _prompts(10)
    ref = _offline(engine, prompts, method, 12, **kw)
    if method == "dustin":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = EngineCore(engine.pair, GenerationConfig(method=method, max_slots=3, max_context=256, prefill_chunk=40, **kw))
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out == ref
    st = llm.stats()
    assert st["requests_running"] == 0 and st["requests_finished"] == 10 and st["generated_tokens_total"] == 120
    assert st["prompt_tokens_total"] == sum(map(len, prompts))


@pytest.mark.parametrize("method", ["quest", "snapkv", "oracle", "oracle-kv-d1"])
def test_whole_batch_policies_are_served_in_gangs(engine, method):
    """Policies whose state spans the batch are served: the waiting requests are admitted as one gang once every
    slot is free, and a request that arrives while a gang runs waits for all of it to finish. 5 requests through 3
    slots: the first 3 form a gang, a 4th arriving mid-way waits, then it and the 5th form the next; each request's
    greedy tokens equal offline generation of its gang's prompts."""
    kw = dict(budget=40, draft_window=32)
    prompts = _prompts(5, seed=8, low=50, high=120)
    cfg, params = offline(method=method, max_new_tokens=10, stop_at_eos=False, **kw)
    ref = [s.token_ids for s in engine.generate(prompts[:3], cfg, params).sequences]
    ref += [s.token_ids for s in engine.generate(prompts[3:], cfg, params).sequences]
    llm = EngineCore(engine.pair, GenerationConfig(method=method, max_slots=3, max_context=256, **kw))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i in range(3):
        llm.add_request(Request(str(i), prompts[i], params))
    got: dict[str, list[int]] = {}
    steps = 0
    while llm.has_unfinished():
        for o in llm.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        if steps == 1:
            for i in (3, 4):
                llm.add_request(Request(str(i), prompts[i], params))
        if steps == 2:  # the first gang runs: the later requests wait, no slot is taken by them
            st = llm.stats()
            assert st["requests_waiting"] == 2 and st["kv_slots_used"] == 3
    assert [got[str(i)] for i in range(5)] == ref
    assert llm.stats()["requests_finished"] == 5
    with pytest.raises(InputError, match="prompt log-probabilities"):  # a gang's prefill computes none
        llm.add_request(Request("echo", prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=0)))


def test_requests_join_and_leave_a_running_batch(engine):
    """Requests added while others decode, with different max_tokens: outputs arrive incrementally, each
    request finishes with exactly its own tokens, and freed slots are reused."""
    prompts = _prompts(6, seed=1)
    limits = [3, 17, 9, 25, 1, 12]
    ref = [_offline(engine, [p], "classic", m)[0] for p, m in zip(prompts, limits, strict=False)]
    llm = EngineCore(engine.pair, GenerationConfig(method="classic", max_slots=2, max_context=200, prefill_chunk=64))
    got: dict[str, list[int]] = {}
    finished = {}
    for i in range(2):
        llm.add_request(Request(f"r{i}", prompts[i],
                                SamplingParams(temperature=0, max_tokens=limits[i], ignore_eos=True)))
    steps = 0
    while llm.has_unfinished() or len(got) < 6:
        if steps == 2:  # late arrivals join at step boundaries
            for i in range(2, 6):
                llm.add_request(Request(f"r{i}", prompts[i],
                                        SamplingParams(temperature=0, max_tokens=limits[i], ignore_eos=True)))
        for o in llm.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o.finish_reason
                assert o.completion_tokens == limits[int(o.request_id[1:])]
        steps += 1
        assert llm.stats()["kv_slots_used"] <= 2
    assert [got[f"r{i}"] for i in range(6)] == ref
    assert set(finished.values()) == {"length"}


def test_abort_frees_the_slot(engine):
    prompts = _prompts(3, seed=2)
    llm = EngineCore(engine.pair, GenerationConfig(method="magicdec", max_slots=1, max_context=200, draft_window=32))
    for i, p in enumerate(prompts):
        llm.add_request(Request(f"a{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    llm.step()
    assert llm.stats()["requests_running"] == 1 and llm.stats()["requests_waiting"] == 2
    llm.abort_request("a0")  # running
    llm.abort_request("a2")  # waiting
    outs = llm.step()
    aborted = {o.request_id for o in outs if o.finish_reason == "abort"}
    assert aborted == {"a0", "a2"}
    tokens = [t for o in outs if o.request_id == "a1" for t in o.new_token_ids]  # a1 took the freed slot
    while llm.has_unfinished():
        tokens += [t for o in llm.step() if o.request_id == "a1" for t in o.new_token_ids]
    assert tokens == _offline(engine, [prompts[1]], "magicdec", 50, draft_window=32)[0]


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    """A sampled request with its own seed gets the same tokens alone and beside other (greedy and sampled)
    requests; greedy neighbours still match their offline output."""
    prompts = _prompts(4, seed=3)
    params = SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    alone = EngineCore(engine.pair, GenerationConfig(method="classic", max_slots=4, max_context=200))
    solo = alone.generate([prompts[0]], params)[0]
    mixed = EngineCore(engine.pair, GenerationConfig(method="classic", max_slots=4, max_context=200))
    others = [SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
              SamplingParams(max_tokens=15, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)]
    out = mixed.generate(prompts, [params] + others)
    assert out[0] == solo
    assert out[1] == _offline(engine, [prompts[1]], "classic", 15)[0]
    assert out[3] == _offline(engine, [prompts[3]], "classic", 15)[0]
    assert len(set(map(tuple, out))) == 4


def test_bad_requests_and_a_full_queue(engine):
    llm = EngineCore(engine.pair, GenerationConfig(method="vanilla", max_slots=1, max_context=64, max_waiting=2))
    with pytest.raises(InputError, match="empty"):
        llm.add_request(Request("e", [], SamplingParams(temperature=0)))
    with pytest.raises(InputError, match="outside the vocabulary"):
        llm.add_request(Request("v", [10**6], SamplingParams(temperature=0)))
    with pytest.raises(InputError, match="the prompt has 60 tokens"):
        llm.add_request(Request("long", [5] * 60, SamplingParams(temperature=0, max_tokens=10)))
    with pytest.raises(InputError, match="max_tokens 100 exceeds"):
        llm.add_request(Request("m", [5, 6], SamplingParams(temperature=0, max_tokens=100)))
    with pytest.raises(InputError, match="max_tokens must be"):
        SamplingParams(temperature=0, max_tokens=0)
    llm.add_request(Request("q0", [5, 6], SamplingParams(temperature=0, max_tokens=4)))
    llm.add_request(Request("q1", [5, 6], SamplingParams(temperature=0, max_tokens=4)))
    with pytest.raises(InputError, match="already in use"):
        llm.add_request(Request("q1", [5, 6], SamplingParams(temperature=0, max_tokens=4)))
    with pytest.raises(QueueFullError):
        llm.add_request(Request("q2", [5, 6], SamplingParams(temperature=0, max_tokens=4)))
    while llm.has_unfinished():
        llm.step()
    assert llm.stats()["requests_finished"] == 2


@pytest.mark.parametrize("kw, match", [
    ({"method": "nope"}, "unknown method"),
    ({"max_slots": 0}, "--max-slots"), ({"prefill_chunk": 0}, "--prefill-chunk")])
def test_config_errors(kw, match):
    with pytest.raises(InputError, match=match):
        GenerationConfig(**kw)


def test_a_max_context_past_the_models_is_refused(engine):
    """An explicit --max-context the models cannot hold is an error naming both numbers (it was clamped silently)."""
    context = engine.pair.max_context(True)
    with pytest.raises(InputError, match=f"--max-context {context + 1} exceeds the models' context \\({context} "):
        EngineCore(engine.pair, GenerationConfig(method="classic", max_slots=1, max_context=context + 1))


def test_slot_memory_error_names_the_flags(engine):
    from dustin.errors import OutOfMemoryError

    huge = GenerationConfig(method="vanilla", max_slots=10**6, max_context=256)
    with pytest.raises(OutOfMemoryError, match="--max-slots"):
        EngineCore(engine.pair, huge)
    torch.zeros(1)  # the failed allocation left nothing behind that breaks the next one


def _lockstep_step(leader: EngineCore, follower: EngineCore):
    """One `leader.step()` whose plan `follower` executes too, after a pickle round trip (what the broadcast to a
    tensor-parallel follower does)."""
    plan = leader.schedule()
    lead = leader.executor.execute(plan)
    follow = follower.executor.execute(pickle.loads(pickle.dumps(plan)))
    assert follow == lead  # the same tokens read back in every row, sampled ones included
    leader.update(lead)
    return leader.collect()


def test_a_follower_executing_the_plans_keeps_the_leaders_session(engine):
    """The follower property of tensor-parallel serving, without processes: a second engine that only executes
    the first one's step plans (never scheduling or collecting) holds the same session after every step: the same
    tokens per row (greedy, seeded and unseeded sampling), lengths and finished rows, through chunked prefill,
    requests that join late, an abort mid-prefill and one mid-decode, a one-token request and slot reuse."""
    cfg = GenerationConfig(method="dustin", max_slots=3, max_context=256, prefill_chunk=40, prefill_tokens=40, **SPARSE)
    leader, follower = EngineCore(engine.pair, cfg), EngineCore(engine.pair, cfg)
    prompts = _prompts(8, seed=5, low=20, high=110)
    params = [SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(max_tokens=15, temperature=1.0, top_k=30, ignore_eos=True),  # the engine's generator
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),  # aborted mid-decode
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),  # aborted while prefilling
              SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(max_tokens=9, temperature=0.7, seed=11, ignore_eos=True)]
    got: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    added, steps = 0, 0
    while added < len(prompts) or leader.has_unfinished():
        while added < len(prompts) and added <= 2 * steps + 3:  # a few at once, then more while others run
            leader.add_request(Request(str(added), prompts[added], params[added]))
            added += 1
        if steps == 6:
            leader.abort_request("4")
        seq = leader.sequence("5")
        if seq is not None and seq.row is not None and seq.prefilling:
            leader.abort_request("5")
        for o in _lockstep_step(leader, follower):
            got.setdefault(int(o.request_id), []).extend(o.new_token_ids)
            if o.finished:
                reasons[int(o.request_id)] = o.finish_reason
        a, b = leader.runner.batch, follower.runner.batch
        assert b.finished == a.finished and b.host_lengths == a.host_lengths
        assert torch.equal(b.target_cache.lengths, a.target_cache.lengths) and torch.equal(b.pending, a.pending)
        steps += 1
    assert reasons[4] == reasons[5] == "abort" and len(reasons) == len(prompts)
    assert len(got[2]) == 1 and reasons[2] in ("stop", "length")
    assert len(got[1]) == 12 and len(got[3]) == 15 and len(got[7]) == 9
    assert got[0] == _offline(engine, [prompts[0]], "dustin", 18, **SPARSE)[0]
    for key in ("prompt_tokens_total", "steps_total"):
        assert follower.stats()[key] == leader.stats()[key]


def test_decode_time_excludes_only_graph_captures_after_the_prefill(engine, monkeypatch):
    """A one-shot batch's step graph can be captured while its last prompts still prefill: that capture is inside
    prefill_s already, and decode_s must not subtract it again (a GPU run reported decode_s 0 and 7.6e11 tokens/s).
    Here a 5 s capture is booked during the first engine step, before the prefill ends."""
    from dustin.engine.worker.runner import Runner

    booked = {"s": 0.0}
    monkeypatch.setattr(Runner, "capture_total", lambda self: booked["s"])
    step = EngineCore.step

    def step_with_a_capture(self):
        booked["s"] = 5.0
        return step(self)

    monkeypatch.setattr(EngineCore, "step", step_with_a_capture)
    res = engine.generate(_prompts(3, seed=4, low=5, high=30),
                          *offline(method="classic", max_new_tokens=16, stop_at_eos=False, draft_window=32))
    assert res.capture_s == 5.0  # booked to the call, apart from both timings
    assert res.decode_s > 0 and res.tokens_per_s < 1e7  # before the fix: decode_s 0, tokens/s ~1e10
