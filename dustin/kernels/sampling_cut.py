"""The top-k / top-p cuts of sampling on a GPU without a sort: an exact select per row (Triton).

Why: `dustin.engine.sampling._cut` needs, per distribution, the k-th largest logit (top-k) and the value of the last
token the nucleus needs (top-p). On a GPU it found both by sorting every row (V = 151,936 entries, B x (Γ + 1) rows
for the target's verify and B for each draft step): a sampled step with top-p cost 1.7x a greedy one on an H200,
the sorts ~4.5 ms of it (docs/exactness.md). A cut needs one order statistic, not an order: this kernel selects it.

Semantics (exactly `_cut`'s; `sampling_cut_reference` states them with a sort): per row, top_k in 1 .. V - 1 keeps
the tokens whose logit is >= the k-th largest (ties at it kept; 0 or >= V: off); then top_p < 1 keeps token x iff
the probability mass of the tokens with a strictly larger logit, after the top-k cut, is < top_p (ties all kept,
the most likely tokens always; >= 1: off). Dropped tokens become -inf. `cut` is the smallest kept logit's cut value:
out = where(x < cut, -inf, x), -inf when nothing is cut.

How, one program per row, with no memory of its own (the output row is its scratch until the last pass writes it);
every pass streams in blocks of BLOCK entries, software-pipelined (STAGES blocks in flight):
  1. the row max m (the shift of exp(x - m), and the anchor of the first level's bins);
  2. a first-level histogram of the whole row: NB bins by distance below the max, WIDTH nats each (the lowest bin
     takes everything further, and -inf), with each bin's count and mass sum(exp(x - m)). Bins are monotone in the
     value (larger logit, higher or equal bin; equal logits, one bin), which is all a select needs;
  3. top-k: the bin holding the k-th largest (counts above it < k <= counts from it), whose values are copied
     (compacted) to the scratch row; then levels over those candidates only, NB bins each over their order keys'
     range [lo, hi] (the fp32 bit pattern as an int whose order is the float order, -0.0 folded into 0.0), each
     level a histogram pass and a compaction, until one key is left (each level narrows the range >= 8x: at most
     11 levels; they stop at once when the candidates are all equal, e.g. bf16 ties). That key is the cut exactly.
     Z, the mass after the cut (top-p's normalizer), comes with it: the first level's bins above plus the mass of
     the candidates above the cut and of its ties (no pass of its own);
  4. top-p: the same select by mass: the lowest non-empty bin whose largest value has less than top_p * Z before
     it (the mass of the higher bins, strictly larger values), compacted from the row (values >= the top-k cut),
     then refined level by level with the mass before carried down;
  5. the output pass: out = where(x < cut, -inf, x), and cut.
So 4 passes over the row with one of the cuts (max, histogram, compaction, output), 5 with both, plus passes over
the candidates, whose number depends on the data (a bin of 2 nats near the cut: few in a peaked row, many in a flat
one) but not on the shapes: no host sync, no data-dependent shape, one launch, captured in the step's CUDA graph.

Why not a fixed radix over the whole row (4 passes of 8 key bits, each with a count and a mass histogram): Triton has
no shared-memory histogram that sums weights (`tl.histogram` counts), so a bin's mass is a one-hot sum, an operation
per bin per entry: 256 bins in each of 4 full passes would be ~2,000 operations an entry (an estimate), where here
only the first level sees the whole row (16 bins, ~50 operations an entry) and the levels after it the candidates
of one bin.

Rounding: the mass is summed in fp32 in a fixed order within a row (per block, then block after block; per level),
so a row's result does not depend on the batch or the run, but it differs from torch's cumsum in the last bits. A
token whose preceding mass is within float rounding of top_p * Z may land on either side of the top-p cut, as in any
float implementation (`_cut` and this kernel can disagree on such a row, never elsewhere). exp is Triton's (on a GPU
the fast exp2), likewise within rounding. Top-k and the order keys are exact.

Not yet timed on a GPU: BLOCK, NB, WIDTH, STAGES and the warps are reasoned choices, not tuned. One program per row
leaves most SMs idle for a draft step's B rows; splitting a row over programs would need a reduction across them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dustin.kernels.launch import pdl_options, pdl_start

NB = 16  # bins per level: one-hot sums cost NB operations an entry; a level narrows a key range >= NB / 2-fold
WIDTH = 2.0  # nats per first-level bin: NB - 1 bins reach 30 nats below the max (exp(-30) ~ 1e-13 of its mass)
BLOCK = 2048  # entries per streamed block
STAGES = 3  # software-pipelined blocks in flight on a full-row pass (one program per row has no other latency cover)
NUM_WARPS = 8
_NEG_INF = float("-inf")
_NINF = tl.constexpr(_NEG_INF)  # the same, readable inside the kernels


@triton.jit
def _key(x):
    """fp32 -> int64 order key: the int32 bit pattern with negative floats' magnitude bits flipped, so the signed
    order of keys is the float order; -0.0 is folded into 0.0 first (they compare equal as floats)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _value(key):
    """The fp32 of an order key (`_key`'s inverse)."""
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _bins(x, m, lo, shift, FIRST: tl.constexpr, NB: tl.constexpr, WIDTH: tl.constexpr):
    """Each value's bin, non-decreasing in the value. FIRST: by distance below the row max m, WIDTH nats a bin, bin
    NB - 1 the max's, bin 0 everything at NB - 1 widths or more below it (-inf, and NaN); else by order key, runs
    of 2**shift keys from lo (`_shift`)."""
    if FIRST:
        d = (m - x) * (1.0 / WIDTH)  # >= 0; rounding is monotone, so the bins are
        return NB - 1 - tl.where(d < NB - 1, d, NB - 1).to(tl.int32)
    else:
        return ((_key(x) - lo) >> shift).to(tl.int32)


@triton.jit
def _row_max(src, n, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    top = tl.full([BLOCK], _NINF, tl.float32)
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        i = start + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(src + i, mask=i < n, other=_NINF))
    return tl.max(top, 0)


@triton.jit
def _histogram(src, n, m, lo, shift, FIRST: tl.constexpr, NB: tl.constexpr, WIDTH: tl.constexpr,
               BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Count and mass (sum of exp(x - m)) of src[:n] in each bin."""
    ids = tl.arange(0, NB)
    count = tl.zeros([NB], tl.int32)
    mass = tl.zeros([NB], tl.float32)
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        i = start + tl.arange(0, BLOCK)
        x = tl.load(src + i, mask=i < n, other=_NINF)
        hit = (_bins(x, m, lo, shift, FIRST, NB, WIDTH)[:, None] == ids[None, :]) & (i < n)[:, None]
        count += tl.sum(hit.to(tl.int32), 0)
        mass += tl.sum(tl.where(hit, tl.exp(x - m)[:, None], 0.0), 0)
    return count, mass


@triton.jit
def _choose(count, mass, rank, before, limit, BY_MASS: tl.constexpr, NB: tl.constexpr):
    """The bin that holds the cut, and the count and mass of the values above it (in higher bins: strictly larger).
    By rank: the bin of the rank-th largest value. By mass: the lowest non-empty bin whose largest value has less
    than `limit` before it (`before`, the mass above these values, plus the higher bins'): the nucleus needs it,
    and no lower bin's largest value (the top non-empty bin always qualifies: the caller's `before` < limit)."""
    ids = tl.arange(0, NB)
    higher = ids[None, :] > ids[:, None]  # [j, i]: bin i lies above bin j
    count_up = tl.sum(tl.where(higher, count[None, :], 0), 1)
    mass_up = tl.sum(tl.where(higher, mass[None, :], 0.0), 1)
    if BY_MASS:
        top = tl.max(tl.where(count > 0, ids, 0), 0)
        j = tl.min(tl.where((count > 0) & (before + mass_up < limit), ids, top), 0)
    else:
        j = tl.max(tl.where(count_up + count >= rank, ids, 0), 0)
    return j, tl.sum(tl.where(ids == j, count_up, 0), 0), tl.sum(tl.where(ids == j, mass_up, 0.0), 0)


@triton.jit
def _compact(src, n, dst, m, lo, shift, j, floor, FIRST: tl.constexpr, NB: tl.constexpr, WIDTH: tl.constexpr,
             BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Copy the values of src[:n] in bin j (and >= floor) to dst[0:], in order. src may be dst: a block's
    survivors land at or before its own start, and every thread has read the block before any writes. Returns
    their count and their least and largest order keys."""
    kept = tl.zeros([], tl.int32)
    lo_new = tl.full([], 1 << 40, tl.int64)
    hi_new = tl.full([], -(1 << 40), tl.int64)
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        i = start + tl.arange(0, BLOCK)
        x = tl.load(src + i, mask=i < n, other=_NINF)
        keep = (i < n) & (_bins(x, m, lo, shift, FIRST, NB, WIDTH) == j) & (x >= floor)
        key = _key(x)
        lo_new = tl.minimum(lo_new, tl.min(tl.where(keep, key, 1 << 40), 0))
        hi_new = tl.maximum(hi_new, tl.max(tl.where(keep, key, -(1 << 40)), 0))
        slot = kept + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.debug_barrier()  # in place: the whole block is read before its slots are written
        tl.store(dst + slot, x, mask=keep)
        kept += tl.sum(keep.to(tl.int32), 0)
    tl.debug_barrier()  # the candidates are visible to every thread of the program
    return kept, lo_new, hi_new


@triton.jit
def _shift(span, NB: tl.constexpr):
    """The least s with span >> s < NB: the keys lo .. lo + span fall in at most NB bins of 2**s keys each, and
    as span >> (s - 1) >= NB, a bin's keys span less than 2**s <= 2 * span / NB: each level narrows them >= 8x."""
    s = tl.zeros([], tl.int64)
    while (span >> s) >= NB:
        s += 1
    return s


@triton.jit
def _select(buf, n, lo, hi, m, rank, before, limit, BY_MASS: tl.constexpr, NB: tl.constexpr,
            WIDTH: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Refine the candidates buf[:n] (order keys in [lo, hi]) level by level to the one key of the cut (by rank:
    the rank-th largest; by mass: `_choose`'s rule). Returns (the cut, its ties among the candidates, the mass
    before it: `before` plus that of the candidates above it)."""
    while lo < hi:
        shift = _shift(hi - lo, NB)
        count, mass = _histogram(buf, n, m, lo, shift, False, NB, WIDTH, BLOCK, STAGES)
        j, count_up, mass_up = _choose(count, mass, rank, before, limit, BY_MASS, NB)
        rank -= count_up
        before += mass_up
        n, lo, hi = _compact(buf, n, buf, m, lo, shift, j, _NINF, False, NB, WIDTH, BLOCK, STAGES)
    return _value(lo), n, before


@triton.jit
def _sampling_cut_kernel(x_ptr, out_ptr, cut_ptr, k_ptr, p_ptr, V, NB: tl.constexpr, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """One program per row (module docstring)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * V
    buf = out_ptr + row * V  # scratch for the candidates until the output pass
    top_k = tl.load(k_ptr + row).to(tl.int64)
    top_p = tl.load(p_ptr + row)
    m = _row_max(src, V, BLOCK, STAGES)
    k_on = (top_k > 0) & (top_k < V) & (m > _NINF)
    p_on = (top_p < 1.0) & (m > _NINF)
    cut = tl.full([], _NINF, tl.float32)
    if k_on | p_on:
        ids = tl.arange(0, NB)
        count, mass = _histogram(src, V, m, 0, 1, True, NB, WIDTH, BLOCK, STAGES)
        zero = tl.zeros([], tl.float32)
        if k_on:
            j, count_up, _ = _choose(count, mass, top_k, zero, zero, False, NB)
            n, lo, hi = _compact(src, V, buf, m, 0, 1, j, _NINF, True, NB, WIDTH, BLOCK, STAGES)
            cut, ties, before = _select(buf, n, lo, hi, m, top_k - count_up, zero, zero, False, NB, WIDTH, BLOCK,
                                        STAGES)
            # top-p sees the row after this cut: bin j keeps the values >= cut, the bins below nothing
            kept = before + ties.to(tl.float32) * tl.exp(cut - m)
            mass = tl.where(ids > j, mass, tl.where(ids == j, kept, 0.0))
            count = tl.where(ids > j, count, tl.where(ids == j, ties, 0))  # non-empty bins only matter now
        if p_on:
            limit = tl.maximum(top_p * tl.sum(mass, 0), 0.5)  # 0.5: top_p <= 0 keeps the max (mass 1) and its ties
            j, _, before = _choose(count, mass, top_k, zero, limit, True, NB)
            n, lo, hi = _compact(src, V, buf, m, 0, 1, j, cut, True, NB, WIDTH, BLOCK, STAGES)
            cut, _, _ = _select(buf, n, lo, hi, m, top_k, before, limit, True, NB, WIDTH, BLOCK, STAGES)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        i = start + tl.arange(0, BLOCK)
        x = tl.load(src + i, mask=i < V)
        tl.store(buf + i, tl.where(x < cut, _NINF, x), mask=i < V)
    tl.store(cut_ptr + row, cut)


def _per_row(value, lead: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-row setting (a number, or a tensor broadcasting to [*lead, 1]) as a contiguous [rows] tensor, without
    a host copy (a CUDA graph may be capturing)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).expand(*lead, 1).reshape(-1)
    return torch.full((lead.numel(),), value, dtype=dtype, device=device)


def sampling_cut(x: torch.Tensor, top_k, top_p, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits x [..., V] (fp32) -> (x with the tokens that top-k and then top-p drop set to -inf, the cut values
    [..., 1]: -inf where nothing is cut). top_k: an int or a long tensor broadcasting to x[..., :1] (0 or >= V: off);
    top_p: a float or a float tensor likewise (>= 1: off). A new tensor; x is not changed. On a GPU, or on CPU
    tensors under the Triton interpreter; `block` (a power of two) is exposed for the tests."""
    V = x.shape[-1]
    lead = x.shape[:-1]
    rows = x.reshape(-1, V).float().contiguous()
    out = torch.empty_like(rows)
    cut = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _sampling_cut_kernel[(rows.shape[0],)](rows, out, cut, _per_row(top_k, lead, torch.long, x.device),
                                               _per_row(top_p, lead, torch.float32, x.device), V, NB=NB,
                                               WIDTH=WIDTH, BLOCK=block, STAGES=STAGES, num_warps=NUM_WARPS,
                                               **pdl_options(x.device))
    return out.view(x.shape), cut.view(*lead, 1)


def sampling_cut_reference(x: torch.Tensor, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling_cut` by its definition, with a sort of each row (any device; rows with a finite max): each sorted
    value's mass before it is that of the first of its ties, i.e. of the strictly larger values."""
    V = x.shape[-1]
    k = top_k if isinstance(top_k, torch.Tensor) else torch.tensor(top_k)
    p = top_p if isinstance(top_p, torch.Tensor) else torch.tensor(top_p)
    k, p = k.to(x.device).expand(*x.shape[:-1], 1), p.to(x.device, torch.float32).expand(*x.shape[:-1], 1)
    desc = x.float().sort(-1, descending=True).values
    kth = desc.gather(-1, (k.clamp(1, V) - 1).long())
    kth = torch.where((k > 0) & (k < V), kth, _NEG_INF)
    desc = torch.where(desc < kth, _NEG_INF, desc)
    probs = (desc - desc[..., :1]).exp()
    probs = probs / probs.sum(-1, keepdim=True)
    before = probs.cumsum(-1) - probs
    pos = torch.arange(V, device=x.device).expand_as(desc)
    first = torch.cat([torch.ones_like(desc[..., :1], dtype=torch.bool), desc[..., 1:] != desc[..., :-1]], -1)
    first_of_ties = torch.where(first, pos, 0).cummax(-1).values
    before = before.gather(-1, first_of_ties)
    kept = (before < p) | (first_of_ties == 0)
    cut_p = torch.where(kept, desc, float("inf")).amin(-1, keepdim=True)
    cut = torch.where(p < 1.0, torch.maximum(cut_p, kth), kth)
    return torch.where(x < cut, _NEG_INF, x.float()), cut
