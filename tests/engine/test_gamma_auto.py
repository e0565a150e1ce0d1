"""Γ per row and `--gamma auto` (dustin/engine/gamma.py, Runner.set_gamma): each sequence picks its own Γ per step;
a step runs the largest, and every row's tokens are those of steps of its own Γ, whatever runs beside it. Full
verification stays exact (Γ = 0 steps included, with the draft's catch-up after them), and a request's text does not
depend on the batch, greedy or seeded-sampled (fp32, CPU)."""
from __future__ import annotations

import random

import pytest

from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.engine import Engine
from dustin.engine.gamma import GammaRule, RowGamma, StepCosts, expected_tokens
from dustin.engine.request import SamplingParams
from dustin.errors import InputError

pytestmark = pytest.mark.usefixtures("cpu_paths")  # dustin selects with the CPU's PyTorch code (tests/conftest.py)

SPARSE = dict(budget=24, draft_window=32)
G = 6  # GAMMA_AUTO_MAX
# a step costs 1 + 0.3 Γ (a cheap draft): at the prior's acceptance Γ = 1 pays; rows whose drafts are rejected
# fall to Γ = 0 (full verification) and try again once their estimate has drifted back to the prior
COSTS = StepCosts(tuple(range(G + 1)), tuple(1.0 + 0.3 * g for g in range(G + 1)), (0.0,) * (G + 1))


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return Engine.from_pretrained(str(target), str(draft))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 90) for _ in range(rng.randrange(5, 120))] for _ in range(n)]


def _core(engine, method, gamma="auto", slots=3, **kw):
    extra = SPARSE if method.startswith("dustin") else {"draft_window": 32}
    return EngineCore(engine.pair, GenerationConfig(method=method, gamma=gamma, max_slots=slots, max_context=256,
                                               prefill_chunk=40, **extra, **kw), step_costs=COSTS)


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# ---------------------------------------------------------------- the rule
def test_rule_picks_the_most_tokens_per_second():
    rule = GammaRule(COSTS, G)
    assert rule.choose(100, 0.0) == 0  # nothing accepted: a plain step
    assert rule.choose(100, 0.97) == G  # almost everything accepted: the most drafts
    assert GammaRule(COSTS, G, gamma_min=1).choose(100, 0.0) == 1
    for alpha in (0.3, 0.6, 0.8, 0.9):
        best = max(range(G + 1), key=lambda g: expected_tokens(g, alpha) / COSTS.seconds(g, 100))
        assert rule.choose(100, alpha) == best
    # the context matters: vanilla's attention grows with it, a sparse step's does not
    costs = StepCosts(tuple(range(G + 1)), tuple(1.0 + 0.8 * g for g in range(G + 1)), (1e-4,) + (1e-6,) * G)
    assert GammaRule(costs, G).choose(1_000, 0.6) == 0
    assert GammaRule(costs, G).choose(64_000, 0.6) > 0
    assert expected_tokens(0, 0.5) == 1 and expected_tokens(3, 0.5) == 1.875


def test_step_costs_are_lines_through_two_measured_points():
    c = StepCosts.from_points({0: ((64, 1.0), (1064, 2.0)), 1: ((64, 3.0), (1064, 2.5))})
    assert c.seconds(0, 564) == pytest.approx(1.5)
    assert c.seconds(1, 10_000) == pytest.approx(3.0)  # timing noise never makes a step cheaper with context
    with pytest.raises(ValueError, match="lack"):
        GammaRule(c, 3)


def test_a_rows_gamma_reads_only_steps_two_behind():
    """The decision for step s folds the results of steps <= s - 2 only: the same whether step s - 1 was already read
    back (no overlap) or not (the device a step ahead)."""
    rule = GammaRule(COSTS, G)
    results = [0, 0, 1, 4, 6, 6, 0, 2]
    eager, lagged = RowGamma(50), RowGamma(50)
    got_eager, got_lagged = [], []
    for s, n in enumerate(results):
        got_eager.append(eager.next_gamma(rule))
        eager.observe(min(n, got_eager[-1]))  # read back before the next decision
        got_lagged.append(lagged.next_gamma(rule))
        if s > 0:
            lagged.observe(min(results[s - 1], got_lagged[-2]))  # the previous step, read back a step late
    assert got_eager == got_lagged
    assert len(set(got_eager)) > 1


def test_plain_steps_drift_back_to_the_prior():
    rule = GammaRule(COSTS, G)
    row = RowGamma(10)
    for _ in range(3):
        row.next_gamma(rule)
        row.observe(0)
    assert row.alpha(rule) < rule.prior
    for _ in range(60):
        row.launched.append(0)
        row.observe(0)
    row.next_gamma(rule)
    assert row.alpha(rule) == pytest.approx(rule.prior, abs=1e-2)


# ---------------------------------------------------------------- the engine
@pytest.mark.parametrize("method", ["classic", "magicdec"])
def test_full_verification_with_auto_gamma_is_the_targets(engine, method):
    """Rows switch between plain steps (Γ = 0, no draft forward) and speculative ones; the draft catches up on the
    positions it skipped; every token is the target's greedy one (vanilla through the same slots)."""
    prompts = _prompts(6)
    ref = _core(engine, "vanilla", gamma=4).generate(prompts, GREEDY)
    core = _core(engine, method)
    assert core.generate(prompts, GREEDY) == ref
    used = core.decode_stats.gammas
    assert used.get(0, 0) > 0 and sum(v for g, v in used.items() if g > 0) > 0, used


def test_plain_steps_of_a_sparse_method_verify_against_the_whole_cache(engine):
    """dustin under --gamma auto with drafting priced out (every Γ > 0 costs 10 plain steps): every step is plain, each
    row verified densely, so the tokens are exactly the target's (vanilla through the same slots); and with the
    usual mix of plain and speculative steps a request still gets the same tokens alone and batched."""
    prompts = _prompts(4, seed=5)
    ref = _core(engine, "vanilla", gamma=4).generate(prompts, GREEDY)
    priced_out = StepCosts(tuple(range(G + 1)), (1.0,) + (10.0,) * G, (0.0,) * (G + 1))
    core = EngineCore(engine.pair, GenerationConfig(method="dustin", gamma="auto", max_slots=3, max_context=256,
                                               prefill_chunk=40, **SPARSE), step_costs=priced_out)
    assert core.generate(prompts, GREEDY) == ref
    assert set(core.decode_stats.gammas) == {0}
    assert _core(engine, "dustin", gamma=4).generate(prompts, GREEDY) != ref  # sparse verification differs here


@pytest.mark.parametrize("method", ["dustin", "classic"])
def test_auto_gamma_text_does_not_depend_on_the_batch(engine, method):
    """Each request alone through the same slots gives the tokens it gets beside five others (sparse verification
    included: a row's selection reads only its own drafts' lookahead)."""
    prompts = _prompts(6, seed=1)
    core = _core(engine, method)
    batched = core.generate(prompts, GREEDY)
    assert core.decode_stats.gammas and len(core.decode_stats.gammas) > 1, core.decode_stats.gammas
    alone = [_core(engine, method).generate([p], GREEDY)[0] for p in prompts]
    assert alone == batched


def test_seeded_sampling_with_auto_gamma_does_not_depend_on_the_batch(engine):
    """A seeded sampled request draws the same numbers whatever Γ the rows beside it take."""
    prompts = _prompts(4, seed=2)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, ignore_eos=True, seed=10 + i)
              for i in range(len(prompts))]
    batched = _core(engine, "dustin").generate(prompts, params)
    alone = [_core(engine, "dustin").generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert alone == batched


def test_fixed_gamma_per_row_is_a_step_of_that_gamma(engine):
    """Runner.set_gamma: a row held at Γ = 2 in a batch whose other rows draft 4 gets the tokens a Γ = 2 engine
    gives it (greedy, sparse verification)."""
    prompts = _prompts(3, seed=3)
    want = _core(engine, "dustin", gamma=2).generate(prompts[:1], GREEDY)[0]
    core = _core(engine, "dustin", gamma=4)
    core.runner.set_gamma(0, 2)  # an idle row keeps its Γ until it is released
    core.queue([(p, GREEDY) for p in prompts])
    core.step()
    assert core.scheduler.running[0].request.prompt_ids == prompts[0]
    outs, _ = core.run_queued()
    assert outs[0].new_token_ids == want
    assert outs[1].new_token_ids == _core(engine, "dustin", gamma=4).generate(prompts[1:2], GREEDY)[0]


def test_gamma_bounds_are_checked(engine):
    core = _core(engine, "dustin", gamma=4)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        core.runner.set_gamma(0, 0)  # sparse verification: a token depends on its drafts
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        core.runner.set_gamma(0, 5)
    assert _core(engine, "classic", gamma=4).runner.batch.min_gamma == 0
    with pytest.raises(ValueError, match="no Γ"):
        _core(engine, "vanilla", gamma=4).runner.set_gamma(0, 1)
    with pytest.raises(InputError, match="integer or auto"):
        GenerationConfig(gamma="fast")
    cfg = GenerationConfig(gamma="auto")
    assert cfg.gamma == G and cfg.gamma_auto


def test_measured_costs_leave_the_engine_as_it_was(engine):
    """The cost model is measured on the engine's own slots at start (every Γ the policy allows); afterwards the
    engine generates exactly what an engine given those costs generates."""
    cfg = GenerationConfig(method="dustin", gamma="auto", max_slots=2, max_context=256, **SPARSE)
    core = EngineCore(engine.pair, cfg)
    costs = core.gamma_rule.costs
    assert costs.gammas == tuple(range(G + 1))  # a plain dustin row verifies densely: Γ = 0 is allowed
    assert all(c.seconds(g, 200) > 0 for c in (costs,) for g in costs.gammas)
    prompts = _prompts(2, seed=4)
    given = EngineCore(engine.pair, cfg, step_costs=costs)
    assert core.generate(prompts, GREEDY) == given.generate(prompts, GREEDY)
    classic = EngineCore(engine.pair, GenerationConfig(method="classic", gamma="auto", max_slots=2, max_context=256))
    assert classic.gamma_rule.costs.gammas == tuple(range(G + 1))
