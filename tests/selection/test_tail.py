"""The sampled, reweighted tail (dustin/selection/tail.py) and the plan's log-weights on the CPU path
(attention/backend.py `weighted_mask`)."""
from __future__ import annotations

import math

import pytest
import torch

from dustin.attention.backend import AttentionBackend, sparse_mask, weighted_mask
from dustin.attention.context import SparsePlan
from dustin.attention.reference import sparse_verify_attention_reference, verify_attention_reference
from dustin.cli.main import main
from dustin.engine.config import METHODS, GenerationConfig
from dustin.engine.request import SamplingParams
from dustin.errors import InputError
from dustin.selection.config import ORACLE_TAIL_ROWS, TailRow
from dustin.selection.tail import AdaptiveTail, DustinTail, LayerTailOracle, adaptive_m, draw_tail, tail_keys, with_tail
from tests.conftest import on_cpu_paths
from tests.offline import offline, random_prompts


def _prompts(lengths, seed=3):
    return random_prompts(lengths, seed)


def _cache(B, Hq, Hkv, T, D, lengths, gen):
    S = max(lengths) + T
    q = torch.randn(B, Hq, T, D, generator=gen)
    k = torch.randn(B, Hkv, S + 5, D, generator=gen)
    v = torch.randn(B, Hkv, S + 5, D, generator=gen)
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


# ---- the rows' keys


def test_row_keys_fixed_for_greedy_rows_and_the_seed_for_sampled_ones():
    """A greedy row's key is the same in any slot and batch; a sampled row's follows its own seed, not its slot."""
    from dustin.engine.sampling import RowSampling, SamplingRule

    hot = SamplingRule(temperature=0.8)
    a = RowSampling(3, SamplingRule(), None, seed=1)
    a.set_row(1, hot, seed=7)
    b = RowSampling(4, SamplingRule(), None, seed=2)
    b.set_row(3, hot, seed=7)
    b.set_row(0, hot, seed=8)
    ka, kb = a.row_keys(99).tolist(), b.row_keys(99).tolist()
    assert ka[0] == ka[2] == kb[1] == kb[2] == 99
    assert ka[1] == kb[3] != kb[0] and ka[1] != 99


# ---- names, the split, bad input


def test_tail_rows_are_methods_with_their_split():
    assert len(ORACLE_TAIL_ROWS) == 12 and all(METHODS[n].policy == n for n in ORACLE_TAIL_ROWS)
    assert ORACLE_TAIL_ROWS["oracle-dustin-tail"] == TailRow("dustin", 0.5)
    assert ORACLE_TAIL_ROWS["oracle-layer-tail75-w1"] == TailRow("layer", 0.75, weighted=False)
    assert ORACLE_TAIL_ROWS["oracle-dustin-tail-auto"] == TailRow("dustin", 0.5, adaptive=True)
    assert TailRow("dustin", 0.5).split(128, 21) == (64, 64)
    assert TailRow("dustin", 0.75).split(256, 21) == (64, 192)
    assert TailRow("layer", 0.75).split(129, 21) == (32, 97)  # m rounds, the exact part takes the rest
    assert METHODS["oracle-layer-tail"].draft_kv == "full" and METHODS["oracle-dustin-tail"].draft_kv == "streaming"


@pytest.mark.parametrize("share", [0.0, 1.0, -0.5, 1.5])
def test_a_share_outside_the_open_unit_interval_is_refused(share):
    with pytest.raises(InputError, match=r"share of the budget must be in \(0, 1\)"):
        TailRow("dustin", share)


def test_a_budget_too_small_for_its_split_is_one_error_line(capsys):
    with pytest.raises(InputError, match="leaves 16 exact positions and 48 sampled"):
        GenerationConfig(method="oracle-dustin-tail75", budget=64)
    GenerationConfig(method="oracle-dustin-tail75", budget=84)  # 21 exact + 63 sampled: fine
    code = main(["eval", "tasks", "--tasks", "fwe", "--rows", "vanilla,oracle-layer-tail75@64", "--samples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "leaves 16 exact positions" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_budget_auto_is_refused_for_tail_rows():
    with pytest.raises(InputError, match="--budget auto sizes Dustin's selection"):
        GenerationConfig(method="oracle-dustin-tail", budget="auto")


# ---- the weighted mask against the reference


def test_reference_weights_are_importance_weights():
    """The reference with log-weights is Σ w e^s v / Σ w e^s over the selected positions and the new tokens: a
    direct loop over one row."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, L = _cache(1, 2, 1, 2, 8, [30], gen)
    idx = torch.tensor([[0, 3, 7, 12, 20, 29]], dtype=torch.int32)
    lw = torch.tensor([[0.0, 0.0, math.log(4.0), math.log(4.0), 0.0, math.log(2.5)]])
    got = sparse_verify_attention_reference(q, k, v, L, idx, torch.tensor([6]), log_weights=lw)
    for h in range(2):
        for t in range(2):
            pos = idx[0].tolist() + list(range(30, 31 + t))
            w = torch.tensor(lw[0].exp().tolist() + [1.0] * (t + 1))
            e = w * (k[0, 0, pos] @ q[0, h, t] / math.sqrt(8)).exp()
            want = (e[:, None] * v[0, 0, pos]).sum(0) / e.sum()
            torch.testing.assert_close(got[0, h, t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_head", [False, True])
def test_weighted_sdpa_matches_the_reference_at_odd_shapes(per_head):
    """3 rows of different lengths (one with no picks), 6 query heads on 2 KV heads, T = 5, random log-weights,
    position 0 picked next to padding at 0, a pick past the row's length (ignored), and a dense row."""
    gen = torch.Generator().manual_seed(13)
    lengths = [90, 20, 57]
    B, Hkv, K = 3, 2, 30
    q, k, v, L = _cache(B, 6, Hkv, 5, 32, lengths, gen)
    H = Hkv if per_head else 1
    counts = torch.tensor([[25, 17], [7, 0], [30, 30]][:B], dtype=torch.int32)[:, :H]
    idx = torch.zeros(B, H, K, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            idx[b, h, : counts[b, h]] = torch.randperm(lengths[b], generator=gen)[: counts[b, h]].sort().values
    idx[0, 0, 0] = 0
    idx[2, 0, 29] = 70  # past row 2's 57 cached positions: not read
    bias = torch.randn(B, H, K, generator=gen).abs() * 2
    if not per_head:
        idx, counts, bias = idx[:, 0], counts[:, 0], bias[:, 0]
    plan = SparsePlan(idx, counts, bias=bias)
    S = max(lengths) + 5
    got = AttentionBackend("sdpa").sparse_verify(q, k, v, L, plan, max_len=S)
    want = sparse_verify_attention_reference(q, k, v, L, idx, counts, log_weights=bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, sparse_verify_attention_reference(q, k, v, L, idx, counts), atol=1e-3)
    # the mask sees exactly what the boolean one sees
    assert torch.equal(weighted_mask(L, plan, 5, S, torch.float32) > float("-inf"), sparse_mask(L, plan, 5, S))
    # zero weights: the boolean path's output; a dense row: full verification, its weights ignored
    zero = SparsePlan(idx, counts, bias=torch.zeros_like(bias))
    torch.testing.assert_close(AttentionBackend("sdpa").sparse_verify(q, k, v, L, zero, max_len=S),
                               AttentionBackend("sdpa").sparse_verify(q, k, v, L, SparsePlan(idx, counts), max_len=S),
                               rtol=1e-6, atol=1e-6)
    dense = torch.tensor([False, True, False])
    got = AttentionBackend("sdpa").sparse_verify(q, k, v, L, SparsePlan(idx, counts, dense, bias), max_len=S)
    torch.testing.assert_close(got[1], verify_attention_reference(q, k, v, L)[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


# ---- the draw and the plan's layout


def _exact(lengths, k, gen):
    """A per-sequence exact set: k random positions of each row (all of a row shorter than k), sorted, 0-padded."""
    idx = torch.zeros(len(lengths), k, dtype=torch.int32)
    counts = torch.tensor([min(k, n) for n in lengths], dtype=torch.int32)
    for b, n in enumerate(lengths):
        idx[b, : counts[b]] = torch.randperm(n, generator=gen)[: counts[b]].sort().values
    return SparsePlan(idx, counts)


@pytest.mark.parametrize("weighted", [True, False])
def test_plan_layout_at_odd_shapes(weighted):
    """Rows: R empty (L <= |S|), |R| < m, |R| > m, and one verified densely; 3 KV heads; m = 13."""
    gen = torch.Generator().manual_seed(7)
    lengths = [9, 25, 103, 77]
    exact = _exact(lengths, 17, gen)
    exact.dense = torch.tensor([False, False, False, True])
    seeds = torch.tensor([11, 12, 13, 14])
    plan = with_tail(exact, seeds, torch.tensor(lengths), layer=2, n_kv=3, max_len=110, m=13, weighted=weighted)
    assert plan.indices.shape == (4, 3, 30) and plan.bias.shape == (4, 3, 30) and plan.dense is exact.dense
    for b, n in enumerate(lengths):
        s = set(exact.indices[b, : exact.counts[b]].tolist())
        r = n - len(s)
        m = 0 if b == 3 else min(13, r)
        for h in range(3):
            c = int(plan.counts[b, h])
            got = plan.indices[b, h, :c].tolist()
            assert c == len(s) + m and got == sorted(set(got)) and s <= set(got) and max(got) < n
            assert plan.indices[b, h, c:].eq(0).all() and plan.bias[b, h, c:].eq(0).all()
            w = math.log(r / m) if weighted and m else 0.0
            for i, j in enumerate(got):
                assert float(plan.bias[b, h, i]) == pytest.approx(0.0 if j in s else w, abs=1e-6)
    assert float(plan.bias[1].max()) == 0.0  # |R| = 8 < m: all of R read, weight 1
    # the KV heads draw apart
    t2 = plan.indices[2]
    assert not torch.equal(t2[0], t2[1]) and not torch.equal(t2[1], t2[2])


def test_per_kv_head_exact_sets_keep_their_own_positions():
    gen = torch.Generator().manual_seed(9)
    a, b = _exact([60, 40], 21, gen), _exact([60, 40], 21, gen)
    exact = SparsePlan(torch.stack([a.indices, b.indices], 1), torch.stack([a.counts, b.counts], 1))
    plan = with_tail(exact, torch.tensor([1, 2]), torch.tensor([60, 40]), layer=0, n_kv=2, max_len=64, m=10)
    for r in range(2):
        for h, src in enumerate((a, b)):
            got = set(plan.indices[r, h, : plan.counts[r, h]].tolist())
            assert set(src.indices[r, : src.counts[r]].tolist()) <= got and len(got) == 31


def test_the_draw_is_row_local_and_deterministic():
    """A row's tail depends on its key, its length, the layer and the KV head only: not on the rows beside it,
    its place in the batch or the width of the cache; and it changes with each of those four."""
    gen = torch.Generator().manual_seed(1)
    lengths = [300, 120, 211]
    exact = _exact(lengths, 40, gen)
    seeds = torch.tensor([5, 5, 9])
    L = torch.tensor(lengths)
    batch = with_tail(exact, seeds, L, layer=4, n_kv=2, max_len=320, m=50)
    again = with_tail(exact, seeds, L, layer=4, n_kv=2, max_len=320, m=50)
    assert torch.equal(batch.indices, again.indices) and torch.equal(batch.bias, again.bias)
    for b in range(3):
        alone = with_tail(SparsePlan(exact.indices[b:b + 1], exact.counts[b:b + 1]), seeds[b:b + 1], L[b:b + 1],
                          layer=4, n_kv=2, max_len=lengths[b] + 3, m=50)
        assert torch.equal(alone.indices[0], batch.indices[b]) and torch.equal(alone.bias[0], batch.bias[b])
    flipped = with_tail(SparsePlan(exact.indices.flip(0), exact.counts.flip(0)), seeds.flip(0), L.flip(0), layer=4,
                        n_kv=2, max_len=400, m=50)
    assert torch.equal(flipped.indices.flip(0), batch.indices)
    keys = tail_keys(seeds, L, 4, 2)
    for other in (tail_keys(seeds + 1, L, 4, 2), tail_keys(seeds, L + 1, 4, 2), tail_keys(seeds, L, 5, 2)):
        assert (other != keys).all()
    assert keys[0, 0] != keys[0, 1]


def test_the_draw_is_uniform_over_the_rest():
    """1,000 draws of m = 10 from |R| = 50 (keys of 1,000 lengths): each position of R comes up ~200 times
    (binomial sd 12.6; the bound is 4 sd), and never a position outside R."""
    n, m = 60, 10
    outside = torch.ones(1000, 1, n, dtype=torch.bool)
    outside[:, :, ::6] = False  # 10 positions in S
    keys = tail_keys(torch.full((1000,), 3), torch.arange(1000), 0, 1)
    picks, r = draw_tail(keys, outside, m)
    assert (r == 50).all()
    hits = torch.bincount(picks[:, 0, :m].reshape(-1), minlength=n)
    assert hits[::6].sum() == 0
    assert (hits[outside[0, 0]] - 200).abs().max() < 50


# ---- the estimator


def _spread_out(gen, L=600, D=16):
    """One KV head, one query head, T = 1: scores spread over the whole context (N(0, 1)), a few heavy hitters."""
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    s = torch.randn(L + 1, generator=gen)
    s[[3, 100, 250, 420]] += 4.0
    k = torch.zeros(1, 1, L + 1, D)
    k[0, 0, :, 0] = s * math.sqrt(D)  # q . k / sqrt(D) = s
    v = torch.randn(1, 1, L + 1, D, generator=gen)
    return q, k, v, torch.tensor([L], dtype=torch.int32), s


def test_reweighting_removes_top_k_bias_on_spread_out_attention():
    """Exact attention against: top-32 alone, top-32 + a tail of 64 taken with weight 1, and the same tail
    reweighted by |R| / m. Over 300 draws, the reweighted estimate's mean is close to exact attention (its
    bias is O(1/m)), far closer than either biased estimate, and a single draw's error is smaller too."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, L, s = _spread_out(gen)
    exact = verify_attention_reference(q, k, v, L)[0, 0, 0]
    top = s[:600].topk(32).indices.sort().values
    plan = SparsePlan(top[None].to(torch.int32), torch.tensor([32], dtype=torch.int32))
    sdpa = AttentionBackend("sdpa")
    err_topk = float((sdpa.sparse_verify(q, k, v, L, plan, max_len=601)[0, 0, 0] - exact).norm())
    est = {True: [], False: []}
    for i in range(300):
        for weighted in (True, False):
            p = with_tail(plan, torch.tensor([i]), L, layer=0, n_kv=1, max_len=601, m=64, weighted=weighted)
            est[weighted].append(sdpa.sparse_verify(q, k, v, L, p, max_len=601)[0, 0, 0])
    mean_w = torch.stack(est[True]).mean(0)
    mean_1 = torch.stack(est[False]).mean(0)
    bias_w, bias_1 = float((mean_w - exact).norm()), float((mean_1 - exact).norm())
    single_w = float(torch.stack([(e - exact).norm() for e in est[True]]).mean())
    assert bias_w < 0.1 * err_topk and bias_w < 0.2 * bias_1, (bias_w, bias_1, err_topk)
    assert single_w < 0.7 * err_topk, (single_w, err_topk)


def test_a_tail_covering_the_rest_is_exact_attention():
    """m >= |R|: every position read with weight 1, the output is full verification's."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, L = _cache(2, 4, 2, 3, 16, [40, 33], gen)
    exact = _exact([40, 33], 21, gen)
    plan = with_tail(exact, torch.tensor([1, 2]), L, layer=0, n_kv=2, max_len=43, m=30)
    assert plan.counts.tolist() == [[40, 40], [33, 33]] and plan.bias.eq(0).all()
    torch.testing.assert_close(AttentionBackend("sdpa").sparse_verify(q, k, v, L, plan, max_len=43),
                               verify_attention_reference(q, k, v, L), rtol=1e-5, atol=1e-5)


def _adaptive_loop(q, k, exact_idx, exact_n, picks, r, cap, rule):
    """adaptive_m for one (row, KV head), written out: the rule of the module docstring."""
    Hq, T, D = q.shape
    n0 = min(max(math.ceil(rule.pilot * r), 2), cap, r)
    pilot = picks[:n0].tolist()
    ex = exact_idx[:exact_n].tolist()
    best = 0
    for h in range(Hq):
        for t in range(T):
            se = (k[ex] @ q[h, t] / math.sqrt(D)).double()
            sp = (k[pilot] @ q[h, t] / math.sqrt(D)).double()
            peak = max(se.max(), sp.max())
            e = (sp - peak).exp()
            total = (se - peak).exp().sum() + r * e.mean()
            n_inf = max(1.0, float((rule.z * e.std() * r / (rule.eps * total)) ** 2))
            best = max(best, math.ceil(n_inf / (1 + (n_inf - 1) / r)))
    return min(max(best, n0), cap, r)


def test_adaptive_m_against_a_loop_and_its_extremes():
    gen = torch.Generator().manual_seed(4)
    B, Hkv, G, T, D, n = 3, 2, 3, 5, 16, 400
    q = torch.randn(B, Hkv * G, T, D, generator=gen)
    k = torch.randn(B, Hkv, n, D, generator=gen)
    lengths = [400, 260, 30]
    exact = _exact(lengths, 24, gen)
    idx = exact.indices[:, None].expand(-1, Hkv, -1)
    valid = torch.arange(24)[None, None] < exact.counts[:, None, None]
    outside = torch.ones(B, Hkv, n, dtype=torch.bool)
    for b, L in enumerate(lengths):
        outside[b, :, L:] = False
        outside[b, :, idx[b, 0, : exact.counts[b]].long()] = False
    picks, r = draw_tail(tail_keys(torch.tensor([1, 2, 3]), torch.tensor(lengths), 0, Hkv), outside, 100)
    rule = AdaptiveTail()
    m = adaptive_m(q, k, idx, valid, picks, r, 100, rule)
    for b in range(B):
        for h in range(Hkv):
            want = _adaptive_loop(q[b, h * G:(h + 1) * G], k[b, h], idx[b, h], int(exact.counts[b]), picks[b, h],
                                  int(r[b, h]), 100, rule)
            assert int(m[b, h]) == want
    # attention on one exact position: the pilot is enough; flat attention over R with nothing exact: the cap
    q1 = torch.zeros(1, 1, 1, D)
    q1[..., 0] = 1.0
    k1 = torch.zeros(1, 1, n, D)
    k1[0, 0, 5, 0] = 60.0
    picks1, r1 = draw_tail(tail_keys(torch.tensor([1]), torch.tensor([n]), 0, 1),
                           torch.arange(n)[None, None] != 5, 100)
    one = torch.tensor([[[5]]])
    assert int(adaptive_m(q1, k1, one, torch.ones(1, 1, 1, dtype=torch.bool), picks1, r1, 100, rule)) == 8
    k1[0, 0, :, 0] = torch.randn(n, generator=gen) * 8  # log-normal scores, sd 2
    assert int(adaptive_m(q1, k1, one, torch.zeros(1, 1, 1, dtype=torch.bool), picks1, r1, 100, rule)) == 100
    empty = adaptive_m(q1, k1, one, torch.ones(1, 1, 1, dtype=torch.bool), picks1, torch.zeros(1, 1, dtype=torch.long),
                       100, rule)
    assert int(empty) == 0


# ---- end to end on the tiny pair


WHOLE = _prompts([60, 97, 130])
WHOLE_RUN = dict(stop_at_eos=False, max_new_tokens=24, gamma=3, temperature=0.0)


@pytest.fixture(scope="module")
def vanilla_whole(engine):
    """Vanilla's output for WHOLE, computed once for the three rows compared with it."""
    with on_cpu_paths():
        return engine.generate(WHOLE, *offline(method="vanilla", **WHOLE_RUN))


@pytest.mark.usefixtures("cpu_paths")
@pytest.mark.parametrize("method", ["oracle-layer-tail75", "oracle-dustin-tail75", "oracle-dustin-tail75-w1"])
def test_weight_one_over_the_whole_context_is_vanilla(engine, tiny_sparse_config, vanilla_whole, method):
    """k = 200 split 50 exact + 150 sampled over contexts of 60-160 positions: the tail takes all of R with weight
    1 every step, through the float-mask path, and the greedy text is vanilla's token for token."""
    prompts, vanilla = WHOLE, vanilla_whole
    tail_cfg, params = offline(method=method, budget=200, sparse_config=tiny_sparse_config, **WHOLE_RUN)
    policy = engine.pair.make_policy(tail_cfg)
    plans = []
    tailed = policy._tailed

    def recording(exact, layer, q, ctx):
        plans.append(tailed(exact, layer, q, ctx))
        return plans[-1]

    policy._tailed = recording
    out = engine.generate(prompts, tail_cfg, params, policy=policy)
    assert [s.token_ids for s in out.sequences] == [s.token_ids for s in vanilla.sequences]
    assert plans and all(p.bias is not None and p.bias.eq(0).all() for p in plans)
    assert any(int(p.counts.max()) > 50 for p in plans)  # the tail was drawn (|S| = 50)


@pytest.mark.usefixtures("cpu_paths")
@pytest.mark.parametrize("method", ["oracle-dustin-tail", "oracle-layer-tail-auto"])
def test_greedy_tail_rows_are_the_same_alone_batched_and_run_to_run(engine, tiny_sparse_config, method):
    prompts = _prompts([150, 210, 90], seed=8)
    cfg = offline(method=method, budget=64, sparse_config=tiny_sparse_config, stop_at_eos=False, max_new_tokens=16,
                  gamma=3, temperature=0.0)
    batch = [s.token_ids for s in engine.generate(prompts, *cfg).sequences]
    assert batch == [s.token_ids for s in engine.generate(prompts, *cfg).sequences]
    assert batch == [engine.generate([p], *cfg).sequences[0].token_ids for p in prompts]
    vanilla = engine.generate(prompts, *offline(method="vanilla", max_new_tokens=16, stop_at_eos=False))
    assert batch != [s.token_ids for s in vanilla.sequences]  # 64 of 90-226 positions: the tail really changes it


@pytest.mark.usefixtures("cpu_paths")
def test_positions_read_are_reported(engine, tiny_sparse_config):
    """budget_stats: positions per (sequence, step, layer, KV head): |S| + m for the fixed rows, |S| + the m used
    (between the pilot and the cap) for the adaptive one."""
    prompts = _prompts([150, 210])
    base = dict(budget=64, sparse_config=tiny_sparse_config, gamma=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fixed = engine.generate(prompts, GenerationConfig(method="oracle-dustin-tail", **base), params)
    assert fixed.budget_k["mean"] == 64 and fixed.budget_k["samples"] % (3 * 2) == 0  # 3 layers x 2 KV heads
    policy = engine.pair.make_policy(GenerationConfig(method="oracle-dustin-tail-auto", **base))
    assert isinstance(policy, DustinTail) and (policy.exact_k, policy.tail_m) == (32, 32)
    auto = engine.generate(prompts, GenerationConfig(method="oracle-dustin-tail-auto", **base), params, policy=policy)
    assert 32 + 2 < auto.budget_k["mean"] <= 64
    assert isinstance(engine.pair.make_policy(GenerationConfig(method="oracle-layer-tail", **base)), LayerTailOracle)


@pytest.mark.usefixtures("cpu_paths")
@pytest.mark.parametrize("budget", [96, 128])
def test_every_row_reads_its_budget_at_the_backend(engine, tiny_sparse_config, monkeypatch, budget):
    """Equal positions read at equal budget, counted where the verify reads them: the distinct cached positions
    each sparse-verify call lets a row and KV head attend (the plan's mask, not what the policy says it read), for
    the rows of the CPU eval built as `eval tasks` builds them (`row_config`). Every running row reads exactly the
    budget in every layer and KV head (all prompts are longer), at both budgets: a row does not fall back to some
    other k. A finished row's slot is parked at length 1 until the batch ends, and reads that one position."""
    from types import SimpleNamespace

    from dustin.eval.sweep import row_config

    reads: list[torch.Tensor] = []
    verify = AttentionBackend.sparse_verify

    def counting(self, q, k_cache, v_cache, lengths, plan, *, max_len):
        T = q.shape[2]
        seen = sparse_mask(lengths, plan, T, max_len)[:, :, 0]  # the first query: the cached positions + itself
        cached = torch.arange(max_len)[None, None, :] < lengths.long()[:, None, None]
        n = (seen & cached).sum(-1).expand(-1, k_cache.shape[1])  # [B, Hkv]
        reads.append(torch.stack([n, lengths.long()[:, None].clamp_max(budget).expand_as(n)]))
        return verify(self, q, k_cache, v_cache, lengths, plan, max_len=max_len)

    monkeypatch.setattr(AttentionBackend, "sparse_verify", counting)
    args = SimpleNamespace(gamma=3, draft_window=512, config=tiny_sparse_config, seed=0)
    prompts = _prompts([150, 210, 180], seed=5)
    for method in ("dustin", "oracle-layer", "oracle-layer-tail", "oracle-dustin-tail", "oracle-dustin-tail-w1",
                   "oracle-dustin-tail75", "oracle-layer-tail75"):
        reads.clear()
        engine.generate(prompts, row_config(method, budget, args), SamplingParams(max_tokens=8, temperature=0.0,
                                                                                  ignore_eos=True))
        assert reads and len(reads) % 3 == 0, method  # every one of the 3 layers verifies sparsely, every step
        n, want = torch.cat(reads, dim=1)
        assert torch.equal(n, want), method
        assert (n == budget).float().mean() > 0.5, method  # mostly running rows, each read at the budget
