"""The oracle ladder (dustin/selection/ladder.py): per-layer oracle sets per layer, KV head and query head."""
from __future__ import annotations

import pytest
import torch

from dustin.engine.config import METHODS
from dustin.engine.engine import Engine
from dustin.models.loader import load_model
from dustin.selection.config import ORACLE_RUNGS, oracle_rung
from dustin.selection.ladder import LadderOracle, round_robin_scores, rung_set
from dustin.selection.oracle import window_probs
from tests.offline import offline


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return Engine.from_models(load_model(tiny_pair[0]), load_model(tiny_pair[1]))


def _prompts(lengths):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def test_rung_names_are_methods():
    assert oracle_rung("oracle-head-d1") == ("head", 1) and oracle_rung("oracle-layer") == ("layer", 0)
    assert len(ORACLE_RUNGS) == 9 and all(METHODS[n].policy == n for n in ORACLE_RUNGS)


def test_round_robin_union_takes_each_heads_best_first():
    """Two heads of one KV head: head 0 peaks at 5 then 6, head 1 at 9 then 2. The top 2 of the union are each
    head's best (5 and 9) though head 0's second (6) has more attention than head 1's best."""
    p = torch.zeros(1, 2, 12)
    p[0, 0, 5], p[0, 0, 6], p[0, 0, 7] = 0.5, 0.4, 0.1
    p[0, 1, 9], p[0, 1, 2], p[0, 1, 3] = 0.3, 0.2, 0.1
    s = round_robin_scores(p)[0]
    assert set(s.topk(2).indices.tolist()) == {5, 9}
    assert set(s.topk(4).indices.tolist()) == {5, 9, 6, 2}
    assert s.topk(1).indices.item() == 5  # equal ranks: the higher attention first


def _reference_probs(q, k, L, w=4):
    """Each head's attention of the first w queries (query t at position L + t sees keys j <= L + t), averaged
    over those queries, on cached positions j < L only: a loop over rows and heads."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, k.shape[2])
    for b in range(B):
        for h in range(Hq):
            for t in range(min(w, T)):
                n = int(L[b]) + t + 1
                a = (q[b, h, t] @ k[b, h // G, :n].T / D ** 0.5).softmax(-1)
                out[b, h, : int(L[b])] += a[: int(L[b])] / min(w, T)
    return out


@pytest.mark.parametrize("granularity", ["layer", "kv", "head"])
def test_rung_sets_against_a_loop(granularity):
    """Odd shapes: 3 rows of different lengths, 6 query heads on 2 KV heads, k = 29 of up to 70 positions."""
    torch.manual_seed(0)
    B, Hkv, G, T, D, S = 3, 2, 3, 5, 16, 80
    q = torch.randn(B, Hkv * G, T, D)
    k = torch.randn(B, Hkv, S, D)
    L = torch.tensor([70, 33, 52], dtype=torch.int32)
    probs = window_probs(q, k, L, max_len=75)
    torch.testing.assert_close(probs, _reference_probs(q, k, L)[:, :, :75], rtol=1e-5, atol=1e-6)
    plan = rung_set(probs, Hkv, granularity, L, k=29, sinks=4, window=8)
    lists = plan.indices[:, None] if granularity == "layer" else plan.indices
    counts = plan.counts[:, None] if granularity == "layer" else plan.counts
    for b in range(B):
        n = int(L[b])
        protected = set(range(4)) | set(range(n - 8, n))
        for g in range(lists.shape[1]):
            chosen = lists[b, g, : int(counts[b, g])].tolist()
            assert int(counts[b, g]) == 29 and chosen == sorted(set(chosen)) and max(chosen) < n
            assert protected <= set(chosen)
            heads = probs[b, g * G:(g + 1) * G] if granularity != "layer" else probs[b]
            free = [j for j in range(n) if j not in protected]
            if granularity == "head":  # each head's best unprotected position is in its group's set
                for h in range(heads.shape[0]):
                    best = max(free, key=lambda j, h=h: float(heads[h, j]))
                    assert best in chosen
            else:  # the 29 - 12 free slots hold the top of the (group's) mean attention
                mean = heads.mean(0)
                top = sorted(free, key=lambda j: -float(mean[j]))[: 29 - len(protected)]
                assert set(top) <= set(chosen)


SHORT = _prompts([20, 47, 9])
SHORT_RUN = dict(stop_at_eos=False, max_new_tokens=24, gamma=3, temperature=0.0, draft_kv="full")


@pytest.fixture(scope="module")
def classic_short(engine):
    """Classic's output for SHORT, computed once for every rung compared with it."""
    return engine.generate(SHORT, *offline(method="classic", **SHORT_RUN))


@pytest.mark.parametrize("method", ["oracle-layer", "oracle-kv-d1", "oracle-head", "oracle-head-d2"])
def test_budget_above_context_is_exactly_classic(engine, tiny_sparse_config, classic_short, method):
    """With k >= every sequence's length each layer's set is the whole cache: classic's output."""
    ladder = engine.generate(SHORT, *offline(method=method, budget=200, sparse_config=tiny_sparse_config,
                                             **SHORT_RUN))
    assert [s.token_ids for s in ladder.sequences] == [s.token_ids for s in classic_short.sequences]


def test_small_budget_plans_differ_by_layer_and_head(engine, tiny_sparse_config):
    """At k far below the context: dense layers get no set, the others one per KV head, and the sets of two
    layers, and of the two KV heads of one layer, are not all the same."""
    prompts = _prompts([150, 210])
    cfg, params = offline(method="oracle-head-d1", gamma=3, max_new_tokens=8, stop_at_eos=False, budget=32,
                           sparse_config=tiny_sparse_config, temperature=0.0)
    policy = engine.pair.make_policy(cfg)
    assert isinstance(policy, LadderOracle) and policy.dense_layers == 1
    seen: dict[int, list] = {}
    plan_layer = policy.plan_layer

    def recording(layer, q, ctx):
        p = plan_layer(layer, q, ctx)
        seen.setdefault(layer, []).append(None if p is None else p.indices.clone())
        return p

    policy.plan_layer = recording
    engine.start(prompts, cfg, params, policy=policy).step()  # the prefill and step 1
    n_layers = engine.pair.target.args.n_layers
    assert set(seen) == set(range(n_layers)) and seen[0] == [None]
    sets = [seen[layer][0] for layer in range(1, n_layers)]
    assert all(x.shape == (2, engine.pair.target.args.n_kv_heads, 32) for x in sets)
    assert any(not torch.equal(sets[0], x) for x in sets[1:])  # layers choose their own sets
    assert any(not torch.equal(x[:, 0], x[:, 1]) for x in sets)  # KV heads choose their own sets
