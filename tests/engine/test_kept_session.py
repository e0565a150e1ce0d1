"""`Engine.generate` on a kept slot session (the GPU default: caches and CUDA graphs reused across calls) gives
exactly the tokens of a fresh session per call, whatever ran before, and is reused or replaced as documented."""
from __future__ import annotations

import pytest
import torch

from dustin.engine.engine import Engine
from dustin.errors import InputError
from dustin.models.loader import load_model
from tests.offline import offline

pytestmark = pytest.mark.usefixtures("cpu_paths")  # selection on the CPU's PyTorch code (tests/conftest.py)


@pytest.fixture(scope="module")
def engines(tiny_pair):
    target, draft = tiny_pair
    fresh = Engine.from_models(load_model(target), load_model(draft))
    kept = Engine.from_models(fresh.pair.target, fresh.pair.draft)
    fresh.keep_session, kept.keep_session = False, True
    return fresh, kept


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


CALLS = [  # (method, prompt lengths, seed of the prompts, generation settings): run in this order
    ("classic", [5, 40, 23], 0, dict(gamma=3, max_new_tokens=30)),
    ("classic", [61, 7, 12], 1, dict(gamma=3, max_new_tokens=20)),  # same key: reused, other prompts
    ("dustin", [90, 33, 70], 2, dict(gamma=4, max_new_tokens=12, budget=24)),  # another method: replaced
    ("dustin", [15, 80, 44], 3, dict(gamma=4, max_new_tokens=12, budget=24)),
    ("vanilla", [30, 9], 4, dict(max_new_tokens=18)),
    ("classic", [12, 60, 3], 5, dict(gamma=3, max_new_tokens=30, temperature=0.9, top_p=0.8, seed=7)),
    ("classic", [12, 60, 3], 5, dict(gamma=3, max_new_tokens=30, temperature=0.9, top_p=0.8, seed=7)),
    ("magicdec", [50, 21, 77], 6, dict(gamma=2, max_new_tokens=22, draft_window=16)),
]


def test_kept_session_equals_fresh_sessions(engines):
    fresh, kept = engines
    for method, lengths, pseed, kw in CALLS:
        prompts = _prompts(lengths, pseed)
        cfg, params = offline(method=method, stop_at_eos=False, **kw)
        want = fresh.generate(prompts, cfg, params)
        got = kept.generate(prompts, cfg, params)
        assert [s.token_ids for s in got.sequences] == [s.token_ids for s in want.sequences], (method, lengths)
        assert got.steps == want.steps and got.tau == pytest.approx(want.tau)
        assert all(len(s.token_ids) == kw["max_new_tokens"] for s in got.sequences)


@pytest.mark.parametrize("method,kw", [("classic", dict(gamma=3)), ("dustin", dict(gamma=4, budget=24)),
                                       ("vanilla", {}), ("magicdec", dict(gamma=2, draft_window=16))])
def test_generate_on_the_engine_loop_equals_a_whole_batch_session(engines, method, kw):
    """`Engine.generate` runs on the serving engine's loop (packed chunked prefill, padded forwards, the first token
    read back with the first step); greedy, its tokens equal a whole-batch gang's (one prefill forward per
    prompt, then `decode`) token for token in fp32."""
    fresh, _ = engines
    prompts = _prompts([70, 5, 133, 41], 12)
    cfg, params = offline(method=method, max_new_tokens=24, stop_at_eos=False, **kw)
    got = fresh.generate(prompts, cfg, params)
    want = [o.new_token_ids for o in fresh.start(prompts, cfg, params, fill="whole").run_queued()[0]]
    assert [s.token_ids for s in got.sequences] == want


def test_kept_session_reuse_and_replacement(engines, monkeypatch):
    import dustin.engine.offline.batch as batch_module

    monkeypatch.setattr(batch_module, "KEPT_ROUNDING", 64)  # small slots, so a longer context outgrows them
    _, kept = engines
    kept.release_cached()
    cfg, params = offline(method="classic", gamma=3, max_new_tokens=10, stop_at_eos=False)
    kept.generate(_prompts([20, 30]), cfg, params)
    first = kept.kept_core
    assert first.runner.batch.target_cache.capacity == 64  # 30 + 10 + 2 (3 + 2) = 50, rounded up to 64
    kept.generate(_prompts([25, 11], seed=9), cfg, params)
    assert kept.kept_core is first  # same method, batch and a context that fits: the same caches (and graphs)
    kept.generate(_prompts([25, 11, 4], seed=9), cfg, params)
    assert kept.kept_core is not first  # another batch size: a new session
    second = kept.kept_core
    kept.generate(_prompts([100, 5, 5]), cfg, params)
    # outgrown: a larger one
    assert kept.kept_core is not second and kept.kept_core.runner.batch.target_cache.capacity == 128
    kept.release_cached()
    assert kept.kept_core is None


def test_kept_session_stops_at_eos_per_call(engines):
    """Stopping settings belong to the call: a call that stops at EOS after one that did not."""
    fresh, kept = engines
    prompts = _prompts([10, 50, 31], seed=11)
    for stop in (False, True, False):
        cfg, params = offline(method="classic", gamma=2, max_new_tokens=40, stop_at_eos=stop)
        assert [s.token_ids for s in kept.generate(prompts, cfg, params).sequences] == \
            [s.token_ids for s in fresh.generate(prompts, cfg, params).sequences]


def test_kept_session_bad_input_leaves_it_usable(engines):
    fresh, kept = engines
    cfg, params = offline(method="classic", gamma=3, max_new_tokens=10, stop_at_eos=False)
    with pytest.raises(InputError):
        kept.generate([[1, 2, 3], []], cfg, params)
    prompts = _prompts([14, 9])
    assert [s.token_ids for s in kept.generate(prompts, cfg, params).sequences] == \
        [s.token_ids for s in fresh.generate(prompts, cfg, params).sequences]


@pytest.mark.parametrize("method", ["quest", "specattn"])
def test_whole_batch_policies_run_fresh_sessions(engines, method):
    """A policy with whole-batch state cannot use the kept slot session: `generate` runs it on a fresh session
    (it used to stop with an InputError on a GPU, where sessions are kept by default)."""
    fresh, kept = engines
    prompts = _prompts([70, 33, 51], 9)
    cfg, params = offline(method=method, gamma=3, max_new_tokens=8, budget=32, stop_at_eos=False)
    want = fresh.generate(prompts, cfg, params)
    got = kept.generate(prompts, cfg, params)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in want.sequences]
