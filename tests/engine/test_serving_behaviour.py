"""Serving behaviour that exactness tests alone would not catch (engine/core.py, engine/worker/, serve/):
per-request sampling settings really applied (empirical distributions against the target's processed
distribution), EOS stopping and `ignore_eos` (also across slot reuse), the scheduler's prefill invariants (budget,
request-local chunk boundaries, FIFO, admission order), `dustin-d` served exactly, and aborts that free the slot
and stop generating, in the engine core and over HTTP. Tiny random pair, fp32, CPU."""
from __future__ import annotations

import json
import math
import random
import socket
import threading
import time

import pytest
import torch

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.engine import Engine
from dustin.engine.kv_manager import SlotTable
from dustin.engine.request import Request, SamplingParams, SamplingRule
from dustin.engine.sampling import probabilities
from dustin.engine.scheduler import Scheduler
from dustin.engine.scheduler import Sequence as _Sequence
from tests.offline import offline

SPARSE = dict(budget=24, draft_window=32)
pytestmark = pytest.mark.usefixtures("cpu_paths")  # selection on the CPU's PyTorch code (tests/conftest.py)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return Engine.from_pretrained(str(target), str(draft), device="cpu", dtype="fp32")


# ------------------------------------------------------------------------------------------ helpers
def _prompts(n: int, seed: int, low: int = 5, high: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 90) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def _offline(engine, prompt, method, max_new, **kw) -> list[int]:
    cfg, params = offline(method=method, max_new_tokens=max_new, stop_at_eos=False, **kw)
    return engine.generate([prompt], cfg, params).sequences[0].token_ids


def _llm(engine, eos: set[int] | None = None, **cfg) -> EngineCore:
    """An EngineCore over `engine`; with `eos`, that set is the EOS ids its engine core stops at (the core takes the
    Engine's set when it is built; the shared Engine keeps its own)."""
    saved = engine.pair.eos_ids
    if eos is not None:
        engine.pair.eos_ids = set(eos)
    try:
        llm = EngineCore(engine.pair, GenerationConfig(**cfg))
    finally:
        engine.pair.eos_ids = saved
    if eos is not None:
        assert llm.eos_ids == set(eos)
    return llm


def _drain(llm: EngineCore, requests=()) -> tuple[dict[str, list[int]], dict[str, str], dict[str, int]]:
    """Add the requests, step to the end; (tokens, finish reason, completion_tokens) per request id."""
    for r in requests:
        llm.add_request(r)
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    completion: dict[str, int] = {}
    for _ in range(5000):
        if not llm.has_unfinished():
            break
        for o in llm.step():
            assert o.request_id not in reasons, f"output for {o.request_id} after it finished"
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
                completion[o.request_id] = o.completion_tokens
    assert not llm.has_unfinished(), "requests never finished"
    return got, reasons, completion


def _target_logits(engine, prefixes: list[list[int]]) -> torch.Tensor:
    """The target's logits [B, V] after each prefix (all of one length), from a plain full forward."""
    target, V = engine.pair.target, engine.pair.vocab_limit
    x = torch.tensor(prefixes)
    B, T = x.shape
    a = target.args
    cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, T, torch.float32, "cpu")
    ctx = ForwardContext(cache, torch.arange(T)[None].expand(B, T), torch.zeros(B, dtype=torch.int32), T, fresh=True)
    with torch.no_grad():
        return target(x, ctx)[:, -1, :V].float()


def _chi2_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    """p-value that `samples` were drawn from `probs` (chi-square; bins expected < 5 merged; a sample where
    `probs` is 0 gives 0). Upper tail by the Wilson-Hilferty normal approximation."""
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    if (counts[probs == 0] > 0).any():
        return 0.0
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    dof = int(keep.sum()) - 1
    if dof < 1:
        return 1.0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


# ------------------------------------------------------------------------------------------ 1. sampling
SAMPLED = SamplingRule(temperature=3.0, top_k=8, top_p=0.7)
# what a server that drops one of the settings (or all of them) would sample from instead
WRONG = {"temperature ignored": SamplingRule(1.0, SAMPLED.top_k, SAMPLED.top_p),
         "top_k ignored": SamplingRule(SAMPLED.temperature, 0, SAMPLED.top_p),
         "top_p ignored": SamplingRule(SAMPLED.temperature, SAMPLED.top_k, 1.0),
         "greedy": SamplingRule(0.0)}


def _processed(logits: torch.Tensor, p: SamplingRule) -> torch.Tensor:
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return probabilities(logits, p)


def _marginals(engine, prompt: list[int], p: SamplingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of the 1st and 2nd sampled tokens after `prompt` under `p`:
    p1 = processed(target(prompt)), p2 = sum_t p1(t) processed(target(prompt + [t]))."""
    p1 = _processed(_target_logits(engine, [prompt])[0], p)
    cand = torch.nonzero(p1).flatten().tolist()
    p2_given = _processed(_target_logits(engine, [prompt + [t] for t in cand]), p)
    return p1, (p1[cand, None] * p2_given).sum(0)


def _sampling_prompt(engine) -> list[int]:
    """Of a few random prompts, the one whose first-token distribution under SAMPLED is farthest (in total
    variation) from every WRONG one, so that the test below can tell them apart with few samples."""
    def margin(prompt):
        logits = _target_logits(engine, [prompt])[0]
        ref = _processed(logits, SAMPLED)
        return min(_tv(ref, _processed(logits, w)) for w in WRONG.values())

    best = max(_prompts(12, seed=1, low=5, high=20), key=margin)
    assert margin(best) >= 0.1, "no candidate prompt separates the sampling settings: pick other candidates"
    return best


def test_sampled_request_follows_its_processed_distribution_beside_greedy_requests(engine):
    """Guards per-request temperature / top_k / top_p in serving: 800 seeded requests of one prompt with
    temperature 3, top_k 8, top_p 0.7, served 6 slots at a time with greedy requests interleaved (so every row
    samples under RowSampling's per-row path, in the first token chosen by the prefill and in the speculative
    accept/residual of the 2nd token). The empirical distributions of the 1st and 2nd generated tokens must pass a
    chi-square test against the target's processed distributions (computed with `sampling.probabilities` from a
    plain forward of the target), and the same samples must reject the distributions a server would produce if it
    ignored temperature, top_k or top_p, or sampled greedily. The greedy neighbours' tokens must equal their
    all-greedy output. Deterministic: every sampled request has its own seed."""
    prompt = _sampling_prompt(engine)
    greedy_prompts = _prompts(3, seed=2, low=10, high=60)
    want_greedy = [_offline(engine, p, "classic", 10) for p in greedy_prompts]
    N = 800
    llm = _llm(engine, method="classic", max_slots=6, max_context=128)
    reqs, kinds = [], {}
    for i in range(N):
        if i % 4 == 0:  # a greedy neighbour every few sampled requests, each living several steps
            g = (i // 4) % 3
            rid = f"g{i}"
            reqs.append(Request(rid, greedy_prompts[g], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
            kinds[rid] = g
        reqs.append(Request(f"s{i}", prompt, SamplingParams(max_tokens=2, temperature=SAMPLED.temperature,
                                                           top_k=SAMPLED.top_k, top_p=SAMPLED.top_p, seed=1000 + i,
                                                           ignore_eos=True)))
    got: dict[str, list[int]] = {}
    pending = list(reqs)
    for _ in range(20000):
        if not (pending or llm.has_unfinished()):
            break
        while pending and len(llm.scheduler.waiting) < 4:
            llm.add_request(pending.pop(0))
        for o in llm.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not pending and not llm.has_unfinished(), "requests never finished"
    for rid, g in kinds.items():
        assert got[rid] == want_greedy[g], f"greedy request {rid} changed beside sampled requests"
    samples = [got[f"s{i}"] for i in range(N)]
    assert all(len(s) == 2 for s in samples)
    p1, p2 = _marginals(engine, prompt, SAMPLED)
    first, second = [s[0] for s in samples], [s[1] for s in samples]
    assert _chi2_pvalue(first, p1) > 1e-3
    assert _chi2_pvalue(second, p2) > 1e-3
    for name, wrong in WRONG.items():  # the test has the power to see each setting dropped
        w1, w2 = _marginals(engine, prompt, wrong)
        assert _chi2_pvalue(first, w1) < 1e-6, f"1st token: cannot tell the right distribution from {name}"
        if _tv(p2, w2) >= 0.1:
            assert _chi2_pvalue(second, w2) < 1e-6, f"2nd token: cannot tell the right distribution from {name}"


def test_top_k_1_or_tiny_top_p_with_temperature_is_greedy(engine):
    """Guards that top_k / top_p are applied per request in the speculative step too: requests with temperature
    1.5 but top_k=1 (or top_p=0.001, which keeps only the most likely token), each seeded, beside unseeded sampled
    requests at temperature 1, must give exactly their greedy output (16 tokens, several draft/verify steps)."""
    prompts = _prompts(3, seed=3, low=10, high=80)
    want = [_offline(engine, p, "classic", 16) for p in prompts]
    llm = _llm(engine, method="classic", max_slots=4, max_context=128)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(Request(f"k{i}", p, SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=i,
                                                      ignore_eos=True)))
        reqs.append(Request(f"p{i}", p, SamplingParams(max_tokens=16, temperature=1.5, top_p=0.001, seed=50 + i,
                                                      ignore_eos=True)))
        reqs.append(Request(f"n{i}", p, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)))
    got, _, _ = _drain(llm, reqs)
    for i in range(len(prompts)):
        assert got[f"k{i}"] == want[i]
        assert got[f"p{i}"] == want[i]
    assert any(got[f"n{i}"] != want[i] for i in range(len(prompts)))  # the neighbours really sampled


# ------------------------------------------------------------------------------------------ 2. stopping
def _eos_case(engine) -> tuple[list[int], list[int], int]:
    """A prompt, its 16 greedy tokens (EOS ignored, served: one output per engine step) and a position j >= 2 whose
    token appears there first and inside a step's accepted tokens (not the last of its step's output, nor the
    prefill's first token): declared EOS, a request must stop right after it although the same step accepted
    more tokens."""
    llm = _llm(engine, method="classic", max_slots=1, max_context=128)
    for prompt in [[9, 20, 31, 42, 53, 64, 75]] + _prompts(8, seed=11, low=5, high=40):
        llm.add_request(Request("probe", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
        chunks = []
        for _ in range(200):
            if not llm.has_unfinished():
                break
            chunks += [o.new_token_ids for o in llm.step() if o.new_token_ids]
        toks = [t for c in chunks for t in c]
        ends = {sum(map(len, chunks[:i + 1])) - 1 for i in range(len(chunks))}  # last position of each step
        for j in range(2, 12):
            if j not in ends and toks[j] not in toks[:j]:
                assert toks == _offline(engine, prompt, "classic", 16)
                return prompt, toks, j
    raise AssertionError("no prompt puts a new token inside a step's accepted drafts")


def test_eos_stops_with_reason_stop_and_ignore_eos_runs_to_length(engine):
    """Guards EOS stopping in serving: with the token at position j of a prompt's greedy output declared EOS, a
    request stops with exactly the tokens up to and including that EOS (speculative steps accept drafts past it:
    they must be dropped) and finish_reason "stop"; beside it an `ignore_eos` request of the same prompt runs to
    max_tokens with finish_reason "length"; a request whose very first token (chosen by its prefill) is EOS
    returns just that token with "stop"."""
    prompt, toks, j = _eos_case(engine)
    eos = toks[j]
    # a prompt whose first greedy token is some token not in toks[:j]: declared EOS too
    candidates = _prompts(16, seed=4, low=5, high=40)
    cfg, params = offline(method="classic", max_new_tokens=1, stop_at_eos=False)
    firsts = [s.token_ids[0] for s in engine.generate(candidates, cfg, params).sequences]
    f, q = next((f, q) for f, q in zip(firsts, candidates, strict=True) if f not in toks[:j])
    llm = _llm(engine, eos={eos, f}, method="classic", max_slots=3, max_context=128)
    got, reasons, completion = _drain(llm, [
        Request("stop", prompt, SamplingParams(temperature=0, max_tokens=16)),
        Request("ignore", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
        Request("first", q, SamplingParams(temperature=0, max_tokens=16))])
    assert got["stop"] == toks[:j + 1] and reasons["stop"] == "stop" and completion["stop"] == j + 1
    assert got["ignore"] == toks and reasons["ignore"] == "length" and completion["ignore"] == 16
    assert got["first"] == [f] and reasons["first"] == "stop" and completion["first"] == 1
    assert llm.stats()["generated_tokens_total"] == j + 1 + 16 + 1


def test_ignore_eos_is_reset_when_the_slot_is_reused(engine):
    """Guards the per-row `ignore_eos` flag: with one slot, request A (ignore_eos) runs past the EOS to max_tokens,
    then B (same prompt, EOS honoured) reuses A's row and must stop at the EOS; then C (ignore_eos again) in the
    same row runs to max_tokens."""
    prompt, toks, j = _eos_case(engine)
    llm = _llm(engine, eos={toks[j]}, method="classic", max_slots=1, max_context=128)
    got, reasons, _ = _drain(llm, [Request("A", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
                                   Request("B", prompt, SamplingParams(temperature=0, max_tokens=16)),
                                   Request("C", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))])
    assert got["A"] == toks and reasons["A"] == "length"
    assert got["B"] == toks[:j + 1] and reasons["B"] == "stop"
    assert got["C"] == toks and reasons["C"] == "length"


def test_ignore_eos_request_ending_on_an_eos_token_reports_length(engine):
    """Guards finish_reason under ignore_eos: EOS is not a stop condition for such a request, so when its last
    allowed token (max_tokens = j + 1) happens to be the EOS id, it still finished because of its length."""
    prompt, toks, j = _eos_case(engine)
    llm = _llm(engine, eos={toks[j]}, method="classic", max_slots=1, max_context=128)
    got, reasons, _ = _drain(llm, [Request("x", prompt,
                                           SamplingParams(temperature=0, max_tokens=j + 1, ignore_eos=True))])
    assert got["x"] == toks[:j + 1]
    assert reasons["x"] == "length"


# ------------------------------------------------------------------------------------------ 3. scheduler
def _check_admissions(sched: Scheduler) -> list[_Sequence]:
    """sched.admissions(), checked: the oldest waiting requests, in arrival order, to the lowest free rows, as
    many as there are free rows."""
    waiting, free = list(sched.waiting), sched.slots.free_rows()
    out = sched.admissions()
    k = min(len(waiting), len(free))
    assert [id(s) for s in out] == [id(s) for s in waiting[:k]]
    assert [s.row for s in out] == free[:k]
    assert all(sched.running[s.row] is s for s in out)
    assert sched.slots.free_rows() == free[k:] and list(sched.waiting) == waiting[k:]
    return out


def _check_prefill(sched: Scheduler) -> list[tuple[int, int]]:
    """sched.prefill_chunks(), checked: budget, request-local chunk boundaries, FIFO, no fitting chunk left."""
    running = dict(sched.running)
    before = {row: s.prefilled for row, s in running.items()}
    out = sched.prefill_chunks()
    assert sum(n for _, n in out) <= sched.budget
    offset = dict(before)
    got = {}
    for row, n in out:
        seq = running[row]
        L = len(seq.request.prompt_ids)
        assert offset[row] % sched.chunk == 0, "a chunk does not start at a multiple of the chunk size"
        assert n == min(sched.chunk, L - offset[row]), "a chunk was cut short (or overruns)"
        offset[row] += n
        got[row] = got.get(row, 0) + n
    for row, s in running.items():
        assert s.prefilled == offset[row]
    # FIFO: a younger request gets tokens only if every older one with prompt left got some too
    left = [s for row, s in running.items() if before[row] < len(s.request.prompt_ids)]
    for row in got:
        y = running[row]
        for x in left:
            if x.arrival < y.arrival:
                assert got.get(x.row, 0) > 0, "a younger request was prefilled first"
    # no budget wasted: the oldest request with prompt left got a chunk, and its next one does not fit
    still = sorted((s for s in running.values() if s.prefilling), key=lambda s: s.arrival)
    if left:
        assert out, "prompt tokens are waiting but nothing was prefilled"
    if still:
        s = still[0]
        nxt = min(sched.chunk, len(s.request.prompt_ids) - s.prefilled)
        assert nxt > sched.budget - sum(n for _, n in out), "a fitting chunk of the oldest prompt was left out"
    return out


def test_scheduler_invariants_randomized():
    """Guards `Scheduler` directly over 300 random runs (rows 1-4, chunk 1-24, budget chunk..3 chunk + 7, prompts
    1-90 tokens, requests arriving and decoding requests finishing at random): admissions go in arrival order to
    the lowest free rows; every step's prefill fits the budget; a prompt is always cut at multiples of the chunk
    size from its own start (only its last chunk may be shorter), whatever else is waiting; a younger request is
    never prefilled while an older one with prompt left gets nothing; the oldest prompt's next chunk is scheduled
    whenever it fits."""
    rng = random.Random(0)
    for _ in range(300):
        rows, chunk = rng.randint(1, 4), rng.randint(1, 24)
        sched = Scheduler(SlotTable(rows), 64, chunk, rng.randint(chunk, 3 * chunk + 7))
        clock, todo, done = 0, rng.randint(1, 12), 0
        while done < todo:
            for _ in range(rng.choice([0, 0, 1, 2]) if clock < todo else 0):  # arrivals
                clock += 1
                req = Request(str(clock), [5] * rng.randint(1, 90), SamplingParams(temperature=0))
                sched.enqueue(_Sequence(req, float(clock)))
            _check_admissions(sched)
            _check_prefill(sched)
            for row, s in list(sched.running.items()):  # decoding requests finish now and then
                if not s.prefilling and rng.random() < 0.4:
                    sched.finish(row)
                    done += 1
            if clock < todo and not sched.waiting and not sched.running:
                clock += 1
                sched.enqueue(_Sequence(Request(str(clock), [5] * rng.randint(1, 90), SamplingParams(temperature=0)),
                                        float(clock)))


class _RecordingRunner:
    """Wraps the engine's runner: records admit / release / prefill calls, delegates everything."""

    def __init__(self, runner) -> None:
        self._s = runner
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._s, name)

    def admit(self, row, prompt, *args, **kw):
        self.calls.append(("admit", row, tuple(prompt)))
        return self._s.admit(row, prompt, *args, **kw)

    def release(self, row):
        self.calls.append(("release", row))
        return self._s.release(row)

    def prefill(self, pieces, pad_to=0):
        self.calls.append(("prefill", list(pieces), pad_to))
        return self._s.prefill(pieces, pad_to)


def test_engine_steps_keep_the_prefill_invariants(engine):
    """Guards the engine loop's prefill through `EngineCore.step()` (the runner's calls recorded): 9 requests of
    1-150 tokens arriving over several steps into 3 slots, chunk 16, 40 prompt tokens per step (not a multiple of
    the chunk). Every step: one packed prefill call padded to 40 tokens, at most 40 real tokens; each prompt cut at
    multiples of 16 from its own start; no younger request prefilled while an older one (waiting or running) with
    prompt left gets nothing; the oldest admitted prompt's next chunk scheduled whenever it fits; admissions in
    arrival order to the lowest free rows. Every request is prefilled exactly once in full and finishes with its
    tokens."""
    rng = random.Random(6)
    lengths = [150, 33, 5, 16, 100, 1, 48, 17, 64]  # step 0: 32 of the first, the second's 16 do not fit
    prompts = [[rng.randrange(3, 90) for _ in range(n)] for n in lengths]
    arrive_at = [0, 0, 0, 0, 1, 2, 2, 5, 9]  # step at which each request is added
    llm = _llm(engine, method="classic", max_slots=3, max_context=256, prefill_chunk=16, prefill_tokens=40)
    rec = _RecordingRunner(llm.runner)
    llm.executor.runner = rec
    by_prompt = {tuple(p): i for i, p in enumerate(prompts)}
    offset = [0] * len(prompts)  # prompt tokens prefilled per request
    row_of: dict[int, int] = {}  # row -> request
    free = set(range(3))
    added, step, got = 0, 0, {}
    while added < len(prompts) or llm.has_unfinished():
        while added < len(prompts) and arrive_at[added] <= step:
            llm.add_request(Request(str(added), prompts[added],
                                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
            added += 1
        left_before = {i for i in range(added) if offset[i] < lengths[i]}
        rec.calls.clear()
        for o in llm.step():
            got.setdefault(int(o.request_id), []).extend(o.new_token_ids)
        admitted = []
        prefills = [c for c in rec.calls if c[0] == "prefill"]
        assert len(prefills) <= 1, "more than one prefill forward in a step"
        this_step: dict[int, int] = {}
        for call in rec.calls:
            if call[0] == "release":
                free.add(call[1])
                row_of.pop(call[1])
            elif call[0] == "admit":
                _, row, prompt = call
                assert row == min(free), "not admitted to the lowest free row"
                free.remove(row)
                row_of[row] = by_prompt[prompt]
                admitted.append(row_of[row])
            else:
                _, pieces, pad_to = call
                assert pad_to == 40 and sum(n for _, n in pieces) <= 40
                for row, n in pieces:
                    i = row_of[row]
                    assert offset[i] % 16 == 0 and n == min(16, lengths[i] - offset[i])
                    offset[i] += n
                    this_step[i] = this_step.get(i, 0) + n
        assert admitted == sorted(admitted), "admissions out of arrival order"
        for y in this_step:
            for x in left_before:
                assert not (x < y and x not in this_step), f"request {y} prefilled while older {x} waited"
        still = [i for i in sorted(row_of.values()) if offset[i] < lengths[i]]
        if still:  # the oldest admitted prompt's next chunk did not fit what this step left
            i = still[0]
            assert min(16, lengths[i] - offset[i]) > 40 - sum(this_step.values()), "a fitting chunk was left out"
        step += 1
        assert step < 200
    assert offset == lengths
    assert sorted(got) == list(range(len(prompts))) and all(len(t) == 4 for t in got.values())
    assert llm.stats()["prompt_tokens_total"] == sum(lengths)


# ------------------------------------------------------------------------------------------ 4. dustin-d served
def test_dustin_d_served_equals_offline_generation(engine):
    """Guards `dustin-d` (draft-lookahead sparse verification) in serving: 6 requests of 5-110 tokens through 3
    slots, prompts prefilled in chunks of 40 packed 80 tokens a step, give each request exactly the greedy tokens
    of `Engine.generate` of its prompt alone, which equal those of one whole-batch offline gang (no serving
    loop) of all the prompts (fp32, budget 24, draft window 32: the sparse selection is active, its output differs
    from full verification)."""
    prompts = _prompts(6, seed=7, low=5, high=110)
    cfg, params = offline(method="dustin-d", max_new_tokens=12, stop_at_eos=False, **SPARSE)
    ref = [engine.generate([p], cfg, params).sequences[0].token_ids for p in prompts]
    assert [o.new_token_ids for o in engine.start(prompts, cfg, params, fill="whole").run_queued()[0]] == ref
    llm = _llm(engine, method="dustin-d", max_slots=3, max_context=256, prefill_chunk=40, prefill_tokens=80,
               **SPARSE)
    assert llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) == ref
    full = [_offline(engine, p, "classic", 12) for p in prompts]
    assert ref != full  # the sparse policy really decides something here


# ------------------------------------------------------------------------------------------ 5. aborts
@pytest.mark.parametrize("when", ["decode", "prefill"])
def test_abort_returns_abort_frees_the_slot_and_stops_generating(engine, when):
    """Guards `EngineCore.abort_request` of a running request (mid-decode, or mid-prefill of a long prompt in
    32-token chunks), one slot, a second request waiting: the next step reports it finished with "abort" and no new
    tokens, the waiting request is admitted and prefilled in that same step and gets exactly its offline tokens
    (nothing of the aborted request's in-flight step leaks into the reused row), no output of the aborted request
    follows, and the engine's token counters grow only by the other request's tokens from then on."""
    prompts = _prompts(2, seed=8, low=20, high=40)
    if when == "prefill":
        prompts[0] = _prompts(1, seed=9, low=150, high=151)[0]
    # chunks of 32, 64 prompt tokens a step: the 150-token prompt takes 3 steps, the waiting one (<= 40 tokens) is
    # prefilled in the abort's step itself, so its row is active when the aborted request's in-flight step is read
    llm = _llm(engine, method="classic", max_slots=1, max_context=320, prefill_chunk=32, prefill_tokens=64)
    llm.add_request(Request("A", prompts[0], SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)))
    llm.add_request(Request("B", prompts[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    a_tokens = []
    for _ in range(100):
        a_tokens += [t for o in llm.step() if o.request_id == "A" for t in o.new_token_ids]
        seq = llm.sequence("A")
        if (when == "decode" and len(a_tokens) >= 5) or (when == "prefill" and seq.prefilled >= 64):
            break
    if when == "decode":
        assert 0 < len(a_tokens) < 150
    else:
        assert a_tokens == [] and llm.sequence("A").prefilling
    st = llm.stats()
    assert st["requests_running"] == 1 and st["requests_waiting"] == 1
    gen0, prompt0 = st["generated_tokens_total"], st["prompt_tokens_total"]
    llm.abort_request("A")
    outs = llm.step()
    a = [o for o in outs if o.request_id == "A"]
    assert len(a) == 1 and a[0].finished and a[0].finish_reason == "abort" and a[0].new_token_ids == []
    assert a[0].completion_tokens == len(a_tokens)
    assert llm.scheduler.running and llm.scheduler.running[0].request.request_id == "B"  # admitted at once
    b_tokens = [t for o in outs if o.request_id == "B" for t in o.new_token_ids]
    got, reasons, _ = _drain(llm)
    assert "A" not in got and reasons == {"B": "length"}
    b_tokens += got["B"]
    assert b_tokens == _offline(engine, prompts[1], "classic", 6)
    st = llm.stats()
    assert st["generated_tokens_total"] == gen0 + 6
    assert st["prompt_tokens_total"] == prompt0 + len(prompts[1])
    assert st["requests_aborted"] == 1 and st["requests_finished"] == 1 and st["requests_running"] == 0


class _RecordingEngine:
    """An EngineCore whose step() takes `delay` seconds longer and records every output it returns."""

    def __init__(self, engine, delay: float) -> None:
        self._engine, self.delay = engine, delay
        self.outputs: list = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        time.sleep(self.delay)
        outs = self._engine.step()
        self.outputs.extend(outs)
        return outs

    def of(self, rid: str) -> list:
        return [o for o in list(self.outputs) if o.request_id == rid]


def _wait(cond, timeout: float = 20.0, what: str = "condition"):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_http_client_that_disconnects_is_aborted_and_frees_the_slot(engine):
    """Guards aborts over HTTP: a non-streaming /v1/completions client (a raw socket) leaves while its request
    decodes in the server's only slot and a second request waits. The engine must report the first request
    finished with "abort" well before its max_tokens, admit and complete the waiting one (exactly its offline
    tokens), count the first as aborted, and generate nothing more for it."""
    import httpx

    from dustin.serve.local import LocalServer

    b_prompt = _prompts(1, seed=10, low=10, high=30)[0]
    b_want = _offline(engine, b_prompt, "classic", 8)
    rec = _RecordingEngine(_llm(engine, method="classic", max_slots=1, max_context=512), delay=0.02)
    srv = LocalServer(rec, "tiny")
    sock = None
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait(lambda: sum(len(o.new_token_ids) for o in rec.outputs) >= 3, what="the first request to decode")
        b_result = {}

        def post_b():
            b_result["r"] = httpx.post(srv.url + "/v1/completions", timeout=25, json={
                "model": "tiny", "prompt": b_prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})

        t = threading.Thread(target=post_b)
        t.start()
        _wait(lambda: srv.async_engine.stats().get("requests_waiting") == 1, what="the second request to queue")
        sock.shutdown(socket.SHUT_RDWR)  # the first client leaves
        sock.close()
        sock = None
        t.join(30)
        assert not t.is_alive(), "the waiting request never completed"
        r = b_result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == b_want
        a_id = rec.outputs[0].request_id
        assert {o.request_id for o in rec.outputs} - {a_id}, "no output of the second request"
        a_outs = rec.of(a_id)
        assert a_outs[-1].finished and a_outs[-1].finish_reason == "abort"
        a_count = sum(len(o.new_token_ids) for o in a_outs)
        assert 3 <= a_count < 400
        stop_index = rec.outputs.index(a_outs[-1])
        assert all(o.request_id != a_id for o in rec.outputs[stop_index + 1:])
        first_b = next(i for i, o in enumerate(rec.outputs) if o.request_id != a_id)
        assert first_b > stop_index  # B was admitted only once A's slot was freed
        time.sleep(0.2)
        st = srv.async_engine.stats()
        assert st["requests_running"] == st["requests_waiting"] == 0
        assert st["requests_aborted"] == 1 and st["requests_finished"] == 1
        assert st["generated_tokens_total"] == a_count + 8  # nothing generated for A after its abort
        assert len(rec.of(a_id)) == len(a_outs)
    finally:
        if sock is not None:
            sock.close()
        srv.close()
