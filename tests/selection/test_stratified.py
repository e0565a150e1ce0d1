"""The engine's sampled tail (`--method dustin` with tail_share; dustin/selection/stratified.py): the draw against a
loop reference, its inclusion probabilities, the plan's layout, and the engine's output (vanilla's where the tail
covers the rest, the same alone, batched and run to run, the step graph's on the GPU path's CPU stand-in)."""
from __future__ import annotations

import json

import pytest
import torch

from dustin.attention.backend import sparse_mask
from dustin.attention.context import SparsePlan
from dustin.cli.main import main
from dustin.engine.config import METHODS, GenerationConfig
from dustin.errors import InputError
from dustin.rng import below, counter_bits
from dustin.selection.config import DUSTIN_TAIL_ROWS, SparseConfig
from dustin.selection.policies import DustinSelection
from dustin.selection.stratified import stratified_tail
from tests.offline import offline, random_prompts


def _exact(lengths, k, seed=0):
    """One sorted exact set per row: the first 2 positions and random others, k per row (all of a shorter row)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.zeros(len(lengths), k, dtype=torch.int32)
    cnt = torch.zeros(len(lengths), dtype=torch.int32)
    for b, n in enumerate(lengths):
        if n <= k:
            row = list(range(n))
        else:
            row = sorted({0, 1, *(2 + torch.randperm(n - 2, generator=g)[: k - 2]).tolist()})
        idx[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        cnt[b] = len(row)
    return SparsePlan(idx, cnt)


def _reference(exact, keys, lengths, n_layers, n_kv, m, head_offset=0, heads_total=None):
    """A loop over rows, layers and heads: R in order, cut into min(m, |R|) strata of sizes floor or ceil |R| / m,
    one uniform pick per stratum from the same counter bits; the plan's sorted (position, log-weight) lists."""
    H = heads_total or n_kv
    out = {}
    for b, L in enumerate(lengths.tolist()):
        s = exact.indices[b, : int(exact.counts[b])].tolist()
        rest = [p for p in range(L) if p not in set(s)]
        used = min(m, len(rest))
        row = counter_bits(keys[b:b + 1].long(), lengths[b:b + 1].long(), 1)[:, 0]
        heads = counter_bits(row, torch.zeros(1, dtype=torch.long), n_layers * H)[0]
        for layer in range(n_layers):
            for h in range(n_kv):
                bits = counter_bits(heads[layer * H + head_offset + h].view(1), torch.zeros(1, dtype=torch.long), m)[0]
                picks = []
                for i in range(used):
                    lo, hi = i * len(rest) // used, (i + 1) * len(rest) // used
                    picks.append((rest[lo + int(below(bits[i], torch.tensor(hi - lo)))], float(hi - lo)))
                out[b, layer, h] = sorted([(p, 1.0) for p in s] + picks)
    return out


@pytest.mark.parametrize("heads", [(0, None), (3, 8)])
def test_draw_matches_the_loop_at_odd_shapes(heads):
    """Rows longer and shorter than the budget, a row whose rest is smaller than m (all of it, weight 1), a dense
    row (no tail); a device's slice of the KV heads draws what a single device draws for them."""
    offset, total = heads
    lengths = torch.tensor([97, 40, 23, 61])
    exact = _exact(lengths.tolist(), 24)
    exact.dense = torch.tensor([False, False, False, True])
    keys = torch.tensor([5, 6, 7, 8])
    plan = stratified_tail(exact, keys, lengths, n_layers=3, n_kv=2, m=11, head_offset=offset, heads_total=total)
    assert plan.per_layer and plan.indices.shape == (3, 4, 2, 35) and plan.bias.shape == (3, 4, 2, 35)
    ref = _reference(SparsePlan(exact.indices, exact.counts), keys, lengths, 3, 2, 11, offset, total)
    for (b, layer, h), want in ref.items():
        n = int(plan.counts[layer, b, h])
        got = list(zip(plan.indices[layer, b, h, :n].tolist(), plan.bias[layer, b, h, :n].exp().tolist(),
                       strict=True))
        if b == 3:  # dense: the exact set only
            assert n == int(exact.counts[3])
            continue
        assert [p for p, _ in got] == [p for p, _ in want]
        assert [w for _, w in got] == pytest.approx([w for _, w in want])
        assert plan.indices[layer, b, h, n:].eq(0).all() and plan.bias[layer, b, h, n:].eq(0).all()
    assert plan.counts[:, 1].eq(24 + 11).all() and plan.counts[:, 2].eq(23).all()  # 40 - 24 >= 11; 23 <= 24
    # every layer and head draws its own positions
    assert not torch.equal(plan.indices[0, 0, 0], plan.indices[1, 0, 0])
    assert not torch.equal(plan.indices[0, 0, 0], plan.indices[0, 0, 1])


def test_a_device_slice_is_the_single_device_draw():
    lengths, keys = torch.tensor([130, 77]), torch.tensor([1, 2])
    exact = _exact(lengths.tolist(), 30, seed=4)
    whole = stratified_tail(exact, keys, lengths, n_layers=2, n_kv=4, m=20)
    for rank in range(2):
        part = stratified_tail(exact, keys, lengths, n_layers=2, n_kv=2, m=20, head_offset=2 * rank, heads_total=4)
        assert torch.equal(part.indices, whole.indices[:, :, 2 * rank:2 * rank + 2])
        assert torch.equal(part.bias, whole.bias[:, :, 2 * rank:2 * rank + 2])


def test_inclusion_probabilities_are_the_inverse_weights():
    """Over many keys, each position of R is drawn with probability 1 / (its stratum's size): the weights make
    the tail's sum of any function over R unbiased (Horvitz-Thompson), here checked on the sum of positions."""
    L, m, n = 53, 7, 4000
    exact = _exact([L], 12, seed=2)
    s = set(exact.indices[0, :12].tolist())
    rest = [p for p in range(L) if p not in s]
    hits = torch.zeros(L)
    estimates = []
    for key in range(n):
        plan = stratified_tail(exact, torch.tensor([key]), torch.tensor([L]), n_layers=1, n_kv=1, m=m)
        c = int(plan.counts[0, 0, 0])
        pos, w = plan.indices[0, 0, 0, :c].long(), plan.bias[0, 0, 0, :c].exp()
        tail = torch.tensor([p not in s for p in pos.tolist()])
        hits[pos[tail]] += 1
        estimates.append(float((w[tail] * pos[tail].float()).sum()))
        assert len(set(pos.tolist())) == c  # no position twice
    sizes = torch.tensor([len(rest) // m + (1 if i >= m - len(rest) % m else 0) for i in range(m)])
    assert sorted(sizes.tolist()) == sorted([(i + 1) * len(rest) // m - i * len(rest) // m for i in range(m)])
    p = hits[rest] / n
    expected = torch.tensor([1.0 / ((i + 1) * len(rest) // m - i * len(rest) // m)
                             for i in range(m) for _ in range(i * len(rest) // m, (i + 1) * len(rest) // m)])
    assert torch.allclose(p, expected, atol=4 * (0.25 / n) ** 0.5)
    mean = torch.tensor(estimates).mean()
    assert abs(float(mean) - sum(rest)) < 0.02 * sum(rest)


def test_the_split_and_its_errors():
    cfg = SparseConfig(budget=128, draft_topm=32, tail_share=0.5)
    assert cfg.tail_split() == (64, 64)
    exact = cfg.exact_part()
    assert (exact.budget, exact.tail_share) == (64, 0.0) and exact.draft_topm == round(32 / 108 * 44)
    assert SparseConfig(budget=128, draft_topm=32).exact_part() == SparseConfig(budget=128, draft_topm=32)
    with pytest.raises(InputError, match="leaves 20 exact positions"):
        SparseConfig(budget=40, draft_topm=0, tail_share=0.5)
    with pytest.raises(InputError, match=r"tail_share must be in \[0, 1\)"):
        SparseConfig(tail_share=1.0)
    with pytest.raises(InputError, match="--tail-share goes with dustin"):
        GenerationConfig(method="streaming", tail_share=0.5)
    with pytest.raises(InputError, match="takes no sampled tail"):
        GenerationConfig(method="dustin", budget="auto", tail_share=0.5)
    with pytest.raises(InputError, match="leaves 20 exact"):
        GenerationConfig(method="dustin-tail", budget=40)
    assert DUSTIN_TAIL_ROWS == {"dustin-tail": 0.5, "dustin-tail75": 0.75}
    assert all(METHODS[n].draft_kv == "streaming" for n in DUSTIN_TAIL_ROWS)


def test_the_config_file_key(tmp_path, tiny_sparse_config):
    raw = json.loads(open(tiny_sparse_config).read())
    path = tmp_path / "tail.json"
    path.write_text(json.dumps({**raw, "tail_share": 0.25}))
    cfg = SparseConfig.load(path)
    assert cfg.tail_share == 0.25 and cfg.to_json()["tail_share"] == 0.25
    path.write_text(json.dumps({**raw, "tail_share": 2}))
    with pytest.raises(InputError, match="tail_share"):
        SparseConfig.load(path)


def test_a_bad_share_is_one_error_line(capsys):
    assert main(["generate", "--prompt", "x", "--method", "quest", "--tail-share", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dustin: error: --tail-share goes with dustin, dustin-t or dustin-d, not 'quest'"]


# ---- the engine



def _prompts(lengths, seed=3):
    return random_prompts(lengths, seed)


@pytest.mark.usefixtures("cpu_paths")
def test_a_tail_covering_the_rest_is_vanilla(engine, tiny_sparse_config):
    """k = 200 split 100 + 100 over contexts of 60-160 positions: the tail reads all of R with weight 1 every step,
    and the greedy text is vanilla's token for token; the plans really were per layer."""
    prompts = _prompts([60, 97, 130])
    run = dict(stop_at_eos=False, max_new_tokens=24, gamma=3)
    vanilla = engine.generate(prompts, *offline(method="vanilla", **run))
    cfg = offline(method="dustin", budget=200, tail_share=0.5, sparse_config=tiny_sparse_config, **run)
    policy = engine.pair.make_policy(cfg[0])
    assert isinstance(policy, DustinSelection) and policy.sampled == 100 and policy.exact_cfg.budget == 100
    plans = []
    plan = policy.plan
    policy.plan = lambda state: plans.append(plan(state)) or plans[-1]
    out = engine.generate(prompts, *cfg, policy=policy)
    assert [s.token_ids for s in out.sequences] == [s.token_ids for s in vanilla.sequences]
    assert plans and all(p.per_layer and p.indices.shape[0] == 3 for p in plans)
    assert all(p.bias.eq(0).all() for p in plans) and any(int(p.counts.max()) > 100 for p in plans)


@pytest.mark.usefixtures("cpu_paths")
def test_greedy_tail_is_the_same_alone_batched_and_run_to_run(engine, tiny_sparse_config):
    prompts = _prompts([150, 210, 90], seed=8)
    cfg = offline(method="dustin", budget=64, tail_share=0.5, sparse_config=tiny_sparse_config, stop_at_eos=False,
                  max_new_tokens=16, gamma=3)
    batch = [s.token_ids for s in engine.generate(prompts, *cfg).sequences]
    assert batch == [s.token_ids for s in engine.generate(prompts, *cfg).sequences]
    assert batch == [engine.generate([p], *cfg).sequences[0].token_ids for p in prompts]
    row = offline(method="dustin-tail", budget=64, sparse_config=tiny_sparse_config, stop_at_eos=False,
                  max_new_tokens=16, gamma=3)
    assert batch == [s.token_ids for s in engine.generate(prompts, *row).sequences]  # the named row is the same
    exact = offline(method="dustin", budget=64, sparse_config=tiny_sparse_config, stop_at_eos=False,
                    max_new_tokens=16, gamma=3)
    assert batch != [s.token_ids for s in engine.generate(prompts, *exact).sequences]  # the tail changes it


@pytest.mark.usefixtures("cpu_paths")
def test_every_row_reads_its_budget_at_the_backend(engine, tiny_sparse_config, monkeypatch):
    """Counted where the verify reads them: each running row reads exactly k = 96 distinct cached positions per
    layer and KV head, 48 exact and 48 drawn, and the layers read different sets."""
    from dustin.attention.backend import AttentionBackend

    reads, sets = [], []
    verify = AttentionBackend.sparse_verify

    def counting(self, q, k_cache, v_cache, lengths, plan, *, max_len):
        seen = sparse_mask(lengths, plan, q.shape[2], max_len)[:, :, 0]
        cached = torch.arange(max_len)[None, None, :] < lengths.long()[:, None, None]
        reads.append(((seen & cached).sum(-1), lengths.long().clamp_max(96)))
        sets.append(seen & cached)
        return verify(self, q, k_cache, v_cache, lengths, plan, max_len=max_len)

    monkeypatch.setattr(AttentionBackend, "sparse_verify", counting)
    prompts = _prompts([150, 210, 180], seed=5)
    engine.generate(prompts, *offline(method="dustin", budget=96, tail_share=0.5, sparse_config=tiny_sparse_config,
                                      stop_at_eos=False, max_new_tokens=6, gamma=3))
    assert reads
    for n, want in reads:
        running = want > 1
        assert n[running].eq(want[running, None]).all()
    assert any(not torch.equal(a, b) for a, b in zip(sets[0::3], sets[1::3], strict=False))
