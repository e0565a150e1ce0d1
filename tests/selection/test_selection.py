"""Sparse verification: selection policies in the engine, online estimation, and its exactness limits."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.engine.config import ExecutionOptions, GenerationConfig
from dustin.engine.engine import Engine
from dustin.engine.offline.prefill import PrefillCache
from dustin.errors import InputError
from dustin.models.loader import load_model
from dustin.selection.config import ScoreHeads, SparseConfig
from dustin.selection.policies import DustinSelection
from tests.conftest import on_cpu_paths
from tests.offline import offline


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return Engine.from_models(load_model(tiny_pair[0]), load_model(tiny_pair[1]))


@pytest.fixture(scope="module")
def sparse_cfg(tiny_sparse_config):
    return tiny_sparse_config


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def _run(engine, prompts, **kw):
    return engine.generate(prompts, *offline(stop_at_eos=False, max_new_tokens=24, gamma=3, **kw))


SHORT = _prompts([20, 47, 9])


@pytest.fixture(scope="module")
def classic_short(engine):
    """Classic's output for SHORT, computed once for every policy compared with it."""
    with on_cpu_paths():
        return _run(engine, SHORT, method="classic", draft_kv="streaming", draft_window=16)


@pytest.mark.usefixtures("cpu_paths")
@pytest.mark.parametrize("method", ["dustin", "dustin-t", "dustin-d", "streaming", "quest", "specattn", "oracle"])
def test_budget_above_context_is_exactly_classic(engine, sparse_cfg, classic_short, method):
    """With k >= every sequence's length, each policy selects every cached position: classic's output."""
    sparse = _run(engine, SHORT, method=method, budget=200, sparse_config=sparse_cfg, draft_kv="streaming",
                  draft_window=16)
    assert [s.token_ids for s in sparse.sequences] == [s.token_ids for s in classic_short.sequences]
    assert sparse.steps == classic_short.steps
    assert "sparse_verify" in sparse.time_split_s and "verify" not in sparse.time_split_s


@pytest.mark.usefixtures("cpu_paths")
@pytest.mark.parametrize("method", ["dustin", "dustin-t", "dustin-d", "streaming", "quest", "specattn", "oracle"])
def test_small_budget_runs_and_reports_phases(engine, sparse_cfg, method):
    """At k far below the context the output may change, but decoding works and the phases are reported. Guards
    the step accounting and the plans themselves, against values recomputed here: τ from the tokens each step
    appended (no step is cut by the token limit), the cache length a plan sees from prompt + output, and every
    whole-batch plan's set: k distinct cached positions holding the sinks and the recent window (streaming:
    exactly sinks + the last k - sinks positions, StreamingLLM's set in closed form)."""
    prompts = _prompts([150, 210])
    out = _run(engine, prompts, method=method, budget=32, sparse_config=sparse_cfg)
    assert all(len(s.token_ids) == 24 for s in out.sequences)
    assert 1.0 <= out.tau <= 4.0
    if method.startswith("dustin"):
        assert "select" in out.time_split_s
    if method in ("dustin", "dustin-t"):
        assert out.time_split_s.get("estimate", 0) > 0

    k, gamma, n_steps = 32, 3, 5
    cfg, params = offline(method=method, gamma=gamma, max_new_tokens=64, stop_at_eos=False, budget=k,
                           sparse_config=sparse_cfg)
    policy = engine.pair.make_policy(cfg)
    plans, plan = [], policy.plan

    def recording(state):
        p = plan(state)
        plans.append((state.target_cache.lengths.tolist(), p))
        return p

    policy.plan = recording
    stepwise = replace(cfg, options=ExecutionOptions(overlap=False))  # each step read back at once
    core = engine.start(prompts, stepwise, policy=policy)
    tokens = [[] for _ in prompts]
    lens, seen = [[1] * len(prompts)], []  # the prefill's first token, booked with the first step's
    for _ in range(n_steps):
        seen.append([len(q) + len(t) for q, t in zip(prompts, tokens, strict=True)])  # what the next plan sees
        for o in core.step():  # the first also prefills
            tokens[int(o.request_id.split("-")[1])] += o.new_token_ids
        lens.append([len(t) for t in tokens])
    grown = [[b - a for a, b in zip(x, y, strict=True)] for x, y in zip(lens, lens[1:], strict=False)]
    assert all(1 <= g <= gamma + 1 for row in grown for g in row), grown  # a round yields 1 .. Γ + 1 tokens
    assert core.decode_stats.steps == n_steps and lens[-1][1] < 64  # nothing truncated: every token a step made is kept
    assert core.decode_stats.tau == pytest.approx(sum(map(sum, grown)) / (len(prompts) * n_steps), abs=1e-12)
    assert len(plans) == n_steps
    if method in ("quest", "specattn"):  # per-layer planners: the set is chosen inside the forward
        return
    cf = SparseConfig.load(sparse_cfg)
    for committed, (lengths, p) in zip(seen, plans, strict=True):
        # the cache holds every committed token but the pending one (the first: the prefill's): prompt + output - 1
        assert lengths == [max(n - 1, len(q)) for q, n in zip(prompts, committed, strict=True)]
        for b, L in enumerate(lengths):
            assert int(p.counts[b]) == k
            chosen = p.indices[b, :k].tolist()
            assert len(set(chosen)) == k and all(0 <= i < L for i in chosen)
            protected = set(range(cf.sinks)) | set(range(L - cf.window, L))
            assert protected <= set(chosen), (method, b, L)
            if method == "streaming":
                assert set(chosen) == set(range(cf.sinks)) | set(range(L - (k - cf.sinks), L))


@pytest.mark.usefixtures("cpu_paths")
def test_arr_probe_ranks_the_oracle_first(engine, sparse_cfg):
    """Along classic's trajectory the oracle's set recovers the most attention; with k >= context all sets
    recover all of it; the probe does not change classic's output."""
    from dustin.eval.arr import ARRProbe
    from dustin.selection.config import SparseConfig

    prompts = _prompts([300, 260], seed=5)
    classic = _run(engine, prompts, method="classic")
    for k, full in ((32, False), (400, True)):
        cfg = SparseConfig.load(sparse_cfg).with_budget(k)
        policies = {m: engine.pair.make_policy(GenerationConfig(method=m, budget=k, sparse_config=sparse_cfg))
                    for m in ("dustin", "dustin-t", "streaming")}
        probe = ARRProbe(policies, cfg.budget)
        s = engine.generate(prompts, *offline(method="classic", gamma=3, max_new_tokens=24, stop_at_eos=False),
                            policy=probe)
        arr = probe.mean_arr()
        assert [x.token_ids for x in s.sequences] == [x.token_ids for x in classic.sequences]
        if full:
            assert all(v == pytest.approx(1.0, abs=1e-5) for v in arr.values())
        else:
            assert all(0.0 < v < 1.0 for v in arr.values())
            # Eq. 3's top-k of Ā bounds every set of k positions, the protected oracle set included
            assert arr["oracle-topk"] >= max(arr[m] for m in (*policies, "oracle")) - 1e-6


@pytest.mark.usefixtures("cpu_paths")
@pytest.mark.parametrize("reuse", [False, True])
def test_arr_probe_with_per_layer_planners(engine, sparse_cfg, reuse):
    """quest / specattn / snapkv plan per layer: the probe reports no single-set ARR for them (None) instead of
    crashing (it did: `plan()` returned the policy itself), keeps classic's output, and still scores dustin."""
    from dustin.eval.arr import ARRProbe

    prompts = _prompts([120, 90], seed=6)
    cfg, params = offline(method="classic", gamma=3, max_new_tokens=12, stop_at_eos=False)
    classic = [x.token_ids for x in engine.generate(prompts, cfg, params).sequences]
    policies = {m: engine.pair.make_policy(GenerationConfig(method=m, budget=32, sparse_config=sparse_cfg))
                for m in ("quest", "specattn", "dustin")}
    probe = ARRProbe(policies, 32)
    shared = PrefillCache() if reuse else None
    if reuse:  # the prefill-reuse path calls after_verify before any plan (Quest has no pages yet)
        engine.generate(prompts, cfg, params, prefill_cache=shared)
    s = engine.generate(prompts, cfg, params, policy=probe, prefill_cache=shared)
    arr = probe.mean_arr()
    assert [x.token_ids for x in s.sequences] == classic
    assert arr["quest"] is None and arr["specattn"] is None and 0.0 < arr["dustin"] < 1.0


def test_target_scores_use_the_last_cached_query(engine):
    """S_target after a step equals the attention of the last cached token's query at the configured heads,
    recomputed from scratch with a fresh forward of the committed tokens. Layer 0, because the verify is sparse:
    deeper layers' queries and keys depend on which positions were selected."""
    heads = ScoreHeads(0, (2, 5))
    cfg = SparseConfig(target=(heads,), draft=(), budget=40, draft_topm=0)
    policy = DustinSelection(cfg, "dustin-t")
    prompt = _prompts([60])[0]
    core = engine.start([prompt], *offline(method="dustin-t", gamma=3, max_new_tokens=20, stop_at_eos=False,
                                                   options=ExecutionOptions(overlap=False)), policy=policy)
    out = [t for o in core.step() for t in o.new_token_ids]  # the prefill and step 1, read back
    s = core.runner.batch
    L = s.target_cache.lengths.clone()
    got = policy.target_scores.compute({0: s.target_cache.k[0]}, L)[0, : int(L)]
    committed = (prompt + out)[: int(L)]  # cached tokens (all but the pending one)
    target, a = engine.pair.target, engine.pair.target.args
    captured = {}

    def grab(layer, q, k_cache, ctx):
        captured["q"], captured["k"] = q[0, [2, 5], -1], k_cache[0, [2 // a.gqa_group, 5 // a.gqa_group]]

    grab.layers = frozenset({0})
    n = len(committed)
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, a.head_dim, n, torch.float32, "cpu")
    with torch.inference_mode():
        ctx = ForwardContext(cache, torch.arange(n)[None], torch.zeros(1, dtype=torch.int32), n, fresh=True,
                             observers=[grab])
        target(torch.tensor([committed]), ctx)
    ref = torch.einsum("hd,hsd->hs", captured["q"].float(), captured["k"][:, :n].float()) / a.head_dim ** 0.5
    torch.testing.assert_close(got, ref.softmax(-1).sum(0), rtol=1e-4, atol=1e-5)


def test_bad_sparse_configs(engine, tmp_path):
    with pytest.raises(InputError, match="must exceed"):
        SparseConfig(budget=10)
    with pytest.raises(InputError, match="draft_topm"):
        SparseConfig(budget=64, draft_topm=60)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"target": [{"layer": 99, "heads": [0]}]}))
    with pytest.raises(InputError, match="layer 99 out of range"):
        _run(engine, _prompts([30]), method="dustin", sparse_config=str(bad))
    bad.write_text("{not json")
    with pytest.raises(InputError, match="malformed"):
        _run(engine, _prompts([30]), method="dustin", sparse_config=str(bad))
    with pytest.raises(InputError, match="budget"):
        GenerationConfig(method="dustin", budget=8)


def test_triton_kernels_give_the_same_sparse_decoding(tmp_path):
    """dustin on the Triton kernels (score estimation, selection, sparse attention; CPU interpreter here)
    decodes the same tokens as on the PyTorch paths (the SDPA backend, with the interpreter off: the CPU's own
    estimation and selection, as a user's CPU runs them)."""
    from dustin.attention.backend import AttentionBackend
    from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

    target = make_tiny_checkpoint(tmp_path / "t", "qwen2", heads=4, kv_heads=2, seed=3)  # head_dim 16
    draft = make_tiny_draft(target, tmp_path / "d", noise=0.1)
    cfg = {"target": [{"layer": 1, "heads": [0, 3]}], "draft": [{"layer": 0, "heads": [1]}], "budget": 40,
           "draft_topm": 8}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    tri = AttentionBackend("triton")
    engines = [Engine.from_models(load_model(target, backend=tri), load_model(draft, backend=tri)),
               Engine.from_models(load_model(target), load_model(draft))]
    prompts = _prompts([70, 55])
    run = offline(method="dustin", gamma=3, max_new_tokens=8, stop_at_eos=False, sparse_config=str(path),
                  draft_window=24)
    triton_out = engines[0].generate(prompts, *run)
    with on_cpu_paths():
        torch_out = engines[1].generate(prompts, *run)
    assert [s.token_ids for s in triton_out.sequences] == [s.token_ids for s in torch_out.sequences]


def test_draft_scores_sum_the_lookahead_attention(engine):
    """S_draft of a step equals Eq. 5 recomputed from a fresh draft forward: the attention of the Γ lookahead
    queries (pending, d1, .., d_{Γ-1}) at the configured heads, summed, on the committed context."""
    cfg = SparseConfig(target=(), draft=(ScoreHeads(0, (1, 4)),), budget=40, draft_topm=20)
    policy = DustinSelection(cfg, "dustin-d")
    prompt = _prompts([50], seed=2)[0]
    gamma = 3
    core = engine.start([prompt], *offline(method="dustin-d", gamma=gamma, max_new_tokens=20,
                                                   stop_at_eos=False, draft_kv="full",
                                                   options=ExecutionOptions(overlap=False)), policy=policy)
    L0 = len(prompt)
    out = [t for o in core.step() for t in o.new_token_ids]  # the prefill and step 1, read back
    s = core.runner.batch
    got = policy.draft_scores.scores[0, :L0]
    lookahead = s.verify_input[0, :gamma].tolist()  # pending, d1, d2
    ids = (prompt + out)[:L0] + lookahead
    draft, a = engine.pair.draft, engine.pair.draft.args
    captured = {}

    def grab(layer, q, k_cache, ctx):
        captured["q"] = q[0, [1, 4], -gamma:]
        captured["k"] = k_cache[0, [1 // a.gqa_group, 4 // a.gqa_group]]

    grab.layers = frozenset({0})
    n = len(ids)
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, a.head_dim, n, torch.float32, "cpu")
    with torch.inference_mode():
        draft(torch.tensor([ids]), ForwardContext(cache, torch.arange(n)[None], torch.zeros(1, dtype=torch.int32), n,
                                                  fresh=True, observers=[grab]))
    logits = torch.einsum("htd,hsd->hts", captured["q"].float(), captured["k"][:, :n].float()) / a.head_dim ** 0.5
    causal = torch.arange(n)[None, :] <= torch.arange(L0, L0 + gamma)[:, None]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(got, probs.sum(dim=(0, 1))[:L0], rtol=1e-4, atol=1e-5)


def _recorded_plans(engine, policy, prompts):
    """Run `policy` over a short generation and return its plans (indices, counts) step by step."""
    plans, plan = [], policy.plan

    def recording(session):
        p = plan(session)
        plans.append((p.indices.clone(), p.counts.clone()))
        return p

    policy.plan = recording
    out = engine.generate(prompts, *offline(method=policy.name, gamma=3, max_new_tokens=16,
                                                    stop_at_eos=False, draft_window=24), policy=policy)
    return plans, [s.token_ids for s in out.sequences]


def _same_plans(a, b):
    assert len(a[0]) == len(b[0]) > 0 and a[1] == b[1]
    for (ia, ca), (ib, cb) in zip(a[0], b[0], strict=True):
        assert torch.equal(ca, cb) and torch.equal(ia, ib)


@pytest.mark.usefixtures("cpu_paths")
def test_dustin_with_only_target_heads_is_dustin_t(engine):
    """No draft heads: dustin must not fill its m slots from an all-zero S_draft (arbitrary positions); its sets
    are dustin-t's, step for step (k = 32 < context, so the choice matters)."""
    cfg = SparseConfig(target=(ScoreHeads(2, (1, 6)),), draft=(), budget=32, draft_topm=6)
    policy = DustinSelection(cfg, "dustin")
    assert policy.m == 0 and not policy.uses_draft and policy.uses_target and policy.observes_prefill
    prompts = _prompts([150, 90], seed=3)
    plans = _recorded_plans(engine, policy, prompts)
    assert policy.draft_observers(None) == []
    _same_plans(plans, _recorded_plans(engine, DustinSelection(cfg, "dustin-t"), prompts))
    # both rows run for at least 16 / (Γ + 1) = 4 steps (a finished row leaves the batch: its slot is idle)
    assert all(c.tolist() == [32, 32] for _, c in plans[0][:4])


@pytest.mark.usefixtures("cpu_paths")
def test_dustin_with_only_draft_heads_is_dustin_d(engine):
    cfg = SparseConfig(target=(), draft=(ScoreHeads(1, (0, 5)),), budget=32, draft_topm=3)
    policy = DustinSelection(cfg, "dustin")
    assert policy.m == cfg.free_budget == 12 and policy.uses_draft and not policy.uses_target
    assert not policy.observes_prefill
    prompts = _prompts([150, 90], seed=4)
    plans = _recorded_plans(engine, policy, prompts)
    assert policy.target_observers(None) == []
    _same_plans(plans, _recorded_plans(engine, DustinSelection(cfg, "dustin-d"), prompts))


def test_dustin_variants_without_their_score_heads(engine, tmp_path):
    only_t = SparseConfig(target=(ScoreHeads(2, (1,)),), budget=32, draft_topm=0, source="t.json")
    only_d = SparseConfig(draft=(ScoreHeads(1, (0,)),), budget=32, draft_topm=0, source="d.json")
    with pytest.raises(InputError, match=r"d\.json has no target score heads, which dustin-t needs"):
        DustinSelection(only_d, "dustin-t")
    with pytest.raises(InputError, match=r"t\.json has no draft score heads, which dustin-d needs"):
        DustinSelection(only_t, "dustin-d")
    with pytest.raises(InputError, match="no target score heads, which dustin needs"):
        DustinSelection(SparseConfig(budget=32, draft_topm=0), "dustin")
    path = tmp_path / "draft_only.json"
    path.write_text(json.dumps({"draft": [{"layer": 1, "heads": [0]}], "budget": 32, "draft_topm": 4}))
    with pytest.raises(InputError, match="no target score heads"):
        _run(engine, _prompts([40]), method="dustin-t", sparse_config=str(path))
    assert engine.pair.make_policy(GenerationConfig(method="dustin", sparse_config=str(path))).m == 12
