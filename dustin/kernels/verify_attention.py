"""GQA-aware split-K (flash-decoding) attention for the verify step, in Triton, plus the PyTorch SDPA path.

Semantics are those of `dustin.attention.reference.verify_attention_reference` (see its module docstring).

Why this design: verifying T = gamma + 1 tokens against a long cache is memory-bound (a few FLOPs per K/V
byte), so the kernel must read each K/V row from HBM exactly once and keep every SM busy.
- One program owns one (sequence, KV head) pair and one slice ("split") of its key range. It loads the
  queries of the whole KV group - the G = Hq / Hkv heads x T tokens folded into G*T rows (row r = g*T + t,
  head-major, so a contiguous q is one contiguous [G*T, D] block) - and streams its K/V tiles once for all
  of them, with tl.dot for QK^T and PV. K/V are never repeated per query head.
- Splits (grid axis 0) give parallelism when B * Hkv alone cannot fill the GPU. Each split writes a partial
  (acc, running max m, running sum l) in fp32; the split of a (sequence, KV head) that finishes last (an arrival
  counter, dustin/kernels/arrival.py) merges them by log-sum-exp in split order, in the same launch
  (`merge=False`: a second, combine kernel does; same bits). Measured on the H200: the best grid is one wave of
  resident programs (see PROGRAMS_PER_SM): at B*Hkv = 64 that is 4 splits, and 8k..32k contexts read K/V at
  77-105% of the device copy bandwidth. Merging in the launch saves the combine kernel's launch: the 1.5B
  target's full attention at 16 x 32k 127.0 -> 124.0 us a layer (4.33 TB/s), 16 x 16k 69.1 -> 66.5 us
  (scripts/gpu_split_merge.py at commit 91e0610, docs/results/split_merge/).
  Each sequence spreads its OWN visible keys over the splits (`_row_split_size`): how its keys are cut, and
  so its output bits, depend only on its length, not on the batch's longest sequence or on the bound the grid
  is sized by. A serving slot sized for 24k positions holding a 2k sequence still uses every split (when the
  split size came from the bound, such a row got one program per KV head and decode slowed down), and a
  request's greedy output does not depend on its neighbours' lengths.
- A split holds at least MIN_TILES_PER_SPLIT key tiles: the streaming 0.5B draft's ~512-position window (9 tiles
  of 64) takes 3 splits of 3 tiles, merged in the launch: 7.97 us a layer at 16 x 32k (T 1) against 9.00 us for
  one program per (sequence, KV head) writing in place, and 9.52 us split with a combine launch (T 2: 8.84 /
  9.96 / 10.53 us). A single split (a short key range) normalises its result and writes the output itself
  (DIRECT): no partials, no counter.
- The grid is sized on the host from an upper bound (max_len or the cache capacity) with no device sync;
  splits past a sequence's own range return at once, so ragged batches cost only what they read and the
  launch is CUDA-graph friendly.
- Streaming (sinks/window) walks a "virtual" key range: the sink positions [0, n_sink) followed by the
  window positions [win_lo, end). Only ~sinks + window + T rows are read, whatever the sequence length.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dustin.kernels.arrival import arrival_counters, last_to_arrive, merge_partial
from dustin.kernels.dispatch import interpreting
from dustin.kernels.launch import H200_NUM_SMS, num_sms, pdl_options, pdl_start, watched

# Programs resident per SM at the default config (D 128: ~96 KB of K/V stages each, so two fit in 228 KB).
# Measured on the H200: one full wave (B*Hkv*splits <= 2 * SMs) beat 4+ programs per SM by 10-25%, and
# a grid just past a whole wave (e.g. 1.2-1.5 waves) is the worst case.
PROGRAMS_PER_SM = 2
# Key tiles per split at least (module docstring: 3 splits of 3 tiles beat 1 of 9 and 5 of 2 for the draft).
MIN_TILES_PER_SPLIT = 3


@triton.jit
def _visible_key_range(length, T: tl.constexpr, sinks, window, STREAMING: tl.constexpr):
    """(n_sink, win_lo, n_keys): virtual key v < n_sink is position v, else position win_lo + v - n_sink."""
    end = length + T
    if STREAMING:
        n_sink = tl.minimum(end, sinks)
        # The earliest query (p = length) sees j > length - window; window == 0 leaves only the sinks.
        win_lo = tl.where(window > 0, tl.maximum(n_sink, length - window + 1), end)
        return n_sink, win_lo, n_sink + end - win_lo
    else:
        return 0, 0, end


@triton.jit
def _row_split_size(n_keys, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split of ONE sequence: its own visible keys spread over the grid's splits, in whole tiles. From
    the sequence's own length only, so its partial sums, and so its output, do not depend on the other sequences
    of the batch or on the bound the grid was sized by (a server's slot capacity, a step graph's bucket)."""
    return tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N


@watched
@triton.jit(do_not_specialize=["sinks", "window"])
def _verify_attention_split_kernel(
        Q, K, V, Lengths, PartAcc, PartM, PartL, Out, Counters,
        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, so_b, so_h, so_t, so_d,
        n_kv_heads, num_splits, sinks, window, qk_scale_log2,
        T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        STREAMING: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, DIRECT: tl.constexpr,
        MERGE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_kv_heads).to(tl.int64)  # int64: batch offsets of a large cache overflow int32
    kv_head = (bh % n_kv_heads).to(tl.int64)
    length = tl.load(Lengths + b).to(tl.int32)
    n_sink, win_lo, n_keys = _visible_key_range(length, T, sinks, window, STREAMING)
    split_size = _row_split_size(n_keys, num_splits, BLOCK_N)
    start = split * split_size
    if start >= n_keys:  # the grid is sized for the longest sequence; shorter ones stop here
        return
    stop = tl.minimum(start + split_size, n_keys)

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < G * T
    group_head = rows // T
    pos = length + rows % T  # each row's query position
    dims = tl.arange(0, D)
    q_ptrs = (Q + b * sq_b + (kv_head * G + group_head)[:, None] * sq_h + (rows % T)[:, None] * sq_t
              + dims[None, :] * sq_d)
    q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)
    if UPCAST_DOT:  # Triton's CPU interpreter multiplies bf16 bit patterns as integers: use fp32 there
        q = q.to(tl.float32)

    p_dtype: tl.constexpr = V.dtype.element_ty  # P is rounded to the cache dtype for the PV product
    k_base = K + b * sk_b + kv_head * sk_h
    v_base = V + b * sv_b + kv_head * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for v0 in range(start, stop, BLOCK_N):
        virt = v0 + tl.arange(0, BLOCK_N)
        in_split = virt < stop
        if STREAMING:
            key_pos = tl.where(virt < n_sink, virt, virt - n_sink + win_lo)
        else:
            key_pos = virt
        k = tl.load(k_base + key_pos[:, None] * sk_s + dims[None, :] * sk_d, mask=in_split[:, None], other=0.0)
        v = tl.load(v_base + key_pos[:, None] * sv_s + dims[None, :] * sv_d, mask=in_split[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        visible = in_split[None, :] & (key_pos[None, :] <= pos[:, None])
        if STREAMING:
            visible = visible & ((key_pos[None, :] < sinks) | (key_pos[None, :] > pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key of this tile yet (causal/streaming): keep -inf - -inf from making NaNs.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if DIRECT:  # the only split: normalise and write the output here (no combine launch)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0 only on padding rows (not stored)
        o_ptrs = (Out + b * so_b + (kv_head * G + group_head)[:, None] * so_h + (rows % T)[:, None] * so_t
                  + dims[None, :] * so_d)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = (bh * num_splits + split) * (G * T) + rows
        tl.store(PartM + part, m_i, mask=row_valid)
        tl.store(PartL + part, l_i, mask=row_valid)
        tl.store(PartAcc + part[:, None] * D + dims[None, :], acc, mask=row_valid[:, None])
        if MERGE:  # the split of this (sequence, KV head) that finishes last merges them all (kernels/arrival.py)
            n_active = tl.cdiv(n_keys, split_size)  # the splits that did not exit early
            if last_to_arrive(Counters, bh, n_active):
                _merge_splits(PartAcc, PartM, PartL, Out, bh, b, kv_head, num_splits, n_active, rows,
                              so_b, so_h, so_t, so_d, T, G, D)


@triton.jit
def _merge_splits(PartAcc, PartM, PartL, Out, bh, b, kv_head, num_splits, n_active, rows, so_b, so_h, so_t, so_d,
                  T: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """Merge the n_active partials (acc, m, l) of (sequence, KV head) bh by log-sum-exp, in split order, for the
    given folded rows, and write them out. Loads through L2 (.cg): partials written by other SMs in this launch."""
    row_valid = rows < G * T
    dims = tl.arange(0, D)
    m_all = tl.full([rows.shape[0]], float("-inf"), tl.float32)
    l_all = tl.zeros([rows.shape[0]], tl.float32)
    acc = tl.zeros([rows.shape[0], D], tl.float32)
    for split in range(0, n_active):
        part = (bh * num_splits + split) * (G * T) + rows
        m_s = tl.load(PartM + part, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(PartL + part, mask=row_valid, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(PartAcc + part[:, None] * D + dims[None, :], mask=row_valid[:, None], other=0.0,
                        cache_modifier=".cg")
        m_all, l_all, acc = merge_partial(m_all, l_all, acc, m_s, l_s, acc_s)
    out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]  # l == 0 only on padding rows (not stored)
    o_ptrs = (Out + b * so_b + (kv_head * G + rows // T)[:, None] * so_h + (rows % T)[:, None] * so_t
              + dims[None, :] * so_d)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_valid[:, None])


@watched
@triton.jit(do_not_specialize=["sinks", "window"])
def _verify_attention_combine_kernel(
        PartAcc, PartM, PartL, Lengths, Out, so_b, so_h, so_t, so_d,
        n_kv_heads, num_splits, sinks, window,
        T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, STREAMING: tl.constexpr,
        BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    kv_head = (bh % n_kv_heads).to(tl.int64)
    length = tl.load(Lengths + b).to(tl.int32)
    _, _, n_keys = _visible_key_range(length, T, sinks, window, STREAMING)
    split_size = _row_split_size(n_keys, num_splits, BLOCK_N)
    n_active = tl.cdiv(n_keys, split_size)  # splits that did not exit early

    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    _merge_splits(PartAcc, PartM, PartL, Out, bh, b, kv_head, num_splits, n_active, rows, so_b, so_h, so_t, so_d,
                  T, G, D)


def use_pdl_for(programs: int, device: torch.device) -> dict:
    """Launch options of a split-kernel grid of `programs`: Programmatic Dependent Launch (when on,
    dustin/kernels/launch.py) only for a grid that fits on the SMs at once, such as the streaming draft's 3 splits
    x B x Hkv. A full attention over a long context (vanilla's, 8 splits x 16 x 2 at 32k) runs for ~125 us at
    the bandwidth limit; launched early, its programs would be placed on whatever SMs its predecessor had freed,
    not spread evenly (the likely cause, not profiled). Vanilla's step with PDL on was 10% slower than without on
    random weights before this rule, 1-2% on the real pair after it (docs/benchmarks.md, "Programmatic Dependent
    Launch": not one A/B of the rule alone)."""
    return pdl_options(device) if programs <= num_sms(device, H200_NUM_SMS) else {"PDL": False, "launch_pdl": False}


def key_upper_bound(seq_upper_bound: int, T: int, sinks: int = 0, window: int = 0) -> int:
    """Most keys one (sequence, head) visits, given seq_upper_bound >= max(lengths) + T (host ints only)."""
    if sinks > 0 or window > 0:
        return min(seq_upper_bound, sinks + (window + T - 1 if window > 0 else 0))
    return seq_upper_bound


def default_num_splits(n_kv_programs: int, n_keys: int, block_n: int, sms: int = H200_NUM_SMS,
                       programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per (sequence, KV head): the most that keep the grid within one wave of resident programs and give
    each split at least MIN_TILES_PER_SPLIT tiles of keys (one: written in place, no merge).

    n_kv_programs = B * Hkv; n_keys is the per-sequence key bound."""
    n_tiles = max(1, triton.cdiv(n_keys, block_n))
    return max(1, min(n_tiles // MIN_TILES_PER_SPLIT, programs_per_sm * sms // max(1, n_kv_programs)))


def default_launch_config(rows: int, head_dim: int) -> dict:
    """BLOCK_N / num_warps / num_stages for Hopper; bigger folded query blocks get more warps (registers)."""
    big = rows * head_dim > 64 * 128
    return {"block_n": 64, "num_warps": 8 if big else 4, "num_stages": 3}


def _check_inputs(q, k_cache, v_cache, lengths):
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"expected q [B,Hq,T,D] and caches [B,Hkv,S,D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, Hq, T, D = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                         f"do not match q {tuple(q.shape)}")
    Hkv = k_cache.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must have shape [{B}], got {tuple(lengths.shape)}")
    return B, Hq, Hkv, T, D


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, *,
                     sinks: int = 0, window: int = 0, scale: float | None = None, max_len: int | None = None,
                     num_splits: int | None = None, out: torch.Tensor | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, merge: bool = True) -> torch.Tensor:
    """Split-K Triton verify attention; see the module docstring. Returns out ([B, Hq, T, D], q.dtype).

    max_len: optional host bound on max(lengths) + T, used only to size the grid (default: cache capacity);
    keys past it are not read. block_n / num_warps / num_stages / num_splits override the tuned defaults.
    merge: several splits are merged by the last of them to finish, in the same launch (False: by a second,
    combine launch; the same bits, for A/B timing)."""
    B, Hq, Hkv, T, D = _check_inputs(q, k_cache, v_cache, lengths)
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"verify_attention supports power-of-two head dims 16..256, got D={D}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    G = Hq // Hkv
    rows = G * T
    block_m = max(16, triton.next_power_of_2(rows))  # tl.dot needs >= 16 rows
    if block_m > 256:
        raise ValueError(f"G*T = {G}*{T} = {rows} folded query rows exceed 256; split the verify step")
    config = default_launch_config(rows, D)
    block_n = block_n or config["block_n"]
    num_warps = num_warps or config["num_warps"]
    num_stages = num_stages or config["num_stages"]
    if sinks < 0 or window < 0:
        raise ValueError(f"sinks and window must be >= 0, got {sinks}, {window}")
    streaming = sinks > 0 or window > 0

    seq_bound = min(max_len, k_cache.shape[2]) if max_len is not None else k_cache.shape[2]
    n_keys = max(1, key_upper_bound(seq_bound, T, sinks, window))
    if num_splits is None:
        num_splits = default_num_splits(B * Hkv, n_keys, block_n, num_sms(q.device, H200_NUM_SMS))
    num_splits = max(1, min(num_splits, triton.cdiv(n_keys, block_n)))  # a split holds at least one tile
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    direct = num_splits == 1
    # One scratch allocation (fewer host calls per layer): partial acc, then running max m, then sum l.
    n_parts = 0 if direct else B * Hkv * num_splits * rows
    scratch = torch.empty(max(1, n_parts * (D + 2)), dtype=torch.float32, device=q.device)  # (1: unused)
    part_acc, part_m, part_l = (scratch[:n_parts * D], scratch[n_parts * D:n_parts * (D + 1)],
                                scratch[n_parts * (D + 1):])
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    upcast_dot = interpreting() and q.dtype == torch.bfloat16
    # fp32 callers want fp32 accuracy (no tf32); for 16-bit inputs the precision flag is moot.
    dot_precision = "ieee" if q.dtype == torch.float32 or upcast_dot else "tf32"
    pdl = pdl_options(q.device)
    merge = merge and not direct
    counters = arrival_counters(q.device, B * Hkv) if merge else scratch

    _verify_attention_split_kernel[(num_splits, B * Hkv)](
        q, k_cache, v_cache, lengths, part_acc, part_m, part_l, out, counters,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        Hkv, num_splits, sinks, window, scale * math.log2(math.e),
        T=T, G=G, D=D, BLOCK_M=block_m, BLOCK_N=block_n, STREAMING=streaming, DOT_PRECISION=dot_precision,
        UPCAST_DOT=upcast_dot, DIRECT=direct, MERGE=merge, num_warps=num_warps, num_stages=num_stages,
        **use_pdl_for(num_splits * B * Hkv, q.device))
    if direct or merge:
        return out
    combine_rows = min(16, triton.next_power_of_2(rows))
    _verify_attention_combine_kernel[(B * Hkv, triton.cdiv(rows, combine_rows))](
        part_acc, part_m, part_l, lengths, out, *out.stride(),
        Hkv, num_splits, sinks, window,
        T=T, G=G, D=D, ROWS=combine_rows, STREAMING=streaming, BLOCK_N=block_n, num_warps=4, **pdl)
    return out
