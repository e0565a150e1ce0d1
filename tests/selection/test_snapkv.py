"""`snapkv`: SnapKV's prompt-time set per (layer, KV head), fixed after prefill, plus every generated position."""
from __future__ import annotations

import pytest
import torch

from dustin.attention.backend import sparse_mask
from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.engine.config import METHODS
from dustin.engine.engine import Engine
from dustin.engine.offline.prefill import PrefillCache
from dustin.errors import InputError
from dustin.models.loader import load_model
from dustin.scoring import causal_probs
from dustin.selection.config import SparseConfig
from dustin.selection.registry import POLICIES, make_policy
from dustin.selection.snapkv import SNAPKV_KERNEL, SNAPKV_WINDOW, SnapKVSelection
from tests.offline import offline, random_prompts

K = 48  # budget: > the 32-token window, < the long prompts below
RAGGED = [90, 130, 40]  # two prompts longer than k (compressed), one shorter (kept whole)



def _prompts(lengths, seed=0):
    return random_prompts(lengths, seed)


def _cfg(**kw):
    return offline(**{"method": "snapkv", "gamma": 3, "max_new_tokens": 20, "stop_at_eos": False,
                      "draft_window": 16, **kw})


def _session(engine, prompts, budget=K, **kw):
    """The batch's session after its (gang) prefill and first step, and its policy."""
    policy = SnapKVSelection(SparseConfig(budget=budget, draft_topm=0))
    core = engine.start(prompts, *_cfg(budget=budget, **kw), policy=policy)
    core.step()
    return core, policy


def _dense_prefill(model, ids):
    """Post-RoPE queries and keys of every layer from a fresh dense forward of one prompt."""
    a, n = model.args, len(ids)
    got = {}

    def grab(layer, q, k_cache, ctx):
        got[layer] = (q[0].clone(), k_cache[0, :, :n].clone())

    grab.layers = frozenset(range(a.n_layers))
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, a.head_dim, n, torch.float32, "cpu")
    with torch.inference_mode():
        model(torch.tensor([ids]), ForwardContext(cache, torch.arange(n)[None], torch.zeros(1, dtype=torch.int32),
                                                  n, fresh=True, observers=[grab]))
    return got


def _pooled_reference(q, k, n, group):
    """Window attention over the earlier positions, summed over window queries and the group's heads, then a
    same-padded max-pool written out by hand: [Hkv, n - W]."""
    W, Hkv = SNAPKV_WINDOW, k.shape[0]
    probs = causal_probs(q[None, :, n - W:], k[None], torch.arange(n - W, n)[None])[0]  # [Hq, W, n]
    scores = probs.view(Hkv, group, W, n).sum(dim=(1, 2))[:, : n - W]
    r = SNAPKV_KERNEL // 2
    padded = torch.nn.functional.pad(scores, (r, r), value=float("-inf"))
    return padded.unfold(-1, SNAPKV_KERNEL, 1).amax(-1)


def test_registered():
    assert "snapkv" in POLICIES and METHODS["snapkv"].policy == "snapkv" and METHODS["snapkv"].draft_kv == "streaming"
    assert isinstance(make_policy("snapkv", SparseConfig(budget=64, draft_topm=0)), SnapKVSelection)
    with pytest.raises(InputError, match="snapkv needs --budget > 32"):
        make_policy("snapkv", SparseConfig(budget=32, draft_topm=0))


def test_prompt_picks_equal_a_direct_recomputation(engine):
    """The stored picks of every layer and KV head are the top k - W positions of the max-pooled window attention,
    recomputed from a fresh dense forward of each prompt of a ragged batch, plus the window; a prompt shorter than
    k keeps every position."""
    prompts = _prompts(RAGGED)
    _, policy = _session(engine, prompts)
    a, W = engine.pair.target.args, SNAPKV_WINDOW
    assert policy.indices.shape == (a.n_layers, 3, a.n_kv_heads, K + 20 + 3 + 1)
    assert policy.prefill.prompt_lengths.tolist() == RAGGED
    exact = 0
    for b, ids in enumerate(prompts):
        n = len(ids)
        qk = _dense_prefill(engine.pair.target, ids)
        for layer in range(a.n_layers):
            for h in range(a.n_kv_heads):
                c = int(policy.counts[layer, b, h])
                row = policy.indices[layer, b, h].long()
                assert c == min(n, K) and bool((row[c:] == 0).all())
                if n <= K:
                    assert row[:c].tolist() == list(range(n))
                    continue
                assert row[c - W: c].tolist() == list(range(n - W, n))  # the observation window
                picks = row[: c - W]
                assert bool((picks[1:] > picks[:-1]).all())
                pooled = _pooled_reference(*qk[layer], n, a.gqa_group)[h]
                ref = torch.sort(pooled, descending=True, stable=True).indices[: K - W]
                chosen = torch.zeros(n - W, dtype=torch.bool)
                chosen[picks] = True
                # a valid top-(k - W) set; any difference from the reference is a tie at the threshold
                thr = pooled[ref].min()
                assert pooled[chosen].min() >= thr - 1e-6 and pooled[~chosen].max() <= thr + 1e-6
                differ = set(picks.tolist()) ^ set(ref.tolist())
                assert all(abs(float(pooled[j] - thr)) <= 1e-6 for j in differ)
                exact += not differ
    assert exact >= 3  # (4 checked rows per long prompt x 2: most match exactly)


def test_budget_above_prompt_is_exactly_classic(engine):
    """k >= every prompt: every prompt position is kept and every generated one attended: classic's output."""
    prompts = _prompts([20, 47, 9])
    kw = {"gamma": 3, "max_new_tokens": 24, "stop_at_eos": False, "draft_kv": "streaming", "draft_window": 16}
    classic = engine.generate(prompts, *offline(method="classic", **kw))
    snap = engine.generate(prompts, *offline(method="snapkv", budget=200, **kw))
    assert [s.token_ids for s in snap.sequences] == [s.token_ids for s in classic.sequences]
    assert snap.steps == classic.steps and "sparse_verify" in snap.time_split_s


def test_plan_is_prompt_picks_and_generated_positions(engine):
    """After a few steps each layer's plan is exactly (prompt picks) ∪ [prompt_len_b, lengths[b]), sorted, 0 past
    the counts, every entry < lengths[b]; the per-KV-head mask built from it keeps the same positions."""
    prompts = _prompts(RAGGED, seed=1)
    core, policy = _session(engine, prompts)
    for _ in range(2):
        core.step()
    s = core.runner.batch
    L = s.target_cache.lengths.clone()
    assert bool((L > torch.tensor(RAGGED)).all())  # something was generated
    assert policy.plan(s) is policy
    a = engine.pair.target.args
    for layer in range(a.n_layers):
        plan = policy.plan_layer(layer, None, None)
        assert plan.indices.shape == (3, a.n_kv_heads, policy.prefill.k_max) and plan.indices.dtype == torch.int32
        assert plan.counts.shape == (3, a.n_kv_heads) and plan.counts.dtype == torch.int32
        for b, n in enumerate(RAGGED):
            for h in range(a.n_kv_heads):
                c0 = int(policy.counts[layer, b, h])
                want = policy.indices[layer, b, h, :c0].tolist() + list(range(n, int(L[b])))
                row, c = plan.indices[b, h].tolist(), int(plan.counts[b, h])
                assert c == len(want) and row[:c] == want and row == sorted(row[:c]) + [0] * (len(row) - c)
                assert max(row[:c]) < int(L[b])
        S = int(L.max()) + s.gamma + 1
        mask = sparse_mask(L, plan, s.gamma + 1, S)[:, :, 0]  # [B, Hkv, S], the first verify query
        for b in range(3):
            for h in range(a.n_kv_heads):
                seen = set(torch.nonzero(mask[b, h, : int(L[b])]).flatten().tolist())
                assert seen == set(plan.indices[b, h, : int(plan.counts[b, h])].tolist())
    core.run_queued()  # decoding to the end stays inside the fixed buffers
    assert bool(((s.target_cache.lengths - policy.prefill.prompt_lengths) <= policy.prefill.max_generated).all())


def test_generate_completes_and_reports_tau(engine):
    prompts = _prompts([150, 210, 64], seed=2)
    out = engine.generate(prompts, *_cfg(budget=40, max_new_tokens=24))
    assert out.method == "snapkv" and all(len(s.token_ids) == 24 for s in out.sequences)
    assert 1.0 <= out.tau <= 4.0 and out.steps > 0
    assert {"draft", "select", "sparse_verify"} <= set(out.time_split_s) and "verify" not in out.time_split_s
    assert out.sparse_config["budget"] == 40
    assert out.to_json()["tau"] == round(out.tau, 4)


def test_reuse_prefill_runs_its_own_prefill(engine):
    """The Engine never hands snapkv a reused prefill (which re-runs only the last prompt token): with a
    prefill cache it prefills in full and decodes exactly as without; a noise-filled prefill refuses."""
    prompts = _prompts(RAGGED, seed=3)
    kw = {"gamma": 3, "max_new_tokens": 16, "stop_at_eos": False, "draft_window": 16}
    shared = PrefillCache()
    engine.generate(prompts, *offline(method="classic", **kw), prefill_cache=shared)
    saved = shared.state
    assert saved is not None
    fresh = engine.generate(prompts, *offline(method="snapkv", budget=K, **kw))
    reused = engine.generate(prompts, *offline(method="snapkv", budget=K, **kw), prefill_cache=shared)
    assert [s.token_ids for s in reused.sequences] == [s.token_ids for s in fresh.sequences]
    assert shared.state is not None and shared.state.key == saved.key  # later methods reuse it
    assert torch.equal(shared.state.target_kv[0], saved.target_kv[0])  # snapkv's own prefill: same caches

    with pytest.raises(InputError, match="snapkv needs its own prefill"):
        engine.start(prompts, *offline(method="snapkv", budget=K, **kw), fill="noise").step()


def test_triton_backend_gives_the_same_tokens(tmp_path):
    """Per-KV-head lists through the Triton sparse verify kernel (interpreter) decode as on the SDPA path."""
    from dustin.attention.backend import AttentionBackend
    from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

    target = make_tiny_checkpoint(tmp_path / "t", "qwen2", heads=4, kv_heads=2, seed=3)  # head_dim 16
    draft = make_tiny_draft(target, tmp_path / "d", noise=0.1)
    tri = AttentionBackend("triton")
    engines = [Engine.from_models(load_model(target, backend=tri), load_model(draft, backend=tri)),
               Engine.from_models(load_model(target), load_model(draft))]
    prompts = _prompts([70, 55])
    outs = [e.generate(prompts, *_cfg(budget=40, max_new_tokens=8)) for e in engines]
    assert [s.token_ids for s in outs[0].sequences] == [s.token_ids for s in outs[1].sequences]
