"""Verification-set selection (paper Eq. 6) as sync-free tensor ops, plus StreamingLLM's fixed pattern.

Both return (indices int32 [B, k], counts int32 [B]) in the format `sparse_verify_attention` reads:
each row sorted ascending, slots at and after counts[b] padded with 0 (a valid position the kernel
ignores). Sorted rows keep the gathered cache rows in address order, which helps the sparse kernel.

Dustin's set for a sequence of length L > k:
  protected = [0, sinks) U [L - window, L)
  draft     = top-m of s_draft over the unprotected positions j < L
  target    = top-(k - |protected| - m) of s_target over what is left
If L <= k every position 0 .. L-1 is selected. m = 0 gives dustin-t; m = k - sinks - window dustin-d.

How, on the GPU (and under the Triton interpreter): a Triton pass writes both score rows masked to the
pickable positions (-inf elsewhere) into one [2B, S] buffer; one torch.topk takes n = k - sinks - window
picks from each row at once. The target list needs no second topk after the draft picks: dropping the (at
most m) draft picks from the target's top-n leaves at least n - m = the target budget, in rank order. A
second Triton kernel (one program per sequence) drops those, gathers protected + draft + target candidates
and sorts them (tl.sort, <= 1024 values) into the ascending row. Ties in a score are broken by torch.topk.
Every size is a Python int: no .item(), no boolean indexing, so it is CUDA-graph friendly. On an H200 this
took 80-120 us a step at B 8-16 x 8k-32k (docs/results/kernel_variants_h200.json): torch.topk's multi-block
radix select (~75 us for both rows) plus the launches around it. CPU tensors outside the Triton interpreter
take the pure torch path (`_select_dustin_torch`).
A three-launch variant without torch.topk (scripts/experiments/select_radix.py at commit a1b4c24) gives the same
sets but measured slower on an H200 (103-225 us against 79-99 us, docs/results/gpu_tune_h200.json).
Compile time counts too: a fresh process compiles these kernels in its first decode step. `in_list` loops over its
32-wide slices instead of unrolling them: compiling the tuned config's selection (k 512, m 352) for sm_90 took
1.65 s instead of 2.67 s (this repo's 2-core CPU, Triton 3.9, empty cache; the one-shot H200 run spent 4.2 s in
that step's selection phase). Its run time on the GPU was not re-measured (one program per sequence, ~20 us).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dustin.kernels.dispatch import interpreting
from dustin.kernels.launch import pdl_options, pdl_start, watched

_NEG_INF = float("-inf")


@triton.jit
def in_list(values, list_ptr, M: tl.constexpr, M_PAD: tl.constexpr):
    """Which of `values` occur among list_ptr[:M] (non-negative positions)."""
    found = tl.zeros(values.shape, dtype=tl.int32)
    for c0 in range(0, M_PAD, 32):  # 32-wide slices keep registers small; a loop, not unrolled: compiles fast
        c = c0 + tl.arange(0, 32)
        listed = tl.load(list_ptr + c, mask=c < M, other=-1).to(tl.int32)
        found = tl.maximum(found, tl.max((values[:, None] == listed[None, :]).to(tl.int32), 1))
    return found > 0


@triton.jit
def write_sorted_row(draft, target, keep, L, b, scratch_ptr, idx_ptr, counts_ptr, S,
                     SINKS: tl.constexpr, WINDOW: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                     NP_PAD: tl.constexpr, M_PAD: tl.constexpr, SW_PAD: tl.constexpr, P: tl.constexpr):
    """Sequence b's row: protected + draft[:M] + the kept target picks, sorted ascending into idx[b, :K]
    (0 .. L-1 when L <= K). They go to disjoint slots of a scratch row, then the barrier makes them visible
    to the whole program for the sort; unused slots hold the sentinel S."""
    row = scratch_ptr + b.to(tl.int64) * P
    i = tl.arange(0, SW_PAD)
    tl.store(row + i, tl.where(i < SINKS, i, L - WINDOW + i - SINKS), mask=i < SINKS + WINDOW)
    if M > 0:
        c = tl.arange(0, M_PAD)
        tl.store(row + SINKS + WINDOW + c, draft, mask=c < M)
    r = tl.arange(0, NP_PAD)
    tl.store(row + SINKS + WINDOW + M + r, tl.where(keep, target, S))
    slot = tl.arange(0, P)
    tl.store(row + slot, tl.full([P], S, tl.int32), mask=slot >= SINKS + WINDOW + M + NP_PAD)
    tl.debug_barrier()
    ordered = tl.sort(tl.load(row + slot))
    short = L <= K  # everything fits: 0 .. L-1
    value = tl.where(short, tl.where(slot < L, slot, 0), ordered)
    tl.store(idx_ptr + b * K + slot, value, mask=slot < K)
    tl.store(counts_ptr + b, tl.minimum(L, K))


@watched
@triton.jit
def _mask_scores_kernel(sd_ptr, st_ptr, lengths_ptr, out_ptr, S, sd_stride, st_stride,
                        SINKS: tl.constexpr, WINDOW: tl.constexpr, BOTH: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    """out [R, B, S] fp32 = the scores where a pick may come from (sinks <= j < L - window), else -inf;
    rows: draft then target when BOTH, else target only."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    n_seq = tl.num_programs(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    L = tl.load(lengths_ptr + b)
    pickable = (j >= SINKS) & (j < L - WINDOW)
    st = tl.load(st_ptr + b * st_stride + j, mask=pickable, other=float("-inf")).to(tl.float32)
    if BOTH:
        sd = tl.load(sd_ptr + b * sd_stride + j, mask=pickable, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + b * S + j, sd, mask=j < S)
        tl.store(out_ptr + (n_seq + b) * S + j, st, mask=j < S)
    else:
        tl.store(out_ptr + b * S + j, st, mask=j < S)


@watched
@triton.jit
def _assemble_kernel(ranked_ptr, lengths_ptr, scratch_ptr, idx_ptr, counts_ptr, S,
                     SINKS: tl.constexpr, WINDOW: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                     N_PICK: tl.constexpr, NP_PAD: tl.constexpr, M_PAD: tl.constexpr, SW_PAD: tl.constexpr,
                     P: tl.constexpr, PDL: tl.constexpr = False):
    """One sequence: protected + m draft picks + the first n - m target picks not taken by the draft,
    sorted ascending into idx[b, :K]; rows with L <= K get 0 .. L-1."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    n_seq = tl.num_programs(0)
    L = tl.load(lengths_ptr + b).to(tl.int32)
    r = tl.arange(0, NP_PAD)
    target_row = ranked_ptr + ((n_seq + b) if M > 0 else b) * N_PICK  # ranked: [R, B, N_PICK] int64
    target = tl.load(target_row + r, mask=r < N_PICK, other=-1).to(tl.int32)
    keep = r < N_PICK
    if M > 0:
        keep = keep & ~in_list(target, ranked_ptr + b * N_PICK, M, M_PAD)
    keep = keep & (tl.cumsum(keep.to(tl.int32), 0) <= N_PICK - M)
    c = tl.arange(0, M_PAD)
    draft = tl.load(ranked_ptr + b * N_PICK + c, mask=c < M, other=0).to(tl.int32)
    write_sorted_row(draft, target, keep, L, b, scratch_ptr, idx_ptr, counts_ptr, S, SINKS, WINDOW, K, M, NP_PAD,
                     M_PAD, SW_PAD, P)


def _all_positions(L: torch.Tensor, k: int):
    """Rows for sequences that fit in the budget: 0 .. L-1, then 0-padding; count L."""
    slot = torch.arange(k, device=L.device)[None, :]
    return torch.where(slot < L, slot, torch.zeros_like(slot)).to(torch.int32), L[:, 0].to(torch.int32)


def sort_row_width(k: int, m: int, sinks: int, window: int) -> int:
    """Padded width of the per-sequence sort row: protected + m draft + the target's n candidates."""
    return triton.next_power_of_2(sinks + window + m + triton.next_power_of_2(k - sinks - window))


def select_dustin(s_target: torch.Tensor, s_draft: torch.Tensor, lengths: torch.Tensor, *, k: int, m: int,
                  sinks: int = 4, window: int = 16, impl: str = "topk"):
    """s_target, s_draft: float [B, S] scores (higher = more important); lengths: int [B] committed
    positions (<= S). Returns (indices int32 [B, k], counts int32 [B]); counts[b] = min(lengths[b], k).
    impl: "topk" (the Triton kernels around torch.topk; CPU tensors outside the interpreter still get the
    torch ops) or "torch": plain torch ops, no Triton kernel specialized on (k, m), so an offline search
    that tries many m values (dustin profile) compiles nothing."""
    assert impl in ("topk", "torch"), f"impl {impl!r}: want 'topk' or 'torch'"
    B, S = s_target.shape
    assert s_draft.shape == (B, S) and k >= 1
    assert 0 <= m <= k - sinks - window, "the budget must hold the protected sinks, window and m draft picks"
    device = s_target.device
    n_pick = k - sinks - window
    if n_pick == 0:  # the budget holds only the protected positions: exactly StreamingLLM's set
        return select_streaming(lengths.to(device), k, sinks)
    if S <= k:  # every row fits (L <= S <= k)
        return _all_positions(lengths.to(device=device, dtype=torch.long)[:, None], k)
    p = sort_row_width(k, m, sinks, window)
    if impl == "torch" or p > 4096 or not (s_target.is_cuda or interpreting()):
        return _select_dustin_torch(s_target, s_draft, lengths, k=k, m=m, sinks=sinks, window=window)
    assert s_target.stride(1) == 1 and s_draft.stride(1) == 1
    lengths = lengths.to(device).contiguous()  # the kernels read lengths[b] at lengths_ptr + b
    rows = 2 if m > 0 else 1
    pdl = pdl_options(device)
    masked = torch.empty(rows, B, S, device=device, dtype=torch.float32)
    _mask_scores_kernel[(B, triton.cdiv(S, 1024))](s_draft, s_target, lengths, masked, S, s_draft.stride(0),
                                                   s_target.stride(0), SINKS=sinks, WINDOW=window,
                                                   BOTH=m > 0, BLOCK=1024, **pdl)
    ranked = masked.view(rows * B, S).topk(n_pick, dim=1).indices  # [R*B, n_pick], rank order
    scratch = torch.empty(B, p, device=device, dtype=torch.int32)
    indices = torch.empty(B, k, device=device, dtype=torch.int32)
    counts = torch.empty(B, device=device, dtype=torch.int32)
    _assemble_kernel[(B,)](ranked, lengths, scratch, indices, counts, S, SINKS=sinks, WINDOW=window, K=k, M=m,
                           N_PICK=n_pick, NP_PAD=triton.next_power_of_2(n_pick),
                           M_PAD=max(32, triton.next_power_of_2(m)), SW_PAD=triton.next_power_of_2(sinks + window),
                           P=p, num_warps=8, **pdl)
    return indices, counts


def rows_contain(members: torch.Tensor, queries: torch.Tensor, size: int,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Q] bool: whether row b's members (positions in [0, size); with `keep`, only those kept) include
    queries[b, i]. A [B, size] mask filled by scatter and read by gather costs O(size + members + queries) per row;
    comparing every query with every member costs O(queries x members), which for `--budget auto` without a cap
    at 16 x 32k was a [16, 32k, 22k] boolean tensor in every step."""
    mask = torch.zeros(members.shape[0], size + 1, dtype=torch.bool, device=members.device)
    slots = members if keep is None else torch.where(keep, members, torch.full_like(members, size))
    mask.scatter_(1, slots.long(), True)
    return mask.gather(1, queries.long())


def _select_dustin_torch(s_target, s_draft, lengths, *, k, m, sinks, window):
    """The same selection from torch ops only (CPU tensors; ~15 more launches on a GPU)."""
    B, S = s_target.shape
    device = s_target.device
    n_pick = k - sinks - window
    L = lengths.to(device=device, dtype=torch.long)[:, None]  # [B, 1]
    all_idx, all_counts = _all_positions(L, k)
    j = torch.arange(S, device=device)[None, :]
    pickable = (j >= sinks) & (j < L - window)  # for L > k: valid and unprotected
    scores = torch.stack((s_draft, s_target)) if m > 0 else s_target[None]
    ranked = scores.float().masked_fill(~pickable, _NEG_INF).flatten(0, 1).topk(n_pick, dim=1).indices
    ranked = ranked.view(-1, B, n_pick)
    target_pos = ranked[-1]
    draft_pos = ranked[0, :, :m] if m > 0 else target_pos[:, :0]
    # Skip target picks the draft already took; keep the first n_pick - m of the rest (rank order).
    in_draft = rows_contain(draft_pos, target_pos, S)
    target_keep = ~in_draft & ((~in_draft).cumsum(1) <= n_pick - m)
    window_pos = L - window + torch.arange(window, device=device)[None, :]
    candidates = torch.cat((torch.arange(sinks, device=device)[None, :].expand(B, sinks), window_pos,
                            draft_pos, target_pos), dim=1)
    keep = torch.cat((torch.ones_like(candidates[:, : sinks + window + m], dtype=torch.bool), target_keep), 1)
    # Dropped candidates sort last (sentinel S); exactly k are kept, so the first k are the answer.
    ordered = torch.where(keep, candidates, torch.full_like(candidates, S)).sort(dim=1).values[:, :k]
    short = L <= k
    indices = torch.where(short, all_idx, ordered.to(torch.int32))
    counts = torch.where(short[:, 0], all_counts, torch.full_like(all_counts, k))
    return indices, counts


def select_dustin_reference(s_target, s_draft, lengths, *, k, m, sinks=4, window=16):
    """Per-sequence Python version of `select_dustin` with sets; defines the expected result."""
    B = s_target.shape[0]
    indices = torch.zeros(B, k, dtype=torch.int32)
    counts = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        L = int(lengths[b])
        if L <= k:
            chosen = set(range(L))
        else:
            chosen = set(range(min(sinks, L))) | set(range(max(L - window, 0), L))
            rest = sorted((j for j in range(L) if j not in chosen), key=lambda j: -float(s_draft[b, j]))
            chosen |= set(rest[:m])
            rest = sorted((j for j in range(L) if j not in chosen), key=lambda j: -float(s_target[b, j]))
            chosen |= set(rest[: max(k - len(chosen), 0)])
        row = sorted(chosen)
        indices[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        counts[b] = len(row)
    return indices.to(s_target.device), counts.to(s_target.device)


def select_streaming(lengths: torch.Tensor, k: int, sinks: int = 4):
    """StreamingLLM's set: the first `sinks` positions plus the most recent k - sinks (all if L <= k)."""
    L = lengths.to(torch.long)[:, None]
    slot = torch.arange(k, device=lengths.device)[None, :]
    recent = L - k + slot  # slot s >= sinks maps to the (s - sinks)-th of the last k - sinks positions
    pos = torch.where(slot < sinks, slot, recent)
    pos = torch.where(L <= k, torch.where(slot < L, slot, torch.zeros_like(slot)), pos)
    return pos.to(torch.int32), torch.clamp(L[:, 0], max=k).to(torch.int32)
