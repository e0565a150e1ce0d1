"""The sort-free top-k / top-p select (dustin/kernels/sampling_cut.py) against `_cut` and its own reference (CPU,
Triton interpreter).

Top-k and the ties are exact, so they are compared everywhere. The top-p decision sums the mass in another order
than torch's cumsum: a row where some token's preceding mass lies within rounding of top_p may differ, as for any
two float implementations. Those rows are found in float64 (`_clear`) and left out of the top-p comparisons; the
data make them rare, and the tests check that most rows are compared."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the triton import below

import pytest
import torch

from dustin.engine import sampling
from dustin.engine.sampling import RowSampling, SamplingRule, _cut
from dustin.kernels.sampling_cut import sampling_cut, sampling_cut_reference

NEG = float("-inf")


def _logits(rows, V, gen, scale=3.0, bf16=False, inf_share=0.0):
    x = torch.randn(rows, V, generator=gen) * scale
    if bf16:  # few distinct values: many ties, at the cuts too
        x = x.bfloat16().float()
    if inf_share:
        x = torch.where(torch.rand(rows, V, generator=gen) < inf_share, NEG, x)
        x[:, 0] = x[:, 0].clamp_min(0.0)  # one finite entry a row
    return x


def _block(V):
    """A block for the interpreter: several per row (the streamed loops, compaction across blocks), but few (the
    interpreter's time is per block)."""
    return 64 if V < 1000 else 256 if V == 1000 else 1024


def _per_row(values, dtype):
    return torch.tensor(values, dtype=dtype)[:, None]


def _clear(x, top_k, top_p, tol=2e-6):
    """[...] whether no token's preceding mass (float64, after the top-k cut) is within tol of top_p."""
    V = x.shape[-1]
    k = torch.as_tensor(top_k).expand(*x.shape[:-1], 1)
    p = torch.as_tensor(top_p, dtype=torch.float64).expand(*x.shape[:-1], 1)
    desc = x.double().sort(-1, descending=True).values
    kth = torch.where((k > 0) & (k < V), desc.gather(-1, (k.clamp(1, V) - 1)), NEG)
    desc = torch.where(desc < kth, NEG, desc)
    probs = (desc - desc[..., :1]).exp()
    probs = probs / probs.sum(-1, keepdim=True)
    before = probs.cumsum(-1) - probs
    return ((before - p).abs() > tol).all(-1) | (p[..., 0] >= 1.0)


def _check(x, top_k, top_p, k_need=None, block=64, min_clear=0.5):
    """The kernel's output equals `_cut`'s and the reference's on every row clear of top-p near-ties."""
    out, cut = sampling_cut(x, top_k, top_p, block=block)
    ref, ref_cut = sampling_cut_reference(x, top_k, top_p)
    if k_need is None:
        k_need = int(torch.as_tensor(top_k).max())
    want = _cut(x, top_k, top_p, k_need)
    clear = _clear(x, top_k, top_p)
    assert clear.float().mean() >= min_clear, "too few rows clear of near-ties to compare"
    assert torch.equal(out[clear], want[clear]), "kernel != _cut"
    assert torch.equal(out[clear], ref[clear]), "kernel != reference"
    assert torch.equal(cut[clear], ref_cut[clear])
    # the cut is the kept set's least value (or -inf): every token equal to it is kept
    kept = out > NEG
    least = torch.where(kept, x, float("inf")).amin(-1, keepdim=True)
    assert bool(((cut == NEG) | (cut == least)).all())
    return out, cut


@pytest.mark.parametrize("V,rows", [(1, 1), (7, 3), (1000, 10), (5003, 3)])
def test_top_k_only(V, rows):
    gen = torch.Generator().manual_seed(V + rows)
    x = _logits(rows, V, gen)
    for k in sorted({k for k in (1, 2, 5, V - 1) if 0 < k < V}) or [0]:  # k >= V as an int: `_cut` takes none
        _check(x, k, 1.0, block=_block(V))


@pytest.mark.parametrize("V,rows", [(1, 3), (7, 3), (1000, 10), (5003, 1)])
def test_top_p_only(V, rows):
    gen = torch.Generator().manual_seed(10 * V + rows)
    x = _logits(rows, V, gen)
    for p in (0.05, 0.5, 0.9, 0.995):  # a 0.995 nucleus ends among tokens too small to be clear of rounding
        _check(x, 0, p, block=_block(V), min_clear=0.0 if p > 0.99 and V > 1000 else 0.5)


@pytest.mark.parametrize("V,rows", [(7, 10), (1000, 3), (5003, 3)])
def test_top_k_then_top_p(V, rows):
    gen = torch.Generator().manual_seed(3 * V + rows)
    x = _logits(rows, V, gen, scale=1.5)
    for k, p in ((3, 0.6), (min(50, V - 1), 0.9), (V - 1, 0.3)):
        _check(x, k, p, block=_block(V))


def test_wide_rows():
    """Logits spread over hundreds of nats: the cuts land in the first level's last bin (30 nats and more below the
    max), whose candidates are most of the row."""
    gen = torch.Generator().manual_seed(9)
    x = _logits(3, 1000, gen, scale=60.0)
    for k, p in ((998, 1.0), (600, 1.0), (0, 0.9), (600, 0.99)):
        _check(x, k, p, block=_block(1000))


def test_per_row_mix():
    """Each row its own top_k / top_p, both off in some rows (0 and >= 1), k at and past V, as RowSampling passes
    them on a GPU (k_need = V); a 3-d batch [B, G, V] with [B, 1, 1] settings too."""
    gen = torch.Generator().manual_seed(7)
    V = 1000
    x = _logits(10, V, gen, scale=2.0)
    k = _per_row([0, 5, 0, 50, 999, 1000, 1500, 1, 0, 20], torch.long)
    p = _per_row([1.0, 1.0, 0.9, 0.8, 1.0, 0.5, 0.95, 1.0, 1.0, 2.0], torch.float32)
    _check(x, k, p, k_need=V, block=256)
    x3 = _logits(12, V, gen).view(4, 3, V)
    _check(x3, _per_row([0, 7, 300, 0], torch.long)[:, :, None], _per_row([0.7, 1.0, 0.9, 1.0], torch.float32)
           [:, :, None], k_need=V, block=256)


@pytest.mark.parametrize("V", [7, 1000, 5003])
def test_bf16_ties_are_all_kept(V):
    """bf16-derived logits: hundreds of equal values, cuts landing inside tie runs, every tied token kept."""
    gen = torch.Generator().manual_seed(V)
    x = _logits(3, V, gen, scale=0.5, bf16=True)  # values within a few units: long runs of ties
    for k, p in ((min(10, V - 1), 1.0), (0, 0.5), (min(100, V - 1), 0.9)):
        out, cut = _check(x, k, p, block=_block(V))
        tied = (x == cut) & (cut > NEG)
        assert bool((out[tied] == x[tied]).all())
    x = torch.zeros(2, V)
    x[:, :3] = 1.0  # three at the top, the rest one tie
    for k, p in ((2, 1.0), (0, 0.001)):  # the 2nd largest is tied with the 3rd; the mass before the top tie is 0
        out, cut = sampling_cut(x, k, p, block=_block(V))
        assert bool((out[:, :3] == 1.0).all() and (out[:, 3:] == NEG).all() and (cut == 1.0).all())
    out, cut = sampling_cut(x, 4, 1.0, block=_block(V))
    assert torch.equal(out, x) and bool((cut == 0.0).all())  # the 4th largest is one of V - 3 ties: all kept


@pytest.mark.parametrize("V", [7, 1000])
def test_minus_inf_entries(V):
    """-inf logits (a previous mask): they count for top-k's rank (k past the finite ones keeps all) and carry no
    mass; -0.0 and 0.0 are one value."""
    gen = torch.Generator().manual_seed(V + 1)
    x = _logits(3, V, gen, inf_share=0.6)
    finite = int((x > NEG).sum(-1).min())
    for k, p in ((1, 1.0), (max(finite - 1, 1), 0.9), (V - 1, 1.0), (0, 0.7), (V - 1, 0.999)):
        _check(x, k, p, block=64)
    z = torch.tensor([[0.0, -0.0, -0.0, 0.0, -1.0, NEG, 2.0]])
    out, cut = sampling_cut(z, 3, 1.0, block=64)
    assert float(cut) == 0.0 and bool((out[0, :4] == 0.0).all()) and float(out[0, 4]) == NEG


def test_edge_rows():
    """Rows the engine should not send, handled without hanging: all -inf (nothing to cut), top_p <= 0 (the most
    likely tokens only), NaN settings (off)."""
    x = torch.tensor([[NEG] * 5, [1.0, 3.0, 3.0, 2.0, NEG], [1.0, 3.0, 3.0, 2.0, NEG]])
    out, cut = sampling_cut(x, _per_row([2, 0, 0], torch.long), _per_row([0.5, 0.0, float("nan")], torch.float32),
                            block=64)
    assert bool((out[0] == NEG).all()) and float(cut[0]) == NEG
    assert out[1].tolist() == [NEG, 3.0, 3.0, NEG, NEG] and float(cut[1]) == 3.0
    assert torch.equal(out[2], x[2]) and float(cut[2]) == NEG


def test_default_block_and_input_untouched():
    gen = torch.Generator().manual_seed(5)
    x = _logits(2, 5003, gen)
    before = x.clone()
    _check(x, 40, 0.9, block=2048)  # the engine's block: partial last block, in-place compaction across blocks
    assert torch.equal(x, before)


def test_cut_dispatch_takes_the_kernel(monkeypatch):
    """`_cut`'s GPU route (forced on here): scalar and per-row settings, k_need clamping, reach the kernel as
    `_cut`'s CPU path reads them; `probabilities` and `RowSampling` give the CPU path's distributions."""
    gen = torch.Generator().manual_seed(11)
    x = _logits(4, 300, gen, scale=2.0)
    k = _per_row([0, 5, 200, 40], torch.long)
    p = _per_row([0.9, 1.0, 0.8, 0.5], torch.float32)
    cpu = [_cut(x, 30, 0.9, 30), _cut(x, k, p, 300), _cut(x, k, p, 30), _cut(x, 0, 0.6, 0), _cut(x, 7, 1.0, 7),
           sampling.probabilities(x, SamplingRule(0.7, 20, 0.9))]
    rows = RowSampling(4, SamplingRule(1.0), torch.Generator().manual_seed(0))
    for r, rule in enumerate([SamplingRule(0.8, 10, 0.9), SamplingRule(), SamplingRule(1.2, 0, 0.7),
                              SamplingRule(1.0, 3, 1.0)]):
        rows.set_row(r, rule, seed=r)
    cpu.append(rows.probabilities(x))
    calls = []

    def traced(*args, **kwargs):
        calls.append(args)
        return sampling_cut(*args, **kwargs)

    monkeypatch.setattr(sampling, "_use_kernel", lambda t: True)
    monkeypatch.setattr(sampling, "_triton_cut", lambda: traced)
    gpu = [_cut(x, 30, 0.9, 30), _cut(x, k, p, 300), _cut(x, k, p, 30), _cut(x, 0, 0.6, 0), _cut(x, 7, 1.0, 7),
           sampling.probabilities(x, SamplingRule(0.7, 20, 0.9)), rows.probabilities(x)]
    assert len(calls) == 7
    assert torch.equal(calls[2][1], torch.tensor([0, 5, 30, 30])[:, None])  # clamped to k_need
    for a, b in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
