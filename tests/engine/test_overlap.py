"""The engine loop keeps the device one step ahead of the host: a sequence that stops at step n still runs
step n + 1, whose tokens must be dropped. Its output must equal the one-step-at-a-time loop exactly, for every
method, greedy and sampled, with sequences stopping at different steps (limits and EOS)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dustin.engine.config import ExecutionOptions
from dustin.engine.engine import Engine
from dustin.models.loader import load_model
from tests.offline import offline

pytestmark = pytest.mark.usefixtures("cpu_paths")  # selection on the CPU's PyTorch code (tests/conftest.py)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    e = Engine.from_models(load_model(target), load_model(draft))
    e.keep_session = False
    return e


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def _run(engine, prompts, cfg, params, limits, eos):
    """(each prompt's tokens, the core) of a run to the end, with `eos` as the EOS ids."""
    core = engine.start(prompts, cfg, params, limits=limits)
    core.eos_ids = eos
    return [o.new_token_ids for o in core.run_queued()[0]], core


CASES = [
    ("vanilla", dict()),
    ("classic", dict(gamma=3)),
    ("classic", dict(gamma=4, temperature=0.9, top_p=0.8, seed=3)),
    ("dustin", dict(gamma=4, budget=24)),
    ("magicdec", dict(gamma=2, draft_window=16)),
    ("streaming", dict(gamma=3, budget=24)),
    ("quest", dict(gamma=3, budget=32)),
    ("specattn", dict(gamma=3, budget=24)),
]


@pytest.mark.parametrize("method,kw", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_overlapped_decode_equals_step_by_step(engine, method, kw):
    prompts = _prompts([37, 5, 70, 21])
    limits = [13, 3, 9, 16]  # rows stop at different steps; row 1 after one or two steps
    base, params = offline(method=method, max_new_tokens=16, **kw)
    # an EOS the first row emits mid-way, so that one row stops early by EOS rather than by its limit
    probe, _ = _run(engine, prompts, replace(base, options=ExecutionOptions(overlap=False)), params, limits, set())
    eos = {probe[0][len(probe[0]) // 2]}
    want, ref = _run(engine, prompts, replace(base, options=ExecutionOptions(overlap=False)), params, limits, eos)
    got, core = _run(engine, prompts, base, params, limits, eos)
    assert core.runner.policy.graph_safe  # so the engine loop really ran one step ahead
    assert got == want
    assert len(got[0]) < limits[0] and got[0][-1] in eos
    assert [len(o) for o in got[1:]] != [0, 0, 0]
    got_st, want_st = core.decode_stats, ref.decode_stats
    assert got_st.steps == want_st.steps and got_st.tau == pytest.approx(want_st.tau)
    assert got_st.produced == want_st.produced
    # the device learnt of the stops a step late: it ran more steps than were counted (and stayed in the cache)
    assert core.stats()["steps_total"] > ref.stats()["steps_total"] == ref.decode_stats.steps


def test_engine_steps_overlapped_equal_steps_read_back_at_once(engine):
    """n engine steps a step ahead of the host, then `drain`, leave exactly what n steps read back one by one
    leave; more steps continue from there, and running to the end gives the same tokens."""
    prompts = _prompts([40, 12, 33], seed=1)
    cfg, params = offline(method="classic", gamma=3, max_new_tokens=60, stop_at_eos=False)
    ref = engine.start(prompts, replace(cfg, options=ExecutionOptions(overlap=False)), params)
    for _ in range(7):
        ref.step()
    core = engine.start(prompts, cfg, params)
    s, r = core.runner.batch, ref.runner.batch
    for _ in range(4):
        core.step()
    core.drain()
    assert core.decode_stats.steps == 4
    for _ in range(3):
        core.step()
    core.drain()
    assert core.decode_stats.steps == 7 == ref.decode_stats.steps
    assert core.decode_stats.produced == ref.decode_stats.produced
    assert s.host_lengths == r.host_lengths
    assert torch.equal(s.target_cache.lengths, r.target_cache.lengths)
    got, want = ([o.new_token_ids for o in c.run_queued()[0]] for c in (core, ref))
    assert got == want and all(len(o) == 60 for o in got)


@pytest.mark.parametrize("method", ["classic", "dustin"])
def test_a_row_stopping_with_every_draft_accepted_stays_inside_the_cache(tiny_pair, method):
    """Worst case of `cache_capacity`: the draft is the target itself (every draft accepted), the row with the
    longest prompt + limit overshoots its limit by Γ in its last step, runs one more step before the device
    learns it stopped, then keeps running frozen while another row decodes on: no write may leave the cache."""
    target, _ = tiny_pair
    model = load_model(target)
    e = Engine.from_models(model, model)
    e.keep_session = False
    prompts = _prompts([60, 10], seed=4)
    limits = [12, 40]  # 1 + 5 + 5 = 11 tokens after two steps: the third ends at 16, 4 past the limit
    for overlap in (False, True):
        # a gang: the stopped row is frozen, not released, until the other one finished
        core = e.start(prompts, *offline(method=method, gamma=4, max_new_tokens=40, budget=24,
                                                 stop_at_eos=False, options=ExecutionOptions(overlap=overlap)),
                       limits=limits, fill="whole")
        out = [o.new_token_ids for o in core.run_queued()[0]]
        assert [len(o) for o in out] == limits
        assert int(core.runner.batch.target_cache.lengths[0]) <= 60 + 12 + 2 * 4  # frozen at n + m + 2Γ at most
    assert core.decode_stats.tau > 4.5 if method == "classic" else core.decode_stats.tau > 1.0
