"""dustin-anchor (dustin/selection/anchors.py): anchor layers pick the sets of the layers above them."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from dustin.engine.config import METHODS, GenerationConfig
from dustin.engine.engine import Engine
from dustin.errors import InputError
from dustin.models.loader import load_model
from dustin.selection import anchors as anchors_mod
from dustin.selection.anchors import AnchorSelection, anchor_scores, anchor_set, layer_anchors
from dustin.selection.config import AnchorConfig, ScoreHeads, SparseConfig, default_anchor_layers
from dustin.selection.ladder import rung_set
from dustin.selection.oracle import window_probs
from dustin.selection.policies import POLICIES, make_policy


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return Engine(load_model(tiny_pair[0]), load_model(tiny_pair[1]))


def _prompts(lengths):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def _config(tmp_path, **anchor) -> str:
    """The tiny pair's sparse config (3 target layers of 8 heads on 2 KV heads) with an anchor block."""
    cfg = {"target": [{"layer": 2, "heads": [1, 6]}], "draft": [{"layer": 0, "heads": [3]}, {"layer": 1, "heads": [0]}],
           "budget": 48, "draft_topm": 12, "sinks": 4, "window": 16, "anchor": anchor}
    path = tmp_path / "anchor.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _reference_scores(q, k, L, granularity, w=4):
    """Loop over rows, heads and the first w queries (query t at L + t sees keys j <= L + t): each head's softmax
    on the cached positions j < L, summed over the queries and the heads of a KV head (or of the layer)."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    rows = k.shape[1] if granularity == "kv" else 1
    out = torch.zeros(B, rows, k.shape[2])
    for b in range(B):
        for h in range(Hq):
            for t in range(min(w, T)):
                n = int(L[b]) + t + 1
                a = (q[b, h, t].float() @ k[b, h // G, :n].float().T / D ** 0.5).softmax(-1)
                out[b, h // G if rows > 1 else 0, : int(L[b])] += a[: int(L[b])]
    return out


def _case(hq=6, hkv=2, D=16, dtype=torch.float32):
    torch.manual_seed(0)
    B, T, S_cap = 3, 5, 96
    q = torch.randn(B, hq, T, D).to(dtype)
    k = torch.randn(B, hkv, S_cap, D).to(dtype)
    L = torch.tensor([70, 33, 52], dtype=torch.int32)
    pos = L.long()[:, None] + torch.arange(T)[None]
    return q, k, L, pos


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("granularity", ["kv", "layer"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 2)])
def test_anchor_scores_against_a_loop(monkeypatch, path, granularity, heads):
    """Rows of different lengths, GQA 6:2 and 4:2, T = 5 verify queries (the first 4 count): the Triton kernel
    (interpreter) over the cache capacity and the fp32 PyTorch path over max_len, against the loop."""
    if path == "torch":
        monkeypatch.setattr(anchors_mod, "triton_ok", lambda q: False)
    q, k, L, pos = _case(*heads)
    max_len = int(L.max()) + 5
    got = anchor_scores(q, k, L, pos, max_len, granularity)
    want = _reference_scores(q, k, L, granularity)
    assert got.shape == (3, 2 if granularity == "kv" else 1, k.shape[2] if path == "triton" else max_len)
    torch.testing.assert_close(got, want[..., : got.shape[-1]], rtol=1e-4, atol=1e-5)
    assert not got[..., max_len:].any()


def test_anchor_scores_bf16_cache():
    """bf16 queries and cache (the kernel's inputs on a GPU): the fp32 loop's scores on the same bf16 values."""
    q, k, L, pos = _case(dtype=torch.bfloat16)
    got = anchor_scores(q, k, L, pos, int(L.max()) + 5, "kv")
    torch.testing.assert_close(got, _reference_scores(q, k, L, "kv"), rtol=2e-2, atol=1e-3)


def _reference_set(scores, L, k, sinks, window, picks):
    """Per row: sinks + window, the draft picks that are pickable, the top of the scores for the rest of k."""
    out = []
    for b in range(scores.shape[0]):
        n = int(L[b])
        if n <= k:
            out.append([set(range(n))] * scores.shape[1])
            continue
        protected = set(range(sinks)) | set(range(n - window, n))
        drafted = {int(j) for j in picks[b] if sinks <= int(j) < n - window} if picks is not None else set()
        row = []
        for r in range(scores.shape[1]):
            rest = sorted((j for j in range(n) if j not in protected | drafted), key=lambda j: -float(scores[b, r, j]))
            row.append(protected | drafted | set(rest[: k - len(protected | drafted)]))
        out.append(row)
    return out


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("rows", [2, 1])
@pytest.mark.parametrize("m", [0, 5])
def test_anchor_set_against_a_loop(monkeypatch, kernel, rows, m):
    """k = 29 (not a power of two) of up to 70 positions, one row within k; per KV head and per layer; with and
    without S_draft picks (the Triton selection kernels under the interpreter, and the torch path)."""
    import dustin.kernels.selection as sel

    if not kernel:
        monkeypatch.setattr(sel, "sort_row_width", lambda *a: 1 << 20)  # > 4096: the torch path
    torch.manual_seed(1)
    L = torch.tensor([70, 25, 52], dtype=torch.int32)
    scores = torch.rand(3, rows, 80)
    picks = torch.stack([torch.randperm(int(n) - 20)[:m] + 4 for n in L]) if m else None
    plan = anchor_set(scores.clone(), L, 29, 4, 16, picks)
    want = _reference_set(scores, L, 29, 4, 16, picks)
    idx = plan.indices if rows > 1 else plan.indices[:, None]
    counts = plan.counts if rows > 1 else plan.counts[:, None]
    for b in range(3):
        for r in range(rows):
            chosen = idx[b, r, : int(counts[b, r])].tolist()
            assert chosen == sorted(want[b][r]), (b, r)


@pytest.mark.parametrize("kernel", [True, False])
def test_one_sequence_sets_per_kv_head_use_its_own_length(monkeypatch, kernel):
    """A batch of one row with two KV heads: each head's set stays inside the row's own length, equal to that
    row's sets in a batch of three (its per-head lengths were once a stride-0 view, and the selection kernel read
    the next sequence's length for the second head)."""
    import dustin.kernels.selection as sel

    if not kernel:
        monkeypatch.setattr(sel, "sort_row_width", lambda *a: 1 << 20)
    torch.manual_seed(2)
    L = torch.tensor([70, 25, 52], dtype=torch.int32)
    scores = torch.rand(3, 2, 80)
    alone = anchor_set(scores[:1].clone(), L[:1], 29, 4, 16)
    batch = anchor_set(scores.clone(), L, 29, 4, 16)
    assert torch.equal(alone.indices[0], batch.indices[0]) and torch.equal(alone.counts[0], batch.counts[0])
    want = _reference_set(scores[:1], L[:1], 29, 4, 16, None)
    assert [sorted(x) for x in want[0]] == [alone.indices[0, r].tolist() for r in range(2)]


@pytest.mark.parametrize("granularity", ["kv", "layer"])
def test_an_anchor_picks_the_ladders_oracle_set(granularity):
    """At an anchor layer the set is the oracle ladder's rung of the same granularity (selection/ladder.py)."""
    q, k, L, pos = _case()
    scores = anchor_scores(q, k, L, pos, int(L.max()) + 5, granularity)
    mine = anchor_set(scores, L, 29, 4, 8)
    rung = rung_set(window_probs(q, k, L, int(L.max()) + 5), 2, granularity, L, 29, 4, 8)
    assert torch.equal(mine.indices, rung.indices) and torch.equal(mine.counts, rung.counts)


def test_layer_anchors_map():
    assert layer_anchors((1, 3), 1, 6) == [None, 1, 1, 3, 3, 3]
    assert layer_anchors((0, 2), 2, 5) == [None, None, 2, 2, 2]  # a dense anchor still serves the layers above
    assert default_anchor_layers(28) == (1, 5, 10, 16) and default_anchor_layers(3) == (1, 2)
    assert default_anchor_layers(1) == (0,)


def test_method_registered_once():
    assert METHODS["dustin-anchor"].policy == "dustin-anchor" and METHODS["dustin-anchor"].draft_kv == "streaming"
    assert POLICIES.count("dustin-anchor") == 1
    assert isinstance(make_policy("dustin-anchor", SparseConfig()), AnchorSelection)


@pytest.mark.parametrize("anchor", [
    {},
    {"layers": [0, 2], "granularity": "layer", "dense_layers": 1},
    {"layers": [1], "granularity": "kv", "dense_layers": 2, "draft_topm": 8},
])
def test_budget_above_context_is_exactly_classic(engine, tmp_path, anchor):
    """With k >= every sequence's length every layer's set is the whole cache: classic's output."""
    prompts = _prompts([20, 47, 9])
    cfg = dict(stop_at_eos=False, max_new_tokens=24, gamma=3, temperature=0.0, draft_kv="full")
    classic = engine.generate(prompts, GenerationConfig(method="classic", **cfg))
    out = engine.generate(prompts, GenerationConfig(method="dustin-anchor", budget=200,
                                                    sparse_config=_config(tmp_path, **anchor), **cfg))
    assert [s.token_ids for s in out.sequences] == [s.token_ids for s in classic.sequences]


@pytest.mark.parametrize("granularity", ["kv", "layer"])
def test_small_budget_dense_layers_and_reuse(engine, tmp_path, granularity):
    """At k far below the context: the dense layer gets None, each anchor its own set (per KV head for "kv"),
    and a layer above an anchor exactly that anchor's set."""
    path = _config(tmp_path, layers=[1, 2], granularity=granularity, dense_layers=1)
    prompts = _prompts([150, 210])
    cfg = GenerationConfig(method="dustin-anchor", gamma=3, max_new_tokens=8, stop_at_eos=False, budget=32,
                           sparse_config=path, temperature=0.0)
    policy = engine.make_policy(cfg)
    assert isinstance(policy, AnchorSelection) and policy.graph_safe
    seen: dict[int, list] = {}
    plan_layer = policy.plan_layer

    def recording(layer, q, ctx):
        p = plan_layer(layer, q, ctx)
        seen.setdefault(layer, []).append(p)
        return p

    policy.plan_layer = recording
    core = engine.start(prompts, cfg, policy=policy)
    core.step()  # the prefill and step 1
    core.step()
    assert set(seen) == {0, 1, 2} and seen[0] == [None, None]
    shape = (2, engine.target.args.n_kv_heads, 32) if granularity == "kv" else (2, 32)
    for step in range(2):
        one, two = seen[1][step], seen[2][step]
        assert one.indices.shape == shape and two.indices.shape == shape
        assert not torch.equal(one.indices, two.indices)  # each anchor its own set
    if granularity == "kv":
        assert not torch.equal(seen[1][0].indices[:, 0], seen[1][0].indices[:, 1])

    # layers 2 and 3 of a deeper stack reuse anchor 1: the map, then the plan object itself
    policy2 = AnchorSelection(SparseConfig.load(_config(tmp_path, layers=[1], dense_layers=1)))
    policy2.resolve_layers(4)
    assert policy2.anchors == (1,)
    policy2.plans[1] = seen[1][0]
    assert policy2.plan_layer(0, None, None) is None
    assert policy2.plan_layer(2, None, None) is seen[1][0] and policy2.plan_layer(3, None, None) is seen[1][0]


def test_kernel_path_in_the_engine_gives_the_torch_paths_tokens(tmp_path_factory, monkeypatch):
    """A tiny pair with D = 16 (4 heads on 2 KV heads) takes the Triton score kernel (interpreter) inside the
    verify forward, on the queries the model hands its planner: the same tokens as the fp32 PyTorch path at k = 32
    of 90-120 positions. (The selection runs its torch path here: its kernels' sort is slow in the interpreter,
    and `test_anchor_set_against_a_loop` covers them.)"""
    import dustin.kernels.selection as sel
    from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

    monkeypatch.setattr(sel, "sort_row_width", lambda *a: 1 << 20)

    root = tmp_path_factory.mktemp("d16")
    target = make_tiny_checkpoint(root / "target", "qwen2", layers=3, heads=4, kv_heads=2, seed=3)
    e = Engine(load_model(target), load_model(make_tiny_draft(target, root / "draft", noise=0.1)))
    cfg = {"target": [{"layer": 2, "heads": [1]}], "draft": [{"layer": 0, "heads": [3]}], "budget": 32,
           "draft_topm": 0, "anchor": {"layers": [1, 2], "granularity": "kv", "draft_topm": 4}}
    path = root / "cfg.json"
    path.write_text(json.dumps(cfg))
    gen = GenerationConfig(method="dustin-anchor", gamma=3, max_new_tokens=6, stop_at_eos=False,
                           sparse_config=str(path), temperature=0.0)
    prompts = _prompts([90, 120])
    import dustin.kernels.score_estimation as se

    real, anchor_calls = se.attention_scores_multi, []
    monkeypatch.setattr(se, "attention_scores_multi",  # the anchors' calls are the ones that set group_heads
                        lambda *a, **k: anchor_calls.append("group_heads" in k) or real(*a, **k))
    kernel = e.generate(prompts, gen)
    assert any(anchor_calls)
    monkeypatch.setattr(anchors_mod, "triton_ok", lambda q: False)
    torch_path = e.generate(prompts, gen)
    assert [s.token_ids for s in kernel.sequences] == [s.token_ids for s in torch_path.sequences]


def test_draft_picks_are_in_every_set(engine, tmp_path):
    """With an anchor draft_topm, S_draft's top-m pickable positions are in every sparse layer's set."""
    path = _config(tmp_path, layers=[1], dense_layers=1, draft_topm=10)
    cfg = GenerationConfig(method="dustin-anchor", gamma=3, max_new_tokens=8, stop_at_eos=False, budget=40,
                           sparse_config=path, temperature=0.0)
    policy = engine.make_policy(cfg)
    assert policy.m == 7  # 10 of the file's 28 unprotected positions (k = 48), scaled to k = 40's 20
    sets = []
    plan_layer = policy.plan_layer
    policy.plan_layer = lambda layer, q, ctx: sets.append(plan_layer(layer, q, ctx)) or sets[-1]
    engine.start(_prompts([150, 210]), cfg, policy=policy).step()  # the prefill and step 1
    picks = policy.draft_picks
    assert picks.shape == (2, 7)
    for plan in sets[1:]:
        for b in range(2):
            for r in range(plan.indices.shape[1]):
                assert set(picks[b].tolist()) <= set(plan.indices[b, r].tolist())


def test_config_round_trip_and_old_files(tmp_path):
    """The anchor block round-trips through JSON; a file without one (the shipped tuned config) loads with the
    defaults; --budget scales the anchors' m like m."""
    from dustin.selection.tuned import CONFIG_DIR

    shipped = SparseConfig.load(next(CONFIG_DIR.glob("*.json")))
    assert shipped.anchor == AnchorConfig()
    cfg = SparseConfig(target=(ScoreHeads(2, (1,)),), draft=(ScoreHeads(0, (3,)),), budget=512, draft_topm=100,
                       anchor=AnchorConfig(layers=(1, 5), granularity="layer", dense_layers=2, draft_topm=246))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_json()))
    assert SparseConfig.load(path) == cfg
    assert cfg.with_budget(1044).anchor.draft_topm == 512 and cfg.with_budget(1044).draft_topm == 208
    assert cfg.with_budget(1044).anchor.layers == (1, 5)


@pytest.mark.parametrize(("anchor", "message"), [
    ({"granularity": "head"}, "granularity 'head' must be one of kv, layer"),
    ({"layers": [3, 1]}, "non-empty ascending list"),
    ({"layers": []}, "non-empty ascending list"),
    ({"layers": [-1, 2]}, "non-empty ascending list"),
    ({"layers": [2, 5], "dense_layers": 1}, "first anchor layer (2) must be <= dense_layers (1)"),
    ({"dense_layers": -1}, "dense_layers (-1) must be >= 0"),
    ({"draft_topm": 29}, "anchor draft_topm (29) must be in [0, budget - sinks - window = 28]"),
    ({"lyers": [1]}, "unknown anchor setting 'lyers'"),
    ({"layers": "1,2"}, "malformed"),
])
def test_bad_anchor_settings_are_one_error_line(tmp_path, anchor, message):
    with pytest.raises(InputError) as e:
        SparseConfig.load(_config(tmp_path, **anchor))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_anchor_out_of_range_and_draft_heads_needed(engine, tmp_path):
    cfg = GenerationConfig(method="dustin-anchor", sparse_config=_config(tmp_path, layers=[1, 3]))
    with pytest.raises(InputError, match=r"anchor layers \[3\] out of range \(the target has 3 layers\)"):
        engine.make_policy(cfg)
    with pytest.raises(InputError, match="no draft score heads, which dustin-anchor's anchor draft_topm"):
        AnchorSelection(SparseConfig(budget=64, draft_topm=0, anchor=AnchorConfig(draft_topm=4)))


def test_roofline_counts_dense_layers_and_anchor_keys(engine):
    from dustin.bench.roofline import step_bytes

    t, d = engine.target, engine.draft
    B, ctx, gamma = 2, 1000, 4
    cfg = SparseConfig(budget=128, draft_topm=0, anchor=AnchorConfig(layers=(1, 2), dense_layers=1))
    per_layer = t.args.kv_bytes_per_token(4) // t.args.n_layers  # fp32 tiny model
    base = step_bytes("dustin-t", t, d, B, ctx, gamma, sparse_cfg=cfg)  # no score heads: the verify set only
    got = step_bytes("dustin-anchor", t, d, B, ctx, gamma, sparse_cfg=cfg)
    assert got.target == base.target + B * per_layer * (ctx - (128 + gamma + 1))
    assert got.estimate == 2 * B * ctx * per_layer // 2 and got.draft == base.draft


def test_choose_anchors_is_the_best_layout():
    """The dynamic programme equals a brute force over every layout of n anchors (first at or below layer 1)."""
    from dustin.profiling.anchors import choose_anchors

    torch.manual_seed(2)
    n = 8
    R = torch.rand(n, n).triu()
    R[torch.ones(n, n).tril(-1).bool()] = float("nan")
    for na in (1, 2, 3):
        best = max((sum(float(R[[a for a in combo if a <= lyr][-1], lyr]) for lyr in range(1, n)), combo)
                   for combo in itertools.combinations(range(n), na) if combo[0] <= 1)
        layers, value = choose_anchors(R, na, dense_layers=1)
        assert layers == best[1] and value == pytest.approx(best[0])
