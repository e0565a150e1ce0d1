"""The fused decode-layer kernels (dustin/kernels/decode_linear.py) against the PyTorch ops they replace, under
the Triton interpreter: odd row counts and widths (K not a multiple of the tile), split K, an attention output
read in place, GQA head layouts, ragged cache positions, fp32 (tight) and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dustin.kernels.arrival import arrival_counters
from dustin.kernels.decode_linear import (
    RowNorm,
    Tiles,
    decode_linear,
    gate_up_silu,
    linear_tiles,
    qkv_rope,
    qkv_tiles,
    row_norm,
)
from dustin.models.args import ModelArgs
from dustin.models.rope import RotaryEmbedding, apply_rope
from dustin.models.transformer import rms_norm

F32 = {"atol": 2e-5, "rtol": 2e-5}


def _tol(dtype):
    return F32 if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _as_accurate(out, ref_fn, *inputs):
    """bf16: the kernel rounds at other points than the PyTorch ops (the norm's weight before rstd, one rounding
    of SiLU·up), and the interpreter's fp32 -> bf16 cast truncates where the GPU's rounds to nearest; so compare
    errors against the fp32 truth: the kernel's worst error must be within three times the bf16 PyTorch ops' own
    plus 2% of the output's scale (a wrong row, column or scale is off by far more)."""
    truth = ref_fn(*(t.float() if t is not None and t.is_floating_point() else t for t in inputs))
    torch_err = (ref_fn(*inputs).float() - truth).abs().max()
    err = (out.float() - truth).abs().max()
    assert err <= 3 * torch_err + 2e-2 * truth.abs().max(), (err, torch_err)


def _randn(*shape, gen, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("b,t,n,k", [(1, 1, 48, 72), (3, 5, 100, 200), (16, 2, 96, 136), (7, 3, 33, 64)])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_bias_and_residual(b, t, n, k, split, dtype):
    g = torch.Generator().manual_seed(b * 1000 + n + split)
    x, w = _randn(b, t, k, gen=g, dtype=dtype), _randn(n, k, gen=g, dtype=dtype, scale=k ** -0.5)
    bias, res = _randn(n, gen=g, dtype=dtype), _randn(b, t, n, gen=g, dtype=dtype)
    tiles = Tiles(bn=16, bk=32, split=split)
    y = F.linear(x, w, bias)
    torch.testing.assert_close(decode_linear(x, w, bias=bias, tiles=tiles), y, **_tol(dtype))
    out = decode_linear(x, w, residual=res, tiles=tiles)
    torch.testing.assert_close(out, res + F.linear(x, w), **_tol(dtype))
    # the split-K arrival counters are left at zero: a second launch gives the same bits
    assert torch.equal(decode_linear(x, w, residual=res, tiles=tiles), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_reads_an_attention_output_in_place(dtype):
    """o_proj's input is the attention's [B, H, T, D] output (head-major, or token-major memory as the Triton
    backend writes it): read as [B, T, H * D] without a transpose copy."""
    g = torch.Generator().manual_seed(3)
    B, H, T, D, N = 3, 6, 5, 32, 80
    attn = _randn(B, H, T, D, gen=g, dtype=dtype)
    w, res = _randn(N, H * D, gen=g, dtype=dtype, scale=0.1), _randn(B, T, N, gen=g, dtype=dtype)
    ref = res + F.linear(attn.transpose(1, 2).reshape(B, T, H * D), w)
    token_major = attn.transpose(1, 2).contiguous().transpose(1, 2)  # the Triton backend's layout, same values
    for split in (1, 2):
        for a in (attn, token_major):
            out = decode_linear(a, w, residual=res, heads=H, tiles=Tiles(bn=16, bk=64, split=split))
            torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("b,t,k,n", [(2, 1, 96, 40), (5, 5, 200, 72), (16, 2, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normed_linear_and_gate_up(b, t, k, n, dtype):
    g = torch.Generator().manual_seed(k + n)
    x = _randn(b, t, k, gen=g, dtype=dtype, scale=3.0)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    w = _randn(2 * n, k, gen=g, dtype=dtype, scale=k ** -0.5)

    def normed(x, nw, w):
        return F.linear(rms_norm(x, nw, 1e-6), w)

    def swiglu(x, nw, w):
        gate, up = normed(x, nw, w).chunk(2, dim=-1)
        return F.silu(gate) * up

    norm = row_norm(x, nw, 1e-6)
    lin = decode_linear(norm, w, tiles=Tiles(16, 32, split=2))
    out = gate_up_silu(norm, w, tiles=Tiles(16, 64))
    assert out.shape == (b, t, n)
    if dtype == torch.float32:
        torch.testing.assert_close(lin, normed(x, nw, w), **F32)
        torch.testing.assert_close(out, swiglu(x, nw, w), **F32)
    else:
        _as_accurate(lin, normed, x, nw, w)
        _as_accurate(out, swiglu, x, nw, w)


@pytest.mark.parametrize("hq,hkv,d,t,split", [(14, 2, 64, 1, 1), (12, 2, 128, 5, 1), (6, 3, 32, 3, 1),
                                              (14, 2, 64, 2, 3), (6, 3, 32, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_rope_writes_the_cache_and_rotates_q(hq, hkv, d, t, split, dtype):
    g = torch.Generator().manual_seed(hq * d + t)
    B, K, S = 3, 88, 64
    args = ModelArgs(vocab_size=8, dim=hq * d, n_layers=1, n_heads=hq, n_kv_heads=hkv, intermediate_size=8,
                     rope_theta=10000.0)
    positions = torch.tensor([[3], [40], [17]]) + torch.arange(t)  # ragged, as in a decode batch
    cos, sin = RotaryEmbedding(args)(positions)
    x = _randn(B, t, K, gen=g, dtype=dtype, scale=2.0)
    nw = (1 + 0.2 * torch.randn(K, generator=g)).to(dtype)
    w = _randn((hq + 2 * hkv) * d, K, gen=g, dtype=dtype, scale=K ** -0.5)
    bias = _randn((hq + 2 * hkv) * d, gen=g, dtype=dtype, scale=0.5)
    cache = _randn(2, B, hkv, S, d, gen=g, dtype=dtype)  # stale contents that must stay where not written
    kc, vc = cache[0].clone(), cache[1].clone()
    q = qkv_rope(row_norm(x, nw, 1e-6), w, bias, cos, sin, positions, kc, vc, n_heads=hq, n_kv_heads=hkv,
                 tiles=Tiles(bn=16, bk=32 if split == 1 else 16, split=split))
    assert int(arrival_counters("cpu", 1).abs().sum()) == 0
    qkv = F.linear(rms_norm(x, nw, 1e-6), w, bias)
    rq, rk, rv = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    rq = apply_rope(rq.view(B, t, hq, d).transpose(1, 2), cos, sin)
    rk = apply_rope(rk.view(B, t, hkv, d).transpose(1, 2), cos, sin)
    torch.testing.assert_close(q, rq, **_tol(dtype))
    ref_k, ref_v = cache[0].clone(), cache[1].clone()
    for b in range(B):
        ref_k[b, :, positions[b]] = rk[b]
        ref_v[b, :, positions[b]] = rv[b].view(t, hkv, d).transpose(0, 1)
    torch.testing.assert_close(kc, ref_k, **_tol(dtype))
    torch.testing.assert_close(vc, ref_v, **_tol(dtype))
    written = torch.zeros(B, S, dtype=torch.bool)
    written[torch.arange(B)[:, None], positions] = True
    assert torch.equal(kc[~written[:, None, :].expand(B, hkv, S)], cache[0][~written[:, None, :].expand(B, hkv, S)])


def test_residual_add_prepares_the_next_norms_input():
    """With next_norm, the residual add's epilogue also writes out * g and per-tile partial sums of squares of
    its output rows: summed, they are the rows' sums of squares (split or not), and the next projection of that
    RowNorm normalizes like rms_norm."""
    g = torch.Generator().manual_seed(11)
    x, w, res = torch.randn(4, 2, 80, generator=g), torch.randn(72, 80, generator=g) * 0.1, torch.randn(4, 2, 72,
                                                                                                       generator=g)
    nw, w2 = 1 + 0.1 * torch.randn(72, generator=g), torch.randn(24, 72, generator=g)
    for split in (1, 2):
        out, rows = decode_linear(x, w, residual=res, next_norm=(nw, 1e-5), tiles=Tiles(16, 32, split=split))
        assert isinstance(rows, RowNorm) and rows.sumsq.shape == (5, 8)  # ceil(72 / 16) tiles x 8 rows
        torch.testing.assert_close(out, res + F.linear(x, w), **F32)
        torch.testing.assert_close(rows.sumsq.sum(0), out.pow(2).sum(-1).reshape(-1), **F32)
        torch.testing.assert_close(rows.scaled, out * nw, **F32)
        torch.testing.assert_close(decode_linear(rows, w2, tiles=Tiles(16, 32)), F.linear(rms_norm(out, nw, 1e-5), w2),
                                   **F32)


def test_qkv_tiles_split_k_within_two_programs_per_sm():
    assert qkv_tiles(16, 14 + 2 * 2, 32, 896, torch.bfloat16).split == 4  # the 0.5B draft: 36 tiles
    assert qkv_tiles(16, 12 + 2 * 2, 64, 1536, torch.bfloat16).split == 4  # the 1.5B target: 64 tiles
    assert qkv_tiles(16, 40 + 2 * 8, 64, 5120, torch.bfloat16).split == 1  # 32B: 224 tiles fill the SMs
    assert qkv_tiles(16, 18, 32, 200, torch.bfloat16).split == 1  # short K: one part


def test_tiles_split_long_k_narrow_outputs_only():
    t = linear_tiles(16, 896, 4864, torch.bfloat16, splittable=True)  # the 0.5B draft's down_proj
    assert t.bn == 64 and t.split == 4
    assert linear_tiles(16, 896, 4864, torch.bfloat16, splittable=False).split == 1
    assert linear_tiles(16, 896, 896, torch.bfloat16, splittable=True).split == 1  # short K: one part
    assert linear_tiles(16, 17920, 1536, torch.bfloat16, splittable=True).split == 1  # wide: enough programs


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 1, 64)
    with pytest.raises(ValueError, match="rows"):
        decode_linear(torch.zeros(33, 1, 64), torch.zeros(16, 64))
    with pytest.raises(ValueError, match="contiguous"):
        decode_linear(x, torch.zeros(64, 16).T)
    with pytest.raises(ValueError, match="split"):
        gate_up_silu(x, torch.zeros(32, 64), tiles=Tiles(16, 32, split=2))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("T", [1, 2])
def test_decode_layers_compute_the_model_logits_and_cache(family, T, tmp_path):
    """`Transformer.decode_logits` (three fused kernels + attention per layer) against `Transformer.forward` on
    decode forwards of 1 and 2 tokens per row over ragged cached lengths, fp32: the logits, and the K/V the step
    appended."""
    from dustin.attention.context import ForwardContext
    from dustin.cache.kv_cache import KVCache
    from dustin.models.loader import load_model
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, family, dim=96, heads=3, kv_heads=1, layers=2, seed=7)
    model = load_model(folder)
    a = model.args
    assert a.head_dim == 32 and a.qkv_bias == (family == "qwen2")
    g = torch.Generator().manual_seed(T)
    B, P = 3, 23
    cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, P + T + 8, torch.float32, "cpu")
    with torch.no_grad():
        tokens = torch.randint(0, a.vocab_size, (B, P), generator=g)
        model(tokens, ForwardContext(cache, torch.arange(P)[None].expand(B, P), cache.lengths.clone(), P,
                                     fresh=True))
        lengths = torch.tensor([P, P - 7, P - 15], dtype=torch.int32)  # ragged rows: stale K/V beyond them
        cache.lengths.copy_(lengths)
        positions = lengths[:, None].long() + torch.arange(T)
        new = torch.randint(0, a.vocab_size, (B, T), generator=g)
        ctx = ForwardContext(cache, positions, lengths.clone(), P + T)
        want = model(new, ctx)
        want_k, want_v = [k.clone() for k in cache.k], [v.clone() for v in cache.v]
        rows = torch.arange(B)[:, None]
        for k, v in zip(cache.k, cache.v, strict=True):  # the fused path must write the new K/V itself
            k[rows, :, positions] = 0
            v[rows, :, positions] = 0
        h = model.embed_tokens(new)
        got = model.decode_logits(h, *model.rotary(positions), ForwardContext(cache, positions, lengths.clone(),
                                                                             P + T))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for layer in range(a.n_layers):
        torch.testing.assert_close(cache.k[layer][rows, :, positions].transpose(1, 2),
                                   want_k[layer][rows, :, positions].transpose(1, 2), **F32)
        torch.testing.assert_close(cache.v[layer][rows, :, positions], want_v[layer][rows, :, positions], **F32)
