"""The runner's interfaces, through the engine core (fp32, CPU): verify plans of every shape a policy produces (one
set per sequence [B, K], one per sequence and KV head [B, Hkv, K], or a per-layer planner), and the draft step,
which takes the lookahead queries to record as data (`LookaheadCapture`)."""
from __future__ import annotations

import random

import pytest

from dustin.attention.context import SparsePlan
from dustin.engine.draft_step import DraftStep
from dustin.engine.engine import Engine
from dustin.selection.base import SelectionPolicy
from tests.offline import offline

pytestmark = pytest.mark.usefixtures("cpu_paths")  # selection on the CPU's PyTorch code (tests/conftest.py)


class PerKVHead(SelectionPolicy):
    """Another policy's shared set, handed to the runner once per KV head ([B, Hkv, K] / [B, Hkv])."""

    def __init__(self, inner: SelectionPolicy, n_kv_heads: int) -> None:
        self.inner, self.h = inner, n_kv_heads
        self.name, self.cfg = inner.name, inner.cfg
        self.graph_safe, self.row_local = inner.graph_safe, inner.row_local
        self.observes_prefill = inner.observes_prefill
        self.shapes: set[tuple[int, ...]] = set()

    def draft_observers(self, state):
        return self.inner.draft_observers(state)

    def draft_captures(self, state):
        return self.inner.draft_captures(state)

    def target_observers(self, state):
        return self.inner.target_observers(state)

    def begin_step(self, state) -> None:
        self.inner.begin_step(state)

    def after_verify(self, state, n_accepted) -> None:
        self.inner.after_verify(state, n_accepted)

    def plan(self, state):
        p = self.inner.plan(state)
        out = SparsePlan(p.indices[:, None].expand(-1, self.h, -1).contiguous(),
                         p.counts[:, None].expand(-1, self.h).contiguous())
        self.shapes.add(tuple(out.indices.shape))
        return out


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return Engine.from_pretrained(str(target), str(draft))


def test_a_plan_per_kv_head_verifies_like_the_shared_plan(engine):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randrange(60, 150))] for _ in range(3)]
    cfg, params = offline(method="dustin", budget=24, draft_window=32, max_new_tokens=24, stop_at_eos=False)
    want = [s.token_ids for s in engine.generate(prompts, cfg, params).sequences]
    hkv = engine.pair.target.args.n_kv_heads
    policy = PerKVHead(engine.pair.make_policy(cfg), hkv)
    got = [s.token_ids for s in engine.generate(prompts, cfg, params, policy=policy).sequences]
    assert got == want
    assert policy.shapes and all(s[:2] == (3, hkv) for s in policy.shapes)
    # the sets matter here: full verification gives other tokens, so a plan the runner ignored would show
    full, full_params = offline(method="classic", draft_window=32, max_new_tokens=24, stop_at_eos=False)
    assert [s.token_ids for s in engine.generate(prompts, full, full_params).sequences] != want


class Recording(DraftStep):
    """Another draft step in the runner's place: here the eager one, with what it was asked recorded."""

    def __init__(self, inner: DraftStep) -> None:
        self.inner, self.calls = inner, []

    def run(self, prev, pending, lengths, max_len, G, *, captures, observers, graphed):
        self.calls.append((G, [{layer: h.tolist() for layer, h in c.heads.items()} for c in captures]))
        return self.inner.run(prev, pending, lengths, max_len, G, captures=captures, observers=observers,
                              graphed=graphed)


def test_the_draft_step_is_handed_the_lookahead_to_record_as_data(engine, tiny_sparse_config):
    """The runner drafts through its device step's `draft_step`, passing the policy's captures: the draft layers
    and heads of the sparse config, as data; a step in its place gives the same tokens."""
    import json

    rng = random.Random(6)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randrange(40, 90))] for _ in range(2)]
    cfg, params = offline(method="dustin", sparse_config=tiny_sparse_config, draft_window=32, max_new_tokens=12,
                           stop_at_eos=False)
    want = [s.token_ids for s in engine.generate(prompts, cfg, params).sequences]
    core = engine.start(prompts, cfg, params)
    step = core.runner.device_step.draft_step = Recording(core.runner.device_step.draft_step)
    outs, _ = core.run_queued()
    assert [o.new_token_ids for o in outs] == want
    heads = {d["layer"]: sorted(d["heads"]) for d in json.load(open(tiny_sparse_config))["draft"]}
    assert step.calls and all(G == cfg.gamma and [{k: sorted(v) for k, v in c.items()} for c in caps] == [heads]
                              for G, caps in step.calls)
