"""Quest (Tang et al., 2024): query-aware page selection, per KV head, for the sparse verify kernel.

Metadata: for every (layer, sequence, KV head, page of PAGE = 16 positions) the elementwise min and max of
the page's keys, [L, B, Hkv, n_pages, D] in the cache dtype (min/max of bf16 values are exact in bf16). A
partial last page uses its valid rows only; pages past a sequence's length are ignored by the scoring.

Score of page p for a KV head: sum over that head's query group (G heads x Tq queries) and over d of
max(q_d * min_d, q_d * max_d), an upper bound of q.k over the page. Since min_d <= max_d that term equals
relu(q_d) * max_d + min(q_d, 0) * min_d, so the whole group's score is two dot products,
Qp . max + Qn . min with Qp = sum of relu(q), Qn = sum of min(q, 0) over the group's rows: the kernel
reads each page's 2*D values once (n_pages * D * 2 elements per head: 1/8 of the K+V bytes at PAGE 16) and
needs no tl.dot (so no bf16-dot interpreter issue either).

Selection: the top k // PAGE pages per (sequence, KV head), the page holding position lengths-1 always
included (scored +inf), expanded to sorted positions [B, Hkv, K] + counts [B, Hkv] (K = k // PAGE * PAGE)
in `sparse_verify_attention`'s per-head format. Why the expansion needs no compaction: pages past the
length score -inf and have larger ids than every valid page, and only the newest valid page can be
partial, so after sorting page ids the valid positions form a prefix of each row. All host sizes come
from shapes: no .item(), CUDA-graph friendly. CPU tensors outside the Triton interpreter use torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dustin.kernels.dispatch import interpreting
from dustin.kernels.launch import num_sms, pdl_options, pdl_start, watched

PAGE_SIZE = 16


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


@watched
@triton.jit
def _page_minmax_kernel(k_ptr, before_ptr, after_ptr, mn_ptr, mx_ptr, n_pages,
                        sk_b, sk_h, sk_s, sm_b, sm_h, sm_p,
                        H_KV: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, BUILD: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program (sequence x KV head, j): page before//PAGE + j (page j when BUILD) from rows < after.
    BUILD also zeroes pages with no valid row; an update leaves untouched pages alone."""
    pdl_start(PDL)
    b = (tl.program_id(0) // H_KV).to(tl.int64)  # int64: b * stride of a large cache overflows int32
    h = (tl.program_id(0) % H_KV).to(tl.int64)
    after = tl.load(after_ptr + b).to(tl.int64)
    page = tl.program_id(1).to(tl.int64)
    if not BUILD:
        page += tl.load(before_ptr + b).to(tl.int64) // PAGE
    if page >= n_pages:
        return
    n_valid = tl.minimum(tl.maximum(after - page * PAGE, 0), PAGE)
    if not BUILD:
        if n_valid == 0:
            return
    r = tl.arange(0, PAGE)
    d = tl.arange(0, D)
    ok = r < n_valid
    k = tl.load(k_ptr + b * sk_b + h * sk_h + (page * PAGE + r)[:, None] * sk_s + d[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)  # fp32: the interpreter's bf16 min/max is unsafe
    mn = tl.min(tl.where(ok[:, None], k, float("inf")), 0)
    mx = tl.max(tl.where(ok[:, None], k, float("-inf")), 0)
    has = n_valid > 0
    dst = b * sm_b + h * sm_h + page * sm_p + d
    tl.store(mn_ptr + dst, tl.where(has, mn, 0.0).to(mn_ptr.dtype.element_ty))
    tl.store(mx_ptr + dst, tl.where(has, mx, 0.0).to(mx_ptr.dtype.element_ty))


@watched
@triton.jit
def _page_scores_kernel(q_ptr, mn_ptr, mx_ptr, lengths_ptr, out_ptr, n_pages, chunk,
                        sq_b, sq_h, sq_t, sm_b, sm_h, sm_p, so_b, so_h,
                        H_KV: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, R_PAD: tl.constexpr,
                        D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    """Program (sequence x KV head, c): scores of pages [c * chunk, (c + 1) * chunk); Qp/Qn built once.
    chunk is a runtime int (a multiple of BLOCK_P) so a new context length needs no recompile."""
    pdl_start(PDL)
    b = (tl.program_id(0) // H_KV).to(tl.int64)
    h = (tl.program_id(0) % H_KV).to(tl.int64)
    rows = tl.arange(0, R_PAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (h * G + rows // TQ)[:, None] * sq_h + (rows % TQ)[:, None] * sq_t
                + d[None, :], mask=(rows < G * TQ)[:, None], other=0.0).to(tl.float32)
    qp = tl.sum(tl.maximum(q, 0.0), 0)  # [D]
    qn = tl.sum(tl.minimum(q, 0.0), 0)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    newest = tl.where(length > 0, (length - 1) // PAGE, -1)
    base = b * sm_b + h * sm_h
    for p0 in range(tl.program_id(1) * chunk, tl.program_id(1) * chunk + chunk, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ok = (p * PAGE < length) & (p < n_pages)  # masked loads: pages past the length cost no bytes
        offs = base + p[:, None] * sm_p + d[None, :]
        mx = tl.load(mx_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        mn = tl.load(mn_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.sum(mx * qp[None, :] + mn * qn[None, :], 1)
        s = tl.where(ok, s, float("-inf"))
        s = tl.where(p == newest, float("inf"), s)  # the newest page is always selected
        tl.store(out_ptr + b * so_b + h * so_h + p, s, mask=p < n_pages)


def page_minmax(k_layer, lengths, out_min, out_max, *, lengths_before=None, max_new=None, page_size=PAGE_SIZE):
    """Write the min/max of pages of k_layer [B, Hkv, S_cap, D] (rows < lengths[b]) into out_min/out_max
    [B, Hkv, n_pages, D]. With lengths_before: only pages holding a position in [before, lengths) are
    rewritten (an update after appending); max_new (host bound on lengths - before) shrinks the grid."""
    B, H, S_cap, D = k_layer.shape
    n_pages = out_min.shape[2]
    assert n_pages * page_size >= S_cap and out_min.shape == out_max.shape == (B, H, n_pages, D)
    if not _use_triton(k_layer):
        mn, mx = page_minmax_reference(k_layer, lengths, page_size, n_pages)
        if lengths_before is not None:  # same result as the kernel: rewrite touched pages only
            p = torch.arange(n_pages, device=k_layer.device)[None, :]
            touched = ((p >= lengths_before.long()[:, None] // page_size)
                       & (p * page_size < lengths.long()[:, None]))[:, None, :, None]
            mn, mx = torch.where(touched, mn, out_min), torch.where(touched, mx, out_max)
        out_min.copy_(mn)
        out_max.copy_(mx)
        return out_min, out_max
    assert k_layer.stride(-1) == 1 and out_min.stride() == out_max.stride() and out_min.stride(-1) == 1
    assert D & (D - 1) == 0 and page_size & (page_size - 1) == 0
    build = lengths_before is None
    grid_pages = n_pages if build or max_new is None else min(n_pages, triton.cdiv(max_new, page_size) + 1)
    _page_minmax_kernel[(B * H, grid_pages)](
        k_layer, lengths if build else lengths_before, lengths, out_min, out_max, n_pages,
        *k_layer.stride()[:3], *out_min.stride()[:3], H_KV=H, PAGE=page_size, D=D, BUILD=build, num_warps=1,
        **pdl_options(k_layer.device))
    return out_min, out_max


def page_scores(q, page_min, page_max, lengths, *, page_size=PAGE_SIZE, out=None):
    """Quest page scores fp32 [B, Hkv, n_pages] for q [B, Hq, Tq, D] (the newest page +inf, pages past
    the length -inf)."""
    B, Hq, Tq, D = q.shape
    _, H, n_pages, _ = page_min.shape
    out = torch.empty(B, H, n_pages, device=q.device, dtype=torch.float32) if out is None else out
    if not _use_triton(q):
        return out.copy_(_page_scores_torch(q, page_min, page_max, lengths, page_size))
    assert q.stride(-1) == 1 and page_min.stride() == page_max.stride() and page_min.stride(-1) == 1
    assert out.stride(-1) == 1 and D & (D - 1) == 0
    block_p = 32  # 32 pages x D 128 x min+max in fp32 = 64 registers a thread at 4 warps
    # ~4 programs per SM over the batch, each a whole number of page blocks: q is re-read per program
    per_head = max(1, triton.cdiv(4 * num_sms(q.device, 4), B * H))
    chunk = triton.cdiv(triton.cdiv(n_pages, per_head), block_p) * block_p
    _page_scores_kernel[(B * H, triton.cdiv(n_pages, chunk))](
        q, page_min, page_max, lengths, out, n_pages, chunk, *q.stride()[:3], *page_min.stride()[:3],
        *out.stride()[:2], H_KV=H, G=Hq // H, TQ=Tq, R_PAD=max(2, triton.next_power_of_2(Hq // H * Tq)),
        D=D, PAGE=page_size, BLOCK_P=block_p, num_warps=4, **pdl_options(q.device))
    return out


def select_pages(scores, lengths, k, *, page_size=PAGE_SIZE):
    """Top k // page_size pages of scores [B, Hkv, n_pages] -> (indices int32 [B, Hkv, K], counts int32
    [B, Hkv]): each row the sorted positions < lengths[b] of the chosen pages, then 0-padding."""
    assert k >= page_size, "the budget must hold at least the newest page"
    n_sel = min(k // page_size, scores.shape[-1])
    pages = scores.topk(n_sel, dim=-1).indices.sort(dim=-1).values  # [B, H, n_sel], ascending ids
    pos = (pages[..., None] * page_size + torch.arange(page_size, device=scores.device)).flatten(-2)
    valid = pos < lengths.long()[:, None, None]  # a prefix of each row (see the module docstring)
    return torch.where(valid, pos, 0).to(torch.int32), valid.sum(-1, dtype=torch.int32)


def quest_select(q, page_min, page_max, lengths, k, *, page_size=PAGE_SIZE):
    """Quest's per-KV-head verification lists for the queries q: (indices [B, Hkv, K], counts [B, Hkv])."""
    return select_pages(page_scores(q, page_min, page_max, lengths, page_size=page_size), lengths, k,
                        page_size=page_size)


class QuestPages:
    """Quest metadata of every layer: min/max [L, B, Hkv, n_pages, D] in the cache dtype.
    `rows` (a batch slice) targets some sequences only, e.g. one being prefilled; k_cache_layer and the
    lengths then cover those rows only."""

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, capacity, dtype, device, page_size=PAGE_SIZE):
        self.page_size = page_size
        n_pages = triton.cdiv(capacity, page_size)
        self.kmin = torch.zeros(n_layers, batch, n_kv_heads, n_pages, head_dim, dtype=dtype, device=device)
        self.kmax = torch.zeros_like(self.kmin)

    def build(self, layer, k_cache_layer, lengths, rows: slice | None = None):
        """Recompute every page of `layer` from positions < lengths (after a prefill)."""
        rows = rows if rows is not None else slice(None)
        page_minmax(k_cache_layer, lengths, self.kmin[layer, rows], self.kmax[layer, rows],
                    page_size=self.page_size)

    def update(self, layer, k_cache_layer, lengths_before, lengths_after, rows: slice | None = None,
               max_new: int | None = None):
        """Recompute the pages holding positions lengths_before .. lengths_after - 1 (just appended)."""
        rows = rows if rows is not None else slice(None)
        page_minmax(k_cache_layer, lengths_after, self.kmin[layer, rows], self.kmax[layer, rows],
                    lengths_before=lengths_before, max_new=max_new, page_size=self.page_size)

    def select(self, layer, q, lengths, k):
        return quest_select(q, self.kmin[layer], self.kmax[layer], lengths, k, page_size=self.page_size)


# ---- plain PyTorch versions: the references the tests hold the kernels to, and the CPU path ----

def page_minmax_reference(k_layer, lengths, page_size=PAGE_SIZE, n_pages=None):
    """(min, max) [B, Hkv, n_pages, D] in k_layer's dtype over rows < lengths[b]; empty pages are 0."""
    B, H, S_cap, D = k_layer.shape
    n_pages = n_pages or triton.cdiv(S_cap, page_size)
    k = torch.zeros(B, H, n_pages * page_size, D, dtype=torch.float32, device=k_layer.device)
    k[:, :, :S_cap] = k_layer.float()
    ok = (torch.arange(n_pages * page_size, device=k.device)[None, :] < lengths.long()[:, None])
    ok = ok.view(B, 1, n_pages, page_size, 1)
    k = k.view(B, H, n_pages, page_size, D)
    has = ok.any(3)
    mn = torch.where(has, k.masked_fill(~ok, float("inf")).amin(3), 0.0)
    mx = torch.where(has, k.masked_fill(~ok, float("-inf")).amax(3), 0.0)
    return mn.to(k_layer.dtype), mx.to(k_layer.dtype)


def _mark_pages(s, lengths, page_size):
    p = torch.arange(s.shape[-1], device=s.device)[None, None, :]
    L = lengths.long()[:, None, None]
    s = s.masked_fill(p * page_size >= L, float("-inf"))
    return s.masked_fill((p == (L - 1) // page_size) & (L > 0), float("inf"))


def _page_scores_torch(q, page_min, page_max, lengths, page_size):
    B, Hq, Tq, D = q.shape
    H = page_min.shape[1]
    qg = q.float().reshape(B, H, Hq // H * Tq, D)
    qp, qn = qg.clamp_min(0).sum(2), qg.clamp_max(0).sum(2)  # [B, H, D]
    s = torch.einsum("bhpd,bhd->bhp", page_max.float(), qp) + torch.einsum("bhpd,bhd->bhp", page_min.float(), qn)
    return _mark_pages(s, lengths, page_size)


def page_scores_reference(q, page_min, page_max, lengths, page_size=PAGE_SIZE):
    """The literal Quest bound: sum over the group's heads, queries and d of max(q_d min_d, q_d max_d)."""
    B, Hq, Tq, D = q.shape
    H = page_min.shape[1]
    qg = q.float().reshape(B, H, Hq // H * Tq, 1, D)
    bound = torch.maximum(qg * page_min.float()[:, :, None], qg * page_max.float()[:, :, None])
    return _mark_pages(bound.sum(dim=(2, 4)), lengths, page_size)


def quest_select_reference(scores, lengths, k, page_size=PAGE_SIZE):
    """Per (sequence, head) Python version of `select_pages` (distinct scores: the same pages)."""
    B, H, n_pages = scores.shape
    n_sel = min(k // page_size, n_pages)
    indices = torch.zeros(B, H, n_sel * page_size, dtype=torch.int32)
    counts = torch.zeros(B, H, dtype=torch.int32)
    for b in range(B):
        L = int(lengths[b])
        for h in range(H):
            order = sorted(range(n_pages), key=lambda p: -float(scores[b, h, p]))[:n_sel]
            row = sorted(j for p in order for j in range(p * page_size, (p + 1) * page_size) if j < L)
            indices[b, h, : len(row)] = torch.tensor(row, dtype=torch.int32)
            counts[b, h] = len(row)
    return indices, counts
