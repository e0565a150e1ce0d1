"""The sparse verify kernel with log-weights (`SparsePlan.bias`, the sampled tail's reweighting): each gathered
position enters the softmax with weight exp(log_weight), read next to its index. Against the PyTorch reference at
odd shapes (GQA ratios, ragged lengths, padding, empty lists, several splits merged in the launch or by the combine
launch, per-sequence and per-KV-head lists); all-zero weights give the bits of the unweighted kernel."""
from __future__ import annotations

import math

import pytest
import torch

from dustin.attention.reference import sparse_verify_attention_reference
from dustin.kernels.sparse_verify import sparse_verify_attention
from tests.kernels.test_sparse_kernels import _cache, _per_head_indices, _random_indices, _tol

# (Hq, Hkv, T, D, lengths, counts, k_max, dtype, num_splits, block_n, merge, per_head)
CASES = [
    (8, 2, 5, 64, [333, 60], [90, 60], 96, torch.float32, 3, 32, True, False),
    (7, 1, 2, 32, [17, 100], [0, 40], 48, torch.float32, None, 16, True, False),  # an empty list: new tokens only
    (14, 2, 4, 64, [200, 45, 17], [64, 45, 9], 64, torch.bfloat16, 2, 16, False, False),  # the combine launch
    (12, 4, 1, 16, [120, 33], None, 80, torch.float32, 4, 16, True, True),  # per-KV-head lists
]


def _inputs(Hq, Hkv, T, D, lengths, counts, k_max, dtype, per_head, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, L = _cache(len(lengths), Hq, Hkv, T, D, lengths, dtype, gen)
    if per_head:
        indices, counts_t = _per_head_indices(lengths, Hkv, k_max, gen)
    else:
        indices, counts_t = _random_indices(lengths, counts, k_max, gen)
    # weights of a sampled tail: most positions exact (0), some a tail's log(|R| / m); junk past the counts
    w = torch.where(torch.rand(indices.shape, generator=gen) < 0.5, 0.0,
                    torch.rand(indices.shape, generator=gen) * math.log(40.0))
    return q, k, v, L, indices, counts_t, w


@pytest.mark.parametrize("Hq,Hkv,T,D,lengths,counts,k_max,dtype,splits,block_n,merge,per_head", CASES)
def test_weighted_sparse_verify_matches_the_reference(Hq, Hkv, T, D, lengths, counts, k_max, dtype, splits,
                                                      block_n, merge, per_head):
    q, k, v, L, indices, counts_t, w = _inputs(Hq, Hkv, T, D, lengths, counts, k_max, dtype, per_head, 5)
    got = sparse_verify_attention(q, k, v, L, indices, counts_t, log_weights=w, num_splits=splits,
                                  block_n=block_n, merge=merge)
    want = sparse_verify_attention_reference(q, k, v, L, indices, counts_t, log_weights=w)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    unweighted = sparse_verify_attention_reference(q, k, v, L, indices, counts_t)
    assert (want.float() - unweighted.float()).abs().max() > 20 * _tol(dtype)["atol"]  # the weights matter here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_zero_weights_give_the_unweighted_bits(dtype, splits):
    q, k, v, L, indices, counts, _ = _inputs(8, 2, 3, 32, [150, 70], [64, 70], 80, dtype, False, 6)
    plain = sparse_verify_attention(q, k, v, L, indices, counts, num_splits=splits, block_n=16)
    zero = sparse_verify_attention(q, k, v, L, indices, counts, log_weights=torch.zeros(indices.shape),
                                   num_splits=splits, block_n=16)
    assert torch.equal(plain, zero)


def test_log_weights_must_be_shaped_like_the_indices():
    q, k, v, L, indices, counts, _ = _inputs(4, 2, 1, 16, [40, 30], [20, 10], 24, torch.float32, False, 8)
    with pytest.raises(AssertionError, match="shaped like indices"):
        sparse_verify_attention(q, k, v, L, indices, counts, log_weights=torch.zeros(2, 23))


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """Engines over one tiny pair of head_dim 16 (the Triton kernels' smallest): on the Triton kernels (the CPU
    interpreter here) and on SDPA."""
    from dustin.attention.backend import AttentionBackend
    from dustin.engine.engine import Engine
    from dustin.models.loader import load_model
    from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

    root = tmp_path_factory.mktemp("weighted_pair")
    target = make_tiny_checkpoint(root / "t", "qwen2", heads=4, kv_heads=2, seed=3)
    draft = make_tiny_draft(target, root / "d", noise=0.1)
    tri = AttentionBackend("triton")
    return (Engine.from_models(load_model(target, backend=tri), load_model(draft, backend=tri)),
            Engine.from_models(load_model(target), load_model(draft)))


@pytest.mark.parametrize("budget,lengths", [(96, (160, 230)), (200, (70, 121))])
def test_a_tail_row_on_the_kernels_decodes_as_on_sdpa(backends, budget, lengths, monkeypatch):
    """oracle-layer-tail75 end to end: its weighted plans go through the Triton kernel (no float-mask fallback), and
    the greedy text is SDPA's token for token, both at 96 positions of 160-240 (72 sampled from more: weights > 1)
    and at 200 of 70-131 (the tail takes all of the rest with weight 1: vanilla's text)."""
    from tests.offline import offline

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]
    kw = dict(method="oracle-layer-tail75", budget=budget, stop_at_eos=False, max_new_tokens=10, gamma=3,
              temperature=0.0)
    calls = []
    from dustin.attention import backend
    from dustin.kernels import sparse_verify
    original = sparse_verify.sparse_verify_attention

    def counting(*a, **k):
        w = k.get("log_weights")
        calls.append(None if w is None else float(w.max()))
        return original(*a, **k)

    monkeypatch.setattr(sparse_verify, "sparse_verify_attention", counting)
    monkeypatch.setattr(backend, "sparse_verify_attention", counting, raising=False)  # wherever the backend finds it
    tri = backends[0].generate(prompts, *offline(**kw))
    monkeypatch.undo()
    sdpa = backends[1].generate(prompts, *offline(**kw))
    assert calls and None not in calls  # every sparse verify took the kernel, with weights
    assert (max(calls) > 0.5) == (budget == 96)  # log(R / m): > 0 where the tail samples from more than it reads
    assert [s.token_ids for s in tri.sequences] == [s.token_ids for s in sdpa.sequences]
    if budget == 200:
        vanilla = backends[1].generate(prompts, *offline(method="vanilla", stop_at_eos=False, max_new_tokens=10))
        assert [s.token_ids for s in tri.sequences] == [s.token_ids for s in vanilla.sequences]
