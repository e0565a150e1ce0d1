"""Fused residual-add + RMSNorm, RoPE and query-capture kernels (dustin/kernels/fused_ops.py) against the PyTorch
ops they replace, under the Triton interpreter: odd widths, strided q/k views, GQA, ragged positions."""
from __future__ import annotations

import pytest
import torch

from dustin.kernels.fused_ops import add_rms_norm, capture_query, capture_query_reference, rope_qk
from dustin.models.args import ModelArgs
from dustin.models.rope import RotaryEmbedding, apply_rope
from dustin.models.transformer import rms_norm


@pytest.mark.parametrize("rows,n", [(1, 64), (7, 96), (13, 200), (5, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_residual_add_match_the_model_ops(rows, n, dtype):
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    res = torch.randn(rows, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}  # bf16: torch's default, ~2 ulps
    torch.testing.assert_close(add_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), **tol)
    total, normed = add_rms_norm(x, w, 1e-5, residual=res)
    if dtype == torch.float32:
        assert torch.equal(total, res + x)  # the residual stream is rounded exactly like a PyTorch add
    else:  # the interpreter's fp32 -> bf16 cast is not round-to-nearest-even like the GPU's: one ulp apart
        torch.testing.assert_close(total, res + x)
    torch.testing.assert_close(normed, rms_norm(total, w, 1e-5), **tol)
    assert not torch.equal(total, x)


# (12, 2, 13, 64): a prefill-like chunk of 13 tokens per row (was 37: its 1,554 interpreted programs took 6-11 s;
# the kernel runs one program per (row, token, head), so a longer chunk repeats the same program)
@pytest.mark.parametrize("hq,hkv,t,d", [(8, 2, 5, 64), (4, 4, 1, 32), (6, 1, 3, 128), (12, 2, 13, 64)])
def test_rope_matches_apply_rope_on_strided_views(hq, hkv, t, d):
    B = 3
    g = torch.Generator().manual_seed(hq * t)
    args = ModelArgs(vocab_size=8, dim=hq * d, n_layers=1, n_heads=hq, n_kv_heads=hkv, intermediate_size=8,
                     rope_theta=10000.0)
    positions = torch.tensor([[5], [900], [31]]) + torch.arange(t)  # ragged positions, as in a decode batch
    cos, sin = RotaryEmbedding(args)(positions)
    # q and k as the model makes them: views of [B, T, H * D] projections, transposed to [B, H, T, D]
    q = torch.randn(B, t, hq * d, generator=g).view(B, t, hq, d).transpose(1, 2)
    k = torch.randn(B, t, hkv * d, generator=g).view(B, t, hkv, d).transpose(1, 2)
    qo, ko = rope_qk(q, k, cos, sin)
    torch.testing.assert_close(qo, apply_rope(q, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ko, apply_rope(k, cos, sin), atol=1e-5, rtol=1e-5)
    assert qo.is_contiguous() and ko.is_contiguous()


@pytest.mark.parametrize("hq,hkv,t,d,k_out", [(8, 2, 5, 64, False), (6, 1, 3, 128, True), (12, 2, 13, 64, True),
                                              (14, 2, 1, 64, False)])
def test_rope_writes_the_cache_like_kv_cache_write(hq, hkv, t, d, k_out):
    """The fused launch's cache write equals apply_rope + KVCache.write: a layer view of a [L, B, H, S, D] cache,
    ragged positions, the untouched positions unchanged; and a one-row view (a prefill of row 1 of 3)."""
    from dustin.cache.kv_cache import KVCache

    B, S, layer = 3, 1000, 1
    g = torch.Generator().manual_seed(hq * t + d)
    args = ModelArgs(vocab_size=8, dim=hq * d, n_layers=1, n_heads=hq, n_kv_heads=hkv, intermediate_size=8,
                     rope_theta=10000.0)
    positions = torch.tensor([[5], [900], [31]]) + torch.arange(t)
    cos, sin = RotaryEmbedding(args)(positions)
    q = torch.randn(B, t, hq * d, generator=g).view(B, t, hq, d).transpose(1, 2)
    kv = torch.randn(B, t, 2 * hkv * d, generator=g)  # k and v as the halves of one projection output
    k, v = (x.reshape(B, t, hkv, d).transpose(1, 2) for x in kv.split(hkv * d, dim=-1))
    want, got = (KVCache(2, B, hkv, d, S, torch.float32, "cpu") for _ in range(2))
    for c in (want, got):
        c.k.normal_(generator=torch.Generator().manual_seed(1))
        c.v.normal_(generator=torch.Generator().manual_seed(2))
    want.write(layer, apply_rope(k, cos, sin), v, positions)
    qo, ko = rope_qk(q, k, cos, sin, v=v, k_cache=got.k[layer], v_cache=got.v[layer], positions=positions,
                     k_out=k_out)
    torch.testing.assert_close(qo, apply_rope(q, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.k, want.k, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.v, want.v)
    assert (ko is not None) == k_out
    if k_out:
        torch.testing.assert_close(ko, apply_rope(k, cos, sin), atol=1e-5, rtol=1e-5)
    # one row of the batch (a prefill's `rows` slice): only that row's cache changes
    before = got.k.clone()
    rows = slice(1, 2)
    rope_qk(q[rows], k[rows], cos[rows], sin[rows], v=v[rows], k_cache=got.k[layer][rows],
            v_cache=got.v[layer][rows], positions=positions[rows] + 7)
    want.write(layer, apply_rope(k[rows], cos[rows], sin[rows]), v[rows], positions[rows] + 7, rows)
    torch.testing.assert_close(got.k, want.k, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.k[:, 0], before[:, 0]) and torch.equal(got.k[:, 2], before[:, 2])


@pytest.mark.parametrize("hq,d,heads,gamma", [(14, 64, (13, 0, 6, 7), 4), (12, 128, (5,), 3), (7, 32, (6, 1, 2), 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_query_matches_the_reference(hq, d, heads, gamma, dtype):
    """Draft forwards of 1 and 2 tokens into a view of a larger buffer (other layers' slots untouched), with
    positions before the step's base and past base + Γ - 1 clamped into range, as graph warm-up makes them."""
    B = 5
    g = torch.Generator().manual_seed(hq * d)
    heads_t = torch.tensor(heads)
    base = torch.tensor([3, 900, 17, 40, 0])
    q_all = torch.randn(B, 3, len(heads) + 1, gamma, d, generator=g).to(dtype).expand(2, -1, -1, -1, -1, -1).clone()
    p_all = torch.randint(0, 50, (B, gamma), generator=g).expand(2, -1, -1).clone()  # [copy, B, (NL, Hs_max,) Γ, D]
    for t, offsets in ((1, [0, 1, -4, 2, gamma + 3]), (2, [1, gamma - 2, 0, 9, -1]), (1, [gamma - 1] * B)):
        q = torch.randn(B, t, hq, d, generator=g).to(dtype).transpose(1, 2)  # [B, Hq, T, D], strided like the model's
        positions = (base + torch.tensor(offsets))[:, None] + torch.arange(t) - (t - 1)
        capture_query(q, heads_t, positions, base, q_all[0][:, 1, :len(heads)], p_all[0])
        capture_query_reference(q, heads_t, positions, base, q_all[1][:, 1, :len(heads)], p_all[1])
        assert torch.equal(q_all[0], q_all[1]) and torch.equal(p_all[0], p_all[1])
    slot = (base + torch.tensor([gamma - 1] * B) - base).clamp(0, gamma - 1)
    assert torch.equal(q_all[0][torch.arange(B), 1, :len(heads), slot], q[:, heads_t, -1])  # the last call's queries
