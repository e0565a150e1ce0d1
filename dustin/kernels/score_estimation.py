"""Importance-score estimation (paper Eq. 5, Sec. 4.2.3): the softmax mass that a few selected heads'
queries put on every committed context position, summed over heads, queries and layers into one
per-sequence score row.

    out[b, j] (+)= sum_{l, h, t} softmax_j(q[b, l, h, t] . k_all[layers[l], b, kv_heads[l, h], j] * scale)
                   for j < ctx_lengths[b]; the softmax of query (b, t) runs over keys
                   j <= query_positions[b, t] and j < key_lengths[b].

FlashAttention never materialises these probabilities, so they are recomputed for the few Semantic
Retrieval Heads only. Design:
- Both KV caches are one tensor [L, B, Hkv, S, D], so ONE estimate covers every configured layer
  (`attention_scores_multi`; `attention_scores` is its one-layer case). Layers may use different head
  sets; a kv_heads entry of -1 pads a layer with fewer heads.
- All Hs heads x Tq queries of a layer are folded into the rows of one tl.dot block (row r -> head
  r // Tq, query r % Tq). Pass 1 loads this Q tile once per program (it does not depend on the key
  block).
- Per key block, each DISTINCT KV head of the layer is loaded once and multiplied once with the Q rows of
  all heads on it (other rows zeroed), summed into one logit tile: heads sharing a KV head (GQA, e.g. 4
  draft heads on 2 KV heads) cost one K tile read, not one per head. Repeats and -1 pads are found in the
  kernel from kv_heads (no host-side table, no sync); their loads are masked off (no memory traffic) and
  their dots multiply zeros (cheaper on sm_90 than branching around them; see `_logits`).
- Pass 1 (grid B x P1 x layers, key blocks strided over the P1 programs so ragged lengths stay
  balanced) writes a per-program running (max, sum-exp) per row, and stores the scaled logits in an fp32
  scratch [B, L, rows, S].
- Pass 2 (grid B x P2): each program first reduces the P1 partials of its sequence to one log-sum-exp
  per (layer, row) itself (no combine launch), then owns disjoint key blocks, loops over the layers for
  each block, normalises the stored logits, and writes the summed probabilities to out[b, j] with a plain
  read-add-write (or a plain write with accumulate=False, which also zeroes the rest of the row and saves
  the caller's zero_()): no atomics, deterministic. Reading the logits instead of K again moves fewer
  bytes when rows * 4 B < Hkv_used * D * 2 B per key (1 target head at D 128: 8 B instead of 256 B per key).
  Measured on an H200 (scripts/gpu_kernel_variants.py at commit 91e0610), B 16 x 32k: S_target 58 vs 79 us for the old
  pass 2 that re-read K, S_draft over 3 layers 233 vs 263 us; also faster at 8k x 8. That two-pass path
  and a separate combine launch (3 launches) were deleted: they were slower at every measured shape. The
  price is the scratch: 4 B per (row, key), e.g. 100 MB for S_draft's 48 rows at B 16 x 32k.
- Head tiling: sm_90 codegen stages a K and a Q tile in shared memory for every unrolled slot of `_logits`,
  all live at once (12 target heads at D 128 asked for 450560 B; the H200 has 232448). Layers of > 4 heads
  (fewer at large Tq) are split into groups of consecutive heads, each one more launch entry (layers
  repeated, kv_heads -1 padded): softmax rows are independent, so the sum is unchanged; layers of <= 4
  heads launch as before. `_HeadSets` sorts heads by KV head, so GQA siblings mostly share a group and its
  K reads. H200, B 16 x 32k, CUDA graph, groups of 4 (other sizes): 12 heads x 1 query at D 128, 1 layer
  337 us (1/2/3/6 heads: 528/409/407/453), 4 layers 1351 us (2: 1261); 14 heads on 2 KV heads x 4 queries
  at D 64, 3 layers 963 us (7: 823). Each group re-reads its KV heads' keys. Within a group, an entry whose
  heads outnumber the cache's KV heads reads K through one slot per KV head (`_logits`' KV_SLOTS): 2 slots
  instead of 4 for the default pair's 4 heads on 2 KV heads, which leaves room for a third pipeline stage.
- No host syncs: grids depend only on shapes.
Measured on an H200 (bf16, CUDA graph, cold L2), B 16 x 32k, single pass, multi-layer: S_draft (4 heads on
2 KV heads x 4 queries, 3 Qwen2.5-0.5B layers) 233 us before the KV-dedup / Q-once loading, 224 us after;
S_target (1 head, 1 query, D 128) 57.6 us, 53.6 us with 128-key blocks (docs/results/gpu_tune_h200.json,
scripts/gpu_tune.py at commit 91e0610). S_draft moves ~400 MB of keys plus its logits scratch: ~1.8 TB/s, half the copy
bandwidth; 8 warps or fewer/more programs measured slower.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dustin.kernels.dispatch import interpreting
from dustin.kernels.launch import num_sms, pdl_options, pdl_start, watched

_LOG2E = 1.4426950408889634
# Heads (and rows: heads x queries) per launch entry at most: 4 slots x (128 keys + 16 rows) x D 128 x 2 B
# = 147456 B of K and Q tiles (+ 8192) fits sm_90's 232448 B; tests/kernels/test_kernels_compile.py asserts it.
_MAX_GROUP_HEADS = 4
_MAX_GROUP_ROWS = 64


@triton.jit
def _rows(b, l, kvh_ptr, klen_ptr, qpos_ptr, sp_b, sp_t, S_CAP,
          HS: tl.constexpr, TQ: tl.constexpr, R_PAD: tl.constexpr, HAS_KLEN: tl.constexpr,
          HAS_QPOS: tl.constexpr):
    """Per row of layer l: head, query index, KV head (-1: invalid row), validity, query position; and the
    key bound of sequence b."""
    rows = tl.arange(0, R_PAD)
    row_head = rows // TQ
    row_t = rows % TQ
    kvh = tl.load(kvh_ptr + l * HS + row_head, mask=rows < HS * TQ, other=-1)
    row_ok = (rows < HS * TQ) & (kvh >= 0)  # kv_heads -1 pads a layer with fewer heads
    key_end = S_CAP
    if HAS_KLEN:
        key_end = tl.minimum(tl.load(klen_ptr + b).to(tl.int64), S_CAP)
    if HAS_QPOS:
        qpos = tl.load(qpos_ptr + b * sp_b + row_t * sp_t, mask=row_ok, other=-1).to(tl.int64)
    else:  # the last cached token's query: position key_lengths[b] - 1
        qpos = tl.where(row_ok, key_end - 1, -1)
    return row_head, row_t, kvh, row_ok, qpos, key_end


@triton.jit
def _q_tile(q_ptr, b, l, row_head, row_t, row_ok, d, sq_b, sq_l, sq_h, sq_t):
    """Layer l's queries as one [R_PAD, D] tile (row r -> head r // TQ, query r % TQ; invalid rows zero)."""
    return tl.load(q_ptr + b * sq_b + l * sq_l + row_head[:, None] * sq_h + row_t[:, None] * sq_t + d[None, :],
                   mask=row_ok[:, None], other=0.0)


@triton.jit
def _logits(q, k_ptr, row_kv, b, lyr, j, j_ok, d, sk_l, sk_b, sk_h, sk_s,
            HS: tl.constexpr, TQ: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
            IEEE: tl.constexpr, KV_SLOTS: tl.constexpr):
    """Raw logits [R_PAD, BLOCK_N] of the rows of Q tile q (KV head row_kv per row) against keys j: one K tile
    read per distinct KV head of the layer, multiplied with all rows on that KV head in one tl.dot.

    KV_SLOTS > 0 (the cache has KV_SLOTS <= HS KV heads): one slot per KV head of the cache, skipped (masked
    load, zero rows) when no row uses it. Else one slot per head, standing for its KV head unless an earlier head
    used it. Each slot costs sm_90 codegen a staged K and Q tile in shared memory, so the fewer slots the more
    programs per SM: the draft's and the target's 4 score heads sit on 2 KV heads (2 slots instead of 4)."""
    s = tl.zeros([R_PAD, BLOCK_N], dtype=tl.float32)
    k_base = k_ptr + lyr * sk_l + b * sk_b
    rows = tl.arange(0, R_PAD)
    for h in tl.static_range(KV_SLOTS if KV_SLOTS > 0 else HS):
        # Which KV head the slot reads (-1: none). All of this depends on the layer only, not on the key block
        # (the compiler hoists it out of the key loop).
        if KV_SLOTS > 0:
            used = tl.sum((row_kv == h).to(tl.int32), 0)
            kvh = tl.where(used > 0, h, -1)
        else:
            kvh = tl.max(tl.where(rows == h * TQ, row_kv, -1), 0)
            seen = tl.sum(((rows < h * TQ) & (row_kv == kvh)).to(tl.int32), 0)
            kvh = tl.where(seen == 0, kvh, -1)
        k = tl.load(k_base + kvh.to(tl.int64) * sk_h + j[:, None] * sk_s + d[None, :],
                    mask=(j_ok & (j * 0 + kvh >= 0))[:, None], other=0.0)  # -1: pad or repeat, no read
        # The rows of every head on this KV head (none for -1: that dot multiplies zeros). Not under an
        # `if kvh >= 0`: sm_90 codegen then re-stages Q in shared memory and converts s in every taken
        # branch; unconditional, each slot's Q tile is staged once per program and s converted once.
        qh = tl.where((row_kv == kvh)[:, None], q, tl.zeros_like(q))
        if IEEE:  # fp32 callers, and the CPU interpreter whose bf16 tl.dot multiplies raw bit patterns
            s = tl.dot(qh.to(tl.float32), tl.trans(k.to(tl.float32)), s, input_precision="ieee")
        else:
            s = tl.dot(qh, tl.trans(k), s)
    return s


@watched
@triton.jit
def _score_pass1_kernel(q_ptr, k_ptr, layers_ptr, kvh_ptr, klen_ptr, qpos_ptr, ml_ptr, lg_ptr, qk_scale,
                        sq_b, sq_l, sq_h, sq_t, sk_l, sk_b, sk_h, sk_s, sp_b, sp_t, S_CAP,
                        NL: tl.constexpr, HS: tl.constexpr, TQ: tl.constexpr, D: tl.constexpr,
                        P1: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_KLEN: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_LAYERS: tl.constexpr,
                        IEEE: tl.constexpr, KV_SLOTS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride of a large cache overflows int32
    pid = tl.program_id(1)
    l = tl.program_id(2)
    lyr = tl.load(layers_ptr + l).to(tl.int64) if HAS_LAYERS else b * 0 + l  # int64 either way
    row_head, row_t, row_kv, row_ok, qpos, key_end = _rows(b, l, kvh_ptr, klen_ptr, qpos_ptr, sp_b, sp_t,
                                                           S_CAP, HS, TQ, R_PAD, HAS_KLEN, HAS_QPOS)
    key_end = tl.minimum(key_end, tl.max(qpos, 0) + 1)
    d = tl.arange(0, D)
    q = _q_tile(q_ptr, b, l, row_head, row_t, row_ok, d, sq_b, sq_l, sq_h, sq_t)  # once, not per key block
    rows = tl.arange(0, R_PAD)
    m_i = tl.full([R_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([R_PAD], dtype=tl.float32)
    for blk in range(pid, tl.cdiv(key_end, BLOCK_N), P1):
        j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < key_end
        s = _logits(q, k_ptr, row_kv, b, lyr, j, j_ok, d, sk_l, sk_b, sk_h, sk_s, HS, TQ, R_PAD, BLOCK_N, IEEE,
                    KV_SLOTS)
        s = tl.where(j_ok[None, :] & (j[None, :] <= qpos[:, None]), s * qk_scale, float("-inf"))
        # scratch [B, NL, HS*TQ, S_CAP]: pass 2 reads these instead of K
        lg = lg_ptr + ((b * NL + l) * (HS * TQ) + rows[:, None]) * S_CAP + j[None, :]
        tl.store(lg, s, mask=(rows < HS * TQ)[:, None] & j_ok[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    base = ml_ptr + ((b * NL + l) * P1 + pid) * 2 * R_PAD
    tl.store(base + rows, m_i)
    tl.store(base + R_PAD + rows, l_i)


@triton.jit
def _lse(ml_ptr, b, l, NL: tl.constexpr, P1: tl.constexpr, P_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Log2-sum-exp [R_PAD] of layer l's rows from the P1 pass-1 partials of sequence b."""
    p = tl.arange(0, P_PAD)
    rows = tl.arange(0, R_PAD)
    base = ml_ptr + ((b * NL + l) * P1 + p[:, None]) * 2 * R_PAD + rows[None, :]
    m = tl.load(base, mask=(p < P1)[:, None], other=-1.0e30)
    s = tl.load(base + R_PAD, mask=(p < P1)[:, None], other=0.0)
    m_max = tl.max(m, 0)
    s_tot = tl.sum(s * tl.exp2(m - m_max[None, :]), 0)
    # A row with no visible key (padding) gets +inf so its probabilities come out as exactly 0.
    return tl.where(s_tot > 0, m_max + tl.log2(tl.maximum(s_tot, 1e-30)), float("inf"))


@watched
@triton.jit
def _score_pass2_kernel(kvh_ptr, klen_ptr, ctx_ptr, qpos_ptr, ml_ptr, lg_ptr, out_ptr,
                        sp_b, sp_t, so_b, S_CAP, S_OUT,
                        NL: tl.constexpr, NL_PAD: tl.constexpr, HS: tl.constexpr, TQ: tl.constexpr,
                        P1: tl.constexpr, P_PAD: tl.constexpr, P2: tl.constexpr,
                        R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_KLEN: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_CTX: tl.constexpr,
                        ACCUMULATE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride of a large cache overflows int32
    pid = tl.program_id(1)
    rows = tl.arange(0, R_PAD)
    lidx = tl.arange(0, NL_PAD)
    # Every layer's log-sum-exp, held as one [NL_PAD, R_PAD] tile (Triton has no lists of tensors).
    lse_all = tl.full([NL_PAD, R_PAD], float("inf"), dtype=tl.float32)
    for l in range(NL):
        lse_all = tl.where(lidx[:, None] == l, _lse(ml_ptr, b, l, NL, P1, P_PAD, R_PAD)[None, :], lse_all)
    # (distinct names: Triton rejects a name re-bound with another type inside the loop below)
    _h0, _t0, _kv0, _ok0, _qpos0, key_end = _rows(b, 0, kvh_ptr, klen_ptr, qpos_ptr, sp_b, sp_t, S_CAP,
                                                  HS, TQ, R_PAD, HAS_KLEN, HAS_QPOS)
    out_end = tl.minimum(tl.load(ctx_ptr + b).to(tl.int64), key_end) if HAS_CTX else key_end
    n_out = S_OUT if not ACCUMULATE else out_end  # overwrite: zero the rest of the row too
    for blk in range(pid, tl.cdiv(n_out, BLOCK_N), P2):
        j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < out_end
        tot = tl.zeros([BLOCK_N], dtype=tl.float32)
        if blk * BLOCK_N < out_end:
            for l in range(NL):
                _head, _t, _kv, row_ok, qpos, _end = _rows(b, l, kvh_ptr, klen_ptr, qpos_ptr, sp_b, sp_t, S_CAP,
                                                           HS, TQ, R_PAD, HAS_KLEN, HAS_QPOS)
                lse = tl.sum(tl.where(lidx[:, None] == l, lse_all, 0.0), 0)
                # pass 1 stored every visible logit (j <= qpos < its key_end)
                visible = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= qpos[:, None])
                lg = lg_ptr + ((b * NL + l) * (HS * TQ) + rows[:, None]) * S_CAP + j[None, :]
                s = tl.load(lg, mask=visible, other=float("-inf"))
                tot += tl.sum(tl.where(visible, tl.exp2(s - lse[:, None]), 0.0), 0)
        o_ptrs = out_ptr + b * so_b + j
        if ACCUMULATE:
            tl.store(o_ptrs, tl.load(o_ptrs, mask=j_ok, other=0.0) + tot, mask=j_ok)
        else:
            tl.store(o_ptrs, tot, mask=j < S_OUT)


def _launch_config(B, NL, S_cap, r_pad, D, device, num_programs, block_n):
    # Key block: 128 keys for the smallest row tile (S_target: 1 head x 1 query; 53.6 vs 57.6 us with 64 at
    # 32k x 16 on an H200, docs/results/gpu_tune_h200.json), 64 up to 64 x 128 rows x dims (S_draft: 64 and
    # 128 within 1%), else 32.
    block_n = block_n or (128 if r_pad * D <= 16 * 128 else 64 if r_pad * D <= 64 * 128 else 32)
    n_blocks = triton.cdiv(S_cap, block_n)
    # ~4 programs per SM over the whole batch (an H200 sweep found 2-8 within 5% of each other); pass 1
    # splits them over the layers, pass 2 loops over the layers in every program.
    p2 = num_programs or triton.cdiv(4 * num_sms(device, 2), B)
    p1 = num_programs or triton.cdiv(4 * num_sms(device, 2), B * NL)
    return block_n, max(1, min(p1, n_blocks)), max(1, min(p2, n_blocks))


def _split_heads(q, layers, kv_heads, group):
    """Layer l's heads [i * group, (i + 1) * group) become launch entry l * ng + i (reading k_all layer
    layers[l]); the last group is padded with zero queries on KV head -1 (masked rows). Views when q's
    strides allow (it is contiguous from the estimators), else one small copy; no host sync."""
    B, NL, Hs, Tq, D = q.shape
    ng = triton.cdiv(Hs, group)
    if ng * group > Hs:
        q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, ng * group - Hs))
        kv_heads = torch.nn.functional.pad(kv_heads, (0, ng * group - Hs), value=-1)
    layers = torch.arange(NL, device=q.device, dtype=torch.int32) if layers is None else layers
    layers = layers[:, None].expand(NL, ng).contiguous().view(NL * ng)  # (a reshape may keep stride 0)
    return q.reshape(B, NL * ng, group, Tq, D), layers, kv_heads.reshape(NL * ng, group)


def attention_scores_multi(q, k_all, layers, kv_heads, key_lengths, query_positions, out, *, scale=None,
                           ctx_lengths=None, accumulate=True, num_programs=None, block_n=None, num_warps=None,
                           num_stages=None, group_heads=None, kv_slots=None):
    """Eq. 5 over several layers in one estimate (2 launches).

    q [B, NL, Hs, Tq, D] (any strides, last dim contiguous): layer l's queries; they read layer layers[l]
    of k_all [L, B, Hkv, S_cap, D], query head h reading KV head kv_heads[l, h] (int [NL, >= Hs]; -1 pads).
    layers: int [NL] device tensor, or None for layers 0 .. NL-1. key_lengths int [B] or None (no bound
    but S_cap and the query positions); query_positions int [B, Tq] (or [1, Tq]), or None for
    key_lengths[b] - 1. Adds the mass on j < ctx_lengths[b] (default: key_lengths, else S_cap) into out
    fp32 [B, >= S_cap]; accumulate=False writes it instead and zeroes the rest of the row. Returns out.
    num_programs / block_n / num_warps / num_stages / group_heads (heads per launch entry) override the
    launch (for tuning); kv_slots (default: when the cache has no more KV heads than a launch entry has heads)
    gives each KV head of the cache one slot of `_logits` instead of each head."""
    B, NL, Hs, Tq, D = q.shape
    S_cap = k_all.shape[3]
    assert k_all.dim() == 5 and k_all.shape[1] == B and k_all.shape[4] == D
    assert out.dtype == torch.float32 and out.shape[0] == B and out.shape[1] >= S_cap and out.stride(1) == 1
    assert q.stride(-1) == 1 and k_all.stride(-1) == 1 and D >= 16 and (D & (D - 1)) == 0
    # extra kv_heads columns past Hs are ignored (as they always were: callers share one longer table)
    assert kv_heads.shape[0] == NL and kv_heads.shape[1] >= Hs and (layers is None or layers.shape == (NL,))
    assert key_lengths is not None or query_positions is not None, "need key_lengths or query_positions"
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    ctx_lengths = key_lengths if ctx_lengths is None else ctx_lengths
    if query_positions is not None:
        query_positions = query_positions.expand(B, Tq) if query_positions.dim() == 2 else query_positions
    kv_heads = kv_heads[:, :Hs].to(device=q.device, dtype=torch.int32)
    group = group_heads or max(1, min(_MAX_GROUP_HEADS, _MAX_GROUP_ROWS // Tq))
    if Hs > group:  # tile over heads (module docstring): each group is one more launch entry
        group = triton.cdiv(Hs, triton.cdiv(Hs, group))  # balanced: 5 heads -> 3 + 2, not 4 + 1
        q, layers, kv_heads = _split_heads(q, layers, kv_heads, group)
        NL, Hs = q.shape[1], group
    r_pad = max(16, triton.next_power_of_2(Hs * Tq))
    block_n, p1, p2 = _launch_config(B, NL, S_cap, r_pad, D, q.device, num_programs, block_n)
    dev = q.device
    ml = torch.empty(B, NL, p1, 2, r_pad, device=dev, dtype=torch.float32)
    lg = torch.empty(B, NL, Hs * Tq, S_cap, device=dev, dtype=torch.float32)
    kv_heads = kv_heads.contiguous()
    dummy = kv_heads  # stands in for the absent optional tensors (never read: constexpr flags)
    ieee = q.dtype == torch.float32 or interpreting()
    n_kv = k_all.shape[2]
    slots = n_kv if (kv_slots if kv_slots is not None else n_kv <= Hs) else 0
    # H200, S_draft of the shipped config (11 layers x 4 heads on 2 KV heads x 4 queries, D 64), B 16 x 32k, both
    # passes: a slot per head, 2 stages 756 us; a slot per KV head, 2 stages 733 us, 3 stages 593 us (4: 607; 8
    # warps slower everywhere) (scripts/experiments/score_slots.py at commit a4c0172)
    stages = 3 if slots and D <= 64 else 2
    common = {"NL": NL, "HS": Hs, "TQ": Tq, "P1": p1, "R_PAD": r_pad, "BLOCK_N": block_n,
              "HAS_KLEN": key_lengths is not None, "HAS_QPOS": query_positions is not None,
              "num_warps": num_warps or (4 if r_pad <= 32 else 8), "num_stages": num_stages or stages,
              **pdl_options(q.device)}
    opt = lambda t: dummy if t is None else t  # noqa: E731
    sp = query_positions.stride() if query_positions is not None else (0, 0)
    _score_pass1_kernel[(B, p1, NL)](q, k_all, opt(layers), kv_heads, opt(key_lengths), opt(query_positions), ml,
                                     lg, scale * _LOG2E, *q.stride()[:4], *k_all.stride()[:4], *sp, S_cap, D=D,
                                     HAS_LAYERS=layers is not None, IEEE=ieee, KV_SLOTS=slots, **common)
    _score_pass2_kernel[(B, p2)](kv_heads, opt(key_lengths), opt(ctx_lengths), opt(query_positions), ml, lg, out,
                                 *sp, out.stride(0), S_cap, out.shape[1], NL_PAD=triton.next_power_of_2(NL),
                                 P_PAD=triton.next_power_of_2(p1), P2=p2, HAS_CTX=ctx_lengths is not None,
                                 ACCUMULATE=accumulate, **common)
    return out


def attention_scores(q_sel, k_cache, kv_heads, key_lengths, query_positions, out, **kw):
    """One layer: q_sel [B, Hs, Tq, D], k_cache [B, Hkv, S_cap, D], kv_heads int [Hs]; the rest (and the
    keywords: scale, ctx_lengths, accumulate, launch overrides) as in `attention_scores_multi`. Returns out."""
    return attention_scores_multi(q_sel[:, None], k_cache[None], None, kv_heads[None], key_lengths,
                                  query_positions, out, **kw)
