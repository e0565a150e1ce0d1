"""Load-time fusion of the q/k/v and gate/up projections (`Transformer.fuse_projections`) and the fused SiLU-mul
epilogue (dustin/kernels/fused_ops.py): the fused model computes the unfused one's logits, on prefill and decode,
for Llama and Qwen2 (qkv bias), whole or tensor-parallel sharded; `silu_mul` matches `F.silu(g) * u` under the
Triton interpreter at odd widths."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.kernels.fused_ops import silu_mul
from dustin.models.loader import load_model
from dustin.parallel.tp import TensorParallel, shard_transformer
from tests.tiny_models import make_tiny_checkpoint


def _prefill_then_decode(model, tokens: torch.Tensor, decode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a fresh prefill of `tokens` [B, P], then of a decode/verify step of `decode` [B, T] on its cache."""
    a = model.args
    (B, P), T = tokens.shape, decode.shape[1]
    cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, P + T + 4, torch.float32, "cpu")
    with torch.no_grad():
        pre = model(tokens, ForwardContext(cache, torch.arange(P)[None].expand(B, P), cache.lengths.clone(), P,
                                           fresh=True))
        cache.lengths.fill_(P)
        dec = model(decode, ForwardContext(cache, P + torch.arange(T)[None].expand(B, T), cache.lengths.clone(),
                                           P + T))
    return pre, dec


def _assert_same_logits(plain, fused) -> None:
    g = torch.Generator().manual_seed(0)
    tokens, decode = torch.randint(0, 96, (3, 29), generator=g), torch.randint(0, 96, (3, 5), generator=g)
    for T in (1, 5):
        want, got = _prefill_then_decode(plain, tokens, decode[:, :T]), _prefill_then_decode(fused, tokens,
                                                                                           decode[:, :T])
        for w, o in zip(want, got, strict=True):
            # fp32 GEMMs of other widths sum in another order (an AVX2-only CPU: 2.1e-5 apart)
            torch.testing.assert_close(o, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("checkpoint", ["tiny_qwen2", "tiny_llama"])
def test_fused_model_computes_the_unfused_logits(checkpoint, request):
    folder = request.getfixturevalue(checkpoint)
    plain, fused = load_model(folder, fuse=False), load_model(folder)
    assert fused.projections_fused and not plain.projections_fused
    att, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    a = fused.args
    assert not any(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj"))
    assert not any(hasattr(mlp, n) for n in ("gate_proj", "up_proj"))
    assert att.qkv_proj.weight.shape == ((a.n_heads + 2 * a.n_kv_heads) * a.head_dim, a.dim)
    assert mlp.gate_up_proj.weight.shape == (2 * a.intermediate_size, a.dim)
    assert (att.qkv_proj.bias is not None) == a.qkv_bias == (checkpoint == "tiny_qwen2")
    _assert_same_logits(plain, fused)


def test_qkv_bias_is_concatenated_in_order(tiny_qwen2):
    plain, fused = load_model(tiny_qwen2, fuse=False), load_model(tiny_qwen2)
    for p, f in zip(plain.layers, fused.layers, strict=True):
        ref = p.self_attn
        assert torch.equal(f.self_attn.qkv_proj.bias, torch.cat([ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]))
        assert torch.equal(f.self_attn.qkv_proj.weight,
                           torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]))
        assert torch.equal(f.mlp.gate_up_proj.weight, torch.cat([p.mlp.gate_proj.weight, p.mlp.up_proj.weight]))
        assert not f.self_attn.qkv_proj.weight.requires_grad


def test_fuse_projections_is_idempotent(tiny_qwen2):
    model = load_model(tiny_qwen2)
    before = {n: t.data_ptr() for n, t in model.state_dict().items()}
    assert model.fuse_projections() is model
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == before
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in before)
    assert sum(n.endswith("qkv_proj.bias") for n in before) == model.args.n_layers


@pytest.fixture(scope="module")
def tiny_qwen2_kv4(tmp_path_factory):
    """4 KV heads: shardable over 2 and 4 ranks (the session's tiny_qwen2 has 2)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_kv4"), "qwen2", heads=8, kv_heads=4, seed=3)


@pytest.mark.parametrize("world", [2, 4])
def test_sharding_a_fused_model_equals_fusing_the_shards(tiny_qwen2_kv4, world):
    """Fusing then sharding (shard_transformer on a loaded model) gives every rank exactly the weights that sharding
    then fusing (load_model(shard=...)) gives, so the fused split by the rank's head counts is right either way."""
    for rank in range(world):
        fused_first = shard_transformer(load_model(tiny_qwen2_kv4), rank, world)
        shard_first = load_model(tiny_qwen2_kv4, shard=TensorParallel(rank, world))
        a, b = fused_first.state_dict(), shard_first.state_dict()
        assert a.keys() == b.keys() and "layers.0.self_attn.qkv_proj.bias" in a
        for name, t in a.items():
            assert torch.equal(t, b[name]), name
        att = shard_first.layers[0].self_attn
        assert (att.args.n_heads, att.args.n_kv_heads) == (8 // world, 4 // world)
        assert att.qkv_proj.out_features == (att.args.n_heads + 2 * att.args.n_kv_heads) * att.args.head_dim


# ------------------------------------------------------------------------------------------------ silu_mul kernel
@pytest.mark.parametrize("rows,n", [(1, 7), (37, 4864 // 2 + 3), (130, 1000), (3, 2049)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_pytorch_on_split_halves(rows, n, dtype):
    g = torch.Generator().manual_seed(rows * n)
    gate_up = (torch.randn(2, rows, 2 * n, generator=g) * 4).to(dtype)  # as the fused MLP makes it: [B, T, 2N]
    gate, up = gate_up.chunk(2, dim=-1)  # views, rows strided by 2N
    out = silu_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:  # same rounding points as PyTorch: only exp / division's last bit may differ
        torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    else:  # rounded once from fp32, where PyTorch rounds silu(gate) first. One bf16 ulp from the fp32 result
        # rounded once: the interpreter's fp32 -> bf16 cast truncates where the GPU's rounds to nearest even
        once = (F.silu(gate.float()) * up.float()).to(dtype)
        torch.testing.assert_close(out, once, atol=1e-6, rtol=2 ** -7)
        torch.testing.assert_close(out, F.silu(gate) * up)  # torch's bf16 default: ~2 ulps


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(1e4) = inf, as on the GPU: silu -> -0
def test_silu_mul_of_separate_and_extreme_inputs():
    gate = torch.tensor([[-1e4, -88.0, -20.0, 0.0, 1e-3, 20.0, 88.0, 1e4]])
    up = torch.full_like(gate, 3.0)
    torch.testing.assert_close(silu_mul(gate, up), F.silu(gate) * up)
    assert silu_mul(torch.empty(0, 5), torch.empty(0, 5)).shape == (0, 5)
