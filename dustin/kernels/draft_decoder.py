"""A draft forward's decoder layers in one persistent kernel (csrc/draft_decoder.cu), and its PyTorch reference.

Why: launched as ~5 kernels a layer, the draft's forwards ran at ~4.5x their weight-read time: each kernel costs
~4 µs besides its bytes (docs/benchmarks.md). The persistent kernel runs one program per SM through an instruction
list planned here (`plan`), streams each program's next weight tiles into shared memory before it waits for their
inputs, and replaces kernel boundaries by counters in global memory. For an all-greedy batch it can also run the
final norm, the LM head and the argmax in the same launch (`greedy`, builds with K whole): the draft step then gets
tokens, not logits. Sampling keeps the LM head outside.

Scope: decode forwards (1 or 2 tokens a row, <= 64 token rows: a build for <= 32 and one for <= 64) of a streaming
draft (sinks + a recent window) on sm_90, bf16, at the shapes a tiling fits in shared memory (`tiling`: the
Qwen2.5-0.5B draft with K whole; Llama-3.2-1B and Qwen2.5-1.5B with K in halves). Anything else takes the per-layer
kernels, with the reason logged once (`dustin.models.draft_kernel.attach`). The build is one nvcc call per (shape,
tiling), cached on disk.

The instruction list (`plan`): per layer, five stages in order (QKV, ATT, O, GU, DOWN, as the kernel's header
describes), then for a greedy forward the LM head's tiles of 16 vocabulary rows (HEAD); their tiles dealt to the
SMs round-robin by one cursor that runs through every stage of every layer, so each program's list is in stage
order (a program only ever waits for an earlier stage: no deadlock), and consecutive stages start on different SMs
(balance). `reference_plan` and `reference_head` execute the same tiles in PyTorch, in stage order: the CPU's check
of the plan and of each tile's arithmetic; tests/kernels/test_draft_decoder.py also simulates the kernel's counters
over every program's list.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dustin.defaults import dustin_home
from dustin.kernels.dispatch import is_fake

log = logging.getLogger(__name__)

OP_QKV, OP_ATT, OP_O, OP_GU, OP_DOWN, OP_HEAD = range(6)
HEAD_ROWS = 16  # vocabulary rows of a HEAD instruction
ROWS = (32, 64)  # a build for forwards of <= 32 token rows, and one for <= 64 where a tiling fits
SMEM_LIMIT = 227 * 1024  # shared memory a program may take on sm_90
SOURCE = Path(__file__).with_name("csrc") / "draft_decoder.cu"


@dataclass(frozen=True)
class Shape:
    """The draft shapes a build is for."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    inter: int

    @classmethod
    def of(cls, args) -> "Shape":
        return cls(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.intermediate_size)


@dataclass(frozen=True)
class Tiling:
    """How a build cuts the work: q/k/v, o_proj and gate/up over `ksplit` pieces of K, down_proj over `dsplit` pieces
    of `down_n` columns each, the attention in chunks of `chunk` positions; for forwards of up to `rows` token rows."""

    ksplit: int = 1
    dsplit: int = 8
    down_n: int = 32
    chunk: int = 128
    rows: int = 32


def smem_bytes(shape: Shape, t: Tiling, nslot: int = 4) -> int:
    """The kernel's SMEM_BYTES for this shape and tiling (its formula, written again here to choose a tiling before
    compiling; tests/kernels/test_draft_decoder.py checks it against the build where nvcc exists)."""
    pad, kq, kc = 8, shape.dim // t.ksplit, shape.inter // t.dsplit
    slot = max(16 * (kq + pad), t.down_n * (kc + pad)) * 2
    a = t.rows * (max(kq, kc) + pad) * 2
    return nslot * slot + a + 8 * 32 * 16 + t.rows * 32 * 4 + 64 + nslot * 8 + t.rows * 8


def tiling(shape: Shape, rows: int = 32) -> Tiling | None:
    """The widest tiles that fit shared memory for forwards of up to `rows` token rows (fewest instructions): K
    unsplit if it fits, else in 2 or 4 pieces; down_proj's K in 8 pieces, else 16; 32 columns an instruction, else
    16 or 8. None: nothing fits."""
    chunk = 8192 // shape.head_dim  # the attention's K/V chunk in shared memory: 128 positions of 64 dims
    for ksplit in (1, 2, 4):
        for dsplit in (8, 16):
            for down_n in (32, 16, 8):
                t = Tiling(ksplit, dsplit, down_n, chunk, rows)
                if _divides(shape, t) and smem_bytes(shape, t) <= SMEM_LIMIT:
                    return t
    return None


def _divides(shape: Shape, t: Tiling) -> bool:
    return (shape.dim % t.ksplit == 0 and (shape.dim // t.ksplit) % 16 == 0 and shape.inter % (t.dsplit * 16) == 0
            and shape.dim % t.down_n == 0)


def unsupported(shape: Shape) -> str | None:
    """Why the kernel cannot run this shape (None: it can)."""
    if shape.head_dim not in (64, 128):
        return f"head_dim {shape.head_dim} (64 or 128)"
    if shape.n_heads * shape.head_dim != shape.dim:
        return f"query heads x head_dim ({shape.n_heads * shape.head_dim}) differs from the hidden size {shape.dim}"
    if shape.n_heads % shape.n_kv_heads:
        return "query heads not a multiple of KV heads"
    if tiling(shape) is None:
        return (f"no tiling of hidden {shape.dim} / intermediate {shape.inter} fits {SMEM_LIMIT // 1024} KiB of "
                f"shared memory (K in up to 4 pieces, multiples of 16)")
    return None


# ---- the instruction list ------------------------------------------------------------------------------------
def stage_tiles(shape: Shape, t: Tiling, M: int, nchunk: int, layer: int) -> list[list[tuple[int, int, int, int]]]:
    """The tiles (op, layer, a, b) of one layer's five stages, in stage order (the kernel's encoding: b is the K
    split of a GEMM instruction; a q/k/v instruction's a is head * head_dim / 2 + its first half-dim)."""
    half, gq, nq, nkv = shape.head_dim // 2, shape.n_heads // shape.n_kv_heads, shape.n_heads, shape.n_kv_heads
    # KV head g's q heads, its k head and its v head together, g = 0 first: the attention of g waits only for those
    heads = [h for g in range(nkv) for h in [*range(g * gq, (g + 1) * gq), nq + g, nq + nkv + g]]
    # a group's K splits side by side (split innermost): a group completes as early in its stage as it can
    qkv = [(OP_QKV, layer, h * half + j, s) for h in heads for j in range(0, half, 4) for s in range(t.ksplit)]
    att = [(OP_ATT, layer, m, g * nchunk + c) for g in range(nkv) for c in range(nchunk) for m in range(M)]
    o = [(OP_O, layer, n, s) for n in range(0, shape.dim, 8) for s in range(t.ksplit)]
    gu = [(OP_GU, layer, c, s) for c in range(0, shape.inter, 8) for s in range(t.ksplit)]
    down = [(OP_DOWN, layer, n, s) for s in range(t.dsplit) for n in range(0, shape.dim, t.down_n)]
    return [qkv, att, o, gu, down]


def head_tiles(n_layers: int, vocab: int) -> list[tuple[int, int, int, int]]:
    """The LM head's tiles of a greedy forward: 16 vocabulary rows each, the first `vocab` rows covered (layer field
    n_layers: they wait for the last layer's down_proj as a next layer's q/k/v would)."""
    return [(OP_HEAD, n_layers, v, 0) for v in range(0, vocab, HEAD_ROWS)]


def plan(shape: Shape, t: Tiling, n_layers: int, M: int, nchunk: int, n_sms: int,
         vocab: int = 0) -> list[list[tuple[int, int, int, int]]]:
    """Each program's instruction list (module docstring); vocab > 0: a greedy forward's, with the LM head's tiles
    (builds with K whole only: `Tiling.ksplit` 1)."""
    if vocab and t.ksplit != 1:
        raise ValueError("the LM head runs in builds with K whole (ksplit 1)")
    lists: list[list] = [[] for _ in range(n_sms)]
    stages = [tiles for layer in range(n_layers) for tiles in stage_tiles(shape, t, M, nchunk, layer)]
    cursor = 0
    for tiles in stages + ([head_tiles(n_layers, vocab)] if vocab else []):
        for tile in tiles:
            lists[cursor % n_sms].append(tile)
            cursor += 1
    return lists


def n_chunks(t: Tiling, sinks: int, window: int) -> int:
    return math.ceil((sinks + window) / t.chunk)


# ---- the PyTorch reference of the plan -----------------------------------------------------------------------
def _bf(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the activation dtype and back to fp32 (the kernel's `bf`)."""
    return x.to(dtype).float()


def reference_plan(model, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, *, T: int, sinks: int, window: int,
                   tiles: Tiling | None = None, q_capture: dict[int, torch.Tensor] | None = None,
                   trace: dict | None = None) -> torch.Tensor:
    """What the kernel computes, tile by tile in stage order, in PyTorch: h [M, dim] (the embeddings) -> the last
    layer's residual stream [M, dim]; k_cache / v_cache [L, B, Hkv, S, D] get each layer's new keys and values;
    q_capture[layer] [M, Hq * D] the rotated queries of the layers it names. `model` is a fused `Transformer`;
    `tiles` the build's tiling (default: `tiling` of the model's shape); `trace` gets the last layer's scratch as the
    kernel leaves it (q, attn, act: where a GPU check localizes a wrong stage) and every layer's output (h, a
    list). Slow on purpose: it checks `plan`'s tiles, the K splits' sums and each tile's rounding against the model's
    own forward."""
    a = model.args
    shape, dt = Shape.of(a), h.dtype
    t = tiles or tiling(shape)
    M, HD, NQ, NKV, inter = h.shape[0], a.head_dim, a.n_heads, a.n_kv_heads, a.intermediate_size
    GQ, nchunk, half = NQ // NKV, n_chunks(t, sinks, window), a.head_dim // 2
    h = h.clone()
    pos = positions.reshape(-1).long()
    for li, layer in enumerate(model.layers):
        at, mlp = layer.self_attn, layer.mlp
        q = torch.empty(M, NQ * HD, dtype=dt, device=h.device)
        attn = torch.empty_like(q)
        act = torch.empty(M, inter, dtype=dt, device=h.device)
        parts: dict = {}
        x = _norm(h, layer.input_layernorm)
        for op, _, ta, tb in [tile for stage in stage_tiles(shape, t, M, nchunk, li) for tile in stage]:
            if op == OP_ATT:
                m, g, c = ta, tb // nchunk, tb % nchunk
                parts[(m, g, c)] = _attention_chunk(q[m, g * GQ * HD:(g + 1) * GQ * HD].view(GQ, HD),
                                                    k_cache[li, m // T, g], v_cache[li, m // T, g], int(pos[m]),
                                                    c, sinks, window, t.chunk)
                if c == nchunk - 1:
                    merged = _merge([parts[(m, g, i)] for i in range(nchunk)])
                    attn[m, g * GQ * HD:(g + 1) * GQ * HD] = merged.reshape(-1).to(dt)
                continue
            if op == OP_GU and ta == 0 and tb == 0:
                x = _norm(h, layer.post_attention_layernorm)
            if op == OP_QKV:
                head, j0 = divmod(ta, half)
                rows = [head * HD + j0 + r for r in range(4)] + [head * HD + half + j0 + r for r in range(4)]
                src, w, splits = x, at.qkv_proj.weight[rows], t.ksplit
            elif op == OP_O:
                src, w, splits = attn, at.o_proj.weight[ta:ta + 8], t.ksplit
            elif op == OP_GU:
                src, splits = x, t.ksplit
                w = torch.cat([mlp.gate_up_proj.weight[ta:ta + 8], mlp.gate_up_proj.weight[inter + ta:inter + ta + 8]])
            else:
                src, w, splits = act, mlp.down_proj.weight[ta:ta + t.down_n], t.dsplit
            kw = src.shape[1] // splits
            k = slice(tb * kw, (tb + 1) * kw)
            parts.setdefault((op, ta), []).append(src[:, k].float() @ w[:, k].float().T)
            if tb < splits - 1:
                continue
            out = parts[(op, ta)][0]
            for more in parts[(op, ta)][1:]:  # the splits in split order
                out = out + more
            if op == OP_QKV:
                if at.qkv_proj.bias is not None:
                    out = out + at.qkv_proj.bias[rows].float()
                out = _bf(out, dt)
                x1, x2 = out[:, :4], out[:, 4:]
                d = slice(j0, j0 + 4)
                if head < NQ + NKV:
                    c, sn = cos[:, d].float(), sin[:, d].float()
                    x1, x2 = x1 * c - x2 * sn, x2 * c + x1 * sn
                if head < NQ:
                    q[:, head * HD + j0: head * HD + j0 + 4] = x1.to(dt)
                    q[:, head * HD + half + j0: head * HD + half + j0 + 4] = x2.to(dt)
                else:
                    cache, g = (k_cache, head - NQ) if head < NQ + NKV else (v_cache, head - NQ - NKV)
                    for m in range(M):
                        cache[li, m // T, g, pos[m], d] = x1[m].to(dt)
                        cache[li, m // T, g, pos[m], half + j0: half + j0 + 4] = x2[m].to(dt)
            elif op == OP_GU:
                g_, u_ = _bf(out[:, :8], dt), _bf(out[:, 8:], dt)
                act[:, ta:ta + 8] = (g_ / (1 + torch.exp(-g_)) * u_).to(dt)
            else:  # o_proj, down_proj: the residual add
                n = out.shape[1]
                h[:, ta:ta + n] = (h[:, ta:ta + n].float() + _bf(out, dt)).to(dt)
        if q_capture is not None and li in q_capture:
            q_capture[li].copy_(q)
        if trace is not None:
            trace.update(q=q, attn=attn, act=act)
            trace.setdefault("h", []).append(h.clone())
    return h


def reference_head(model, h: torch.Tensor, T: int, vocab: int) -> torch.Tensor:
    """What the HEAD tiles compute from the last layer's residual stream h [M, dim] (`reference_plan`'s output):
    each batch row's greedy token at its last position, [M / T] long: the argmax of the first `vocab` logits, each
    an fp32 dot product of the final RMSNorm's output with a row of the LM head, rounded to the activation dtype,
    ties to the smallest id (torch.argmax's first maximum), 16 rows a tile as the kernel folds them."""
    x = _norm(h[T - 1::T], model.norm).float()
    w = model.lm_head.weight
    best_v = torch.full((x.shape[0],), -math.inf)
    best_i = torch.zeros(x.shape[0], dtype=torch.long)
    for v0 in range(0, vocab, HEAD_ROWS):
        rows = range(v0, min(v0 + HEAD_ROWS, vocab))
        logits = _bf(x @ w[v0:v0 + len(rows)].float().T, h.dtype).cpu()
        i = logits.argmax(-1)  # the first maximum within the tile; a later tile must be strictly larger
        v = logits.gather(1, i[:, None])[:, 0]
        take = v > best_v
        best_v, best_i = torch.where(take, v, best_v), torch.where(take, i + v0, best_i)
    return best_i.to(h.device)


def _norm(h: torch.Tensor, norm) -> torch.Tensor:
    xf = h.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (norm.weight.float() * _bf(xf * rstd, h.dtype)).to(h.dtype)


def _attention_chunk(q, k, v, p: int, chunk: int, sinks: int, window: int, size: int):
    """One ATT instruction: q [GQ, D] over chunk `chunk` (of `size` positions) of p's streaming window -> (o [GQ, D]
    unnormalized, max [GQ], sum [GQ])."""
    s0 = min(sinks, p + 1)
    start = max(s0, p - window + 1) if window > 0 else s0
    idx = list(range(s0)) + list(range(start, p + 1))
    idx = idx[chunk * size:(chunk + 1) * size]
    if not idx:
        z = torch.zeros(q.shape[0], device=q.device)
        return torch.zeros(q.shape, device=q.device), z - math.inf, z
    at = torch.tensor(idx, device=q.device)
    s = (q.float() / math.sqrt(q.shape[1])) @ k[at].float().T
    mx = s.max(-1).values
    e = torch.exp(s - mx[:, None])
    return e @ v[at].float(), mx, e.sum(-1)


def _merge(parts):
    mx = torch.stack([p[1] for p in parts]).max(0).values
    num = torch.zeros_like(parts[0][0])
    den = torch.zeros_like(mx)
    for o, m, s in parts:
        if bool((s > 0).any()):
            w = torch.where(s > 0, torch.exp(m - mx), torch.zeros_like(mx))
            num, den = num + w[:, None] * o, den + w * s
    return num / den[:, None]


# ---- the build -------------------------------------------------------------------------------------------------
class BuildError(RuntimeError):
    pass


def find_nvcc() -> str | None:
    """nvcc under $CUDA_HOME (or $CUDA_PATH), else on PATH, else /usr/local/cuda's; None: no nvcc."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and Path(home, "bin", "nvcc").exists():
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc") or (str(Path("/usr/local/cuda/bin/nvcc")) if Path("/usr/local/cuda/bin/nvcc").exists()
                                    else None)


def compile_flags(shape: Shape, t: Tiling, timeline: bool = False) -> list[str]:
    """nvcc's flags for a build. timeline: the profiling build, which records when each instruction reached each
    stage of its work (`DraftDecoder.timeline`; scripts/gpu_draft_timeline.py reads it)."""
    # -lineinfo: source lines in profilers (Nsight Compute's stall sampling), no change to the code
    return ["-arch=sm_90a", "-O3", "-lineinfo", "-std=c++17", "--shared", "-Xcompiler", "-fPIC",
            f"-DDIM={shape.dim}", f"-DN_HEADS={shape.n_heads}", f"-DN_KV_HEADS={shape.n_kv_heads}",
            f"-DHEAD_DIM={shape.head_dim}", f"-DINTER={shape.inter}", f"-DKSPLIT={t.ksplit}", f"-DDSPLIT={t.dsplit}",
            f"-DDOWN_COLS={t.down_n}", f"-DCHUNK_POS={t.chunk}", f"-DMAX_TOKEN_ROWS={t.rows}",
            *(["-DDRAFT_TIMELINE"] if timeline else [])]


def cache_dir() -> Path:
    """$DUSTIN_HOME/kernels (~/.cache/dustin/kernels): where the builds are kept."""
    return dustin_home() / "kernels"


def build(shape: Shape, t: Tiling, timeline: bool = False) -> Path:
    """The kernel's shared library for `shape` and tiling `t` (timeline: the profiling build, `compile_flags`):
    compiled by nvcc unless the cache directory holds it (under a hash of the source and flags; ~5-10 s). Raises
    BuildError without nvcc or when the build fails."""
    flags = compile_flags(shape, t, timeline)
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    path = cache_dir() / f"draft_decoder-{key}.so"
    if not path.exists():
        nvcc = find_nvcc()
        if nvcc is None:
            raise BuildError("nvcc not found (set CUDA_HOME)")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            r = subprocess.run([nvcc, *flags, "-o", str(out), str(SOURCE)], capture_output=True, text=True)
            if r.returncode != 0:
                raise BuildError(f"nvcc failed: {r.stderr.strip()[-2000:]}")
            os.replace(out, path)  # atomic: a concurrent build of the same key writes the same file
    return path


def build_all(shape: Shape) -> dict[int, str]:
    """Every build a draft of `shape` may use (`dustin warmup`): token rows -> the library's path, or why not."""
    out = {}
    for rows in ROWS:
        t = tiling(shape, rows)
        try:
            out[rows] = str(build(shape, t)) if t is not None else f"unsupported: {unsupported(shape)}"
        except BuildError as e:
            out[rows] = f"build failed: {e}"
    return out


# Every function of the build that the host calls, with its C signature: `bind` looks each one up, so a name the
# library does not export fails at load (and in the compile test, tests/kernels), not at the first launch.
EXPORTS: dict[str, tuple] = {
    "draft_layers_launch": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]),
    "draft_layers_configure": (ctypes.c_int, []),
    "draft_layers_smem_bytes": (ctypes.c_int, []),
    "draft_layers_arrivals_per_layer": (ctypes.c_int, []),
    "draft_layers_counters_per_layer": (ctypes.c_int, []),
    "draft_layers_params_bytes": (ctypes.c_int, []),
    "draft_layers_shape": (ctypes.c_int, [ctypes.c_void_p]),
}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the signature of every function in `EXPORTS` on a loaded build, and check that its Params is `_Params`.
    Raises BuildError naming the functions the library lacks."""
    missing = [name for name in EXPORTS if not hasattr(lib, name)]
    if missing:
        raise BuildError(f"{lib._name} does not export {', '.join(missing)}")
    for name, (restype, argtypes) in EXPORTS.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, argtypes
    if lib.draft_layers_params_bytes() != ctypes.sizeof(_Params):
        raise BuildError("the kernel's Params struct and _Params differ")
    return lib


@functools.lru_cache(maxsize=None)
def library(shape: Shape, t: Tiling, timeline: bool = False) -> ctypes.CDLL:
    """The built kernel for `shape` and tiling `t` (`build`), loaded and bound (`bind`). Raises BuildError without
    nvcc or when the build fails."""
    return bind(ctypes.CDLL(str(build(shape, t, timeline))))


class _Params(ctypes.Structure):  # the kernel's Params, field for field
    _fields_ = [("layers", ctypes.c_void_p), ("ins", ctypes.c_void_p), ("n_ins", ctypes.c_void_p),
                ("wins", ctypes.c_void_p), ("n_wins", ctypes.c_void_p), ("ins_stride", ctypes.c_int),
                ("n_layers", ctypes.c_int), ("M", ctypes.c_int), ("T", ctypes.c_int),
                ("h", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p), ("cache_b", ctypes.c_int64),
                ("cache_s", ctypes.c_int64), ("sinks", ctypes.c_int), ("window", ctypes.c_int),
                ("nchunk", ctypes.c_int), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("q", ctypes.c_void_p), ("q_capture", ctypes.c_void_p), ("attn", ctypes.c_void_p),
                ("act", ctypes.c_void_p), ("att_part", ctypes.c_void_p), ("down_part", ctypes.c_void_p),
                ("qkv_part", ctypes.c_void_p), ("o_part", ctypes.c_void_p), ("gu_part", ctypes.c_void_p),
                ("counters", ctypes.c_void_p), ("arrivals", ctypes.c_void_p), ("lm_head", ctypes.c_void_p),
                ("norm_w", ctypes.c_void_p), ("vocab", ctypes.c_int), ("vocab_rows", ctypes.c_int),
                ("best", ctypes.c_void_p), ("timeline", ctypes.c_void_p)]

TIMELINE_MARKS = ("start", "inputs", "staged", "weights", "gemm", "end")  # the kernel's Mark, in order: SM clocks
TIMELINE_FIELDS = 8  # the marks, then %globaltimer (ns) at the start and the SM's id


# ---- the runtime ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Build:
    tiles: Tiling
    lib: ctypes.CDLL
    nchunk: int


class DraftDecoder:
    """The persistent kernel bound to one fused draft `Transformer` on a GPU: a build for forwards of <= 32 token
    rows and, when `rows` asks for more and a tiling fits, one for <= 64 (each build is an nvcc call on first use);
    fixed scratch buffers shared by both (a captured CUDA graph replays the same pointers); one instruction list per
    number of rows, those of `rows` made now. vocab: greedy forwards (`greedy`) take the argmax of the first `vocab`
    logits inside the launch (None: never). timeline: the profiling builds, each launch recording when its
    instructions reached each mark (`timeline_of`)."""

    def __init__(self, model, sinks: int, window: int, rows=(), vocab: int | None = None,
                 timeline: bool = False) -> None:
        a = model.args
        self.timeline = timeline
        self.shape, self.sinks, self.window = Shape.of(a), sinks, window
        self.vocab = vocab if vocab is not None and 0 < vocab <= a.vocab_size else None
        self.builds: dict[int, _Build] = {}
        for size in ROWS:
            t = tiling(self.shape, size)
            if t is None or not (size == ROWS[0] or any(r > ROWS[0] for r in rows)):
                continue
            try:
                self.builds[size] = _Build(t, library(self.shape, t, timeline), n_chunks(t, sinks, window))
            except BuildError as e:
                if size == ROWS[0]:
                    raise
                log_once(f"the draft decoder kernel's {size}-row build failed, forwards of more rows run layer by "
                          f"layer: {e}")
        if 32 not in self.builds:
            raise BuildError(unsupported(self.shape) or "no tiling")
        self.max_rows = max(self.builds)
        dev = model.embed_tokens.weight.device
        self.device, self.dtype, self.n_layers = dev, model.embed_tokens.weight.dtype, a.n_layers
        self.n_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.eps = model.layers[0].input_layernorm.eps
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        table = []
        for layer in model.layers:
            at, mlp = layer.self_attn, layer.mlp
            table.append([ptr(at.qkv_proj.weight), ptr(at.qkv_proj.bias), ptr(at.o_proj.weight),
                          ptr(mlp.gate_up_proj.weight), ptr(mlp.down_proj.weight),
                          ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight)])
        if any(p % 16 for row in table for p in row):  # bulk copies and the norms' loads read 16-byte pieces
            raise BuildError("a weight is not 16-byte aligned")
        self.layers = torch.tensor(table, dtype=torch.int64, device=dev)
        self._keep = model  # the weights the table points at
        self.lm_head, self.norm_w = model.lm_head.weight, model.norm.weight
        if (self.lm_head.data_ptr() % 16 or self.norm_w.data_ptr() % 16 or (a.dim * self.lm_head.element_size()) % 16
                or model.norm.eps != self.eps):
            self.vocab = None  # the HEAD tiles' bulk copies read 16-byte aligned rows; one eps serves every norm
        self.best = torch.zeros(max(self.builds), dtype=torch.int64, device=dev)
        S, qn, heads = self.max_rows, a.n_heads * a.head_dim, a.n_heads + 2 * a.n_kv_heads
        bf16, f32 = dict(dtype=self.dtype, device=dev), dict(dtype=torch.float32, device=dev)
        self.q = torch.empty(S, qn, **bf16)
        self.attn = torch.empty_like(self.q)
        self.act = torch.empty(S, a.intermediate_size, **bf16)
        builds = self.builds.values()
        nchunk = max(b.nchunk for b in builds)
        self.att_part = torch.empty(S * a.n_kv_heads * nchunk * (a.n_heads // a.n_kv_heads) * (a.head_dim + 2), **f32)
        self.down_part = torch.empty(max(b.tiles.dsplit for b in builds) * S * a.dim, **f32)
        ks = max(b.tiles.ksplit for b in builds)  # K-split q/k/v, o_proj and gate/up write partial sums
        self.qkv_part = torch.empty(ks * S * heads * a.head_dim if ks > 1 else 1, **f32)
        self.o_part = torch.empty(ks * S * a.dim if ks > 1 else 1, **f32)
        self.gu_part = torch.empty(ks * S * 2 * a.intermediate_size if ks > 1 else 1, **f32)
        i32 = dict(dtype=torch.int32, device=dev)
        self.counters = torch.zeros(a.n_layers * max(b.lib.draft_layers_counters_per_layer() for b in builds), **i32)
        self.arrivals = torch.zeros(a.n_layers * max(b.lib.draft_layers_arrivals_per_layer() for b in builds), **i32)
        self.captures: dict[int, torch.Tensor] = {}
        self.capture_table = torch.zeros(a.n_layers, dtype=torch.int64, device=dev)
        self._plans: dict[tuple[int, bool], tuple] = {}
        with torch.cuda.device(dev):
            for b in builds:
                err = b.lib.draft_layers_configure()
                if err:
                    raise BuildError(f"cudaFuncSetAttribute failed ({err})")
        self.prepare(rows)

    def capture(self, layers) -> dict[int, torch.Tensor]:
        """Also write the rotated queries of `layers` (for the query observers), [max_rows, Hq * D] each."""
        for layer in layers:
            if layer not in self.captures:
                self.captures[layer] = torch.empty_like(self.q)
                self.capture_table[layer] = self.captures[layer].data_ptr()
        return self.captures

    def prepare(self, rows) -> None:
        """Build and upload the instruction lists of these numbers of token rows now: a list made the first time a
        forward of that many rows runs inside a CUDA graph capture would copy to the device during the capture."""
        for M in rows:
            if 0 < M <= self.max_rows:
                self._plan(M, False)
                if self.head_for(M):
                    self._plan(M, True)

    def build_for(self, M: int) -> _Build:
        return self.builds[min(r for r in self.builds if r >= M)]

    def head_for(self, M: int) -> bool:
        """Whether a greedy forward of M token rows runs its LM head and argmax in the launch: a vocabulary given,
        and the build for M has K whole (A and a weight slot then hold whole rows)."""
        return self.vocab is not None and M <= self.max_rows and self.build_for(M).tiles.ksplit == 1

    def _plan(self, M: int, head: bool):
        if (M, head) not in self._plans:
            b = self.build_for(M)
            lists = plan(self.shape, b.tiles, self.n_layers, M, b.nchunk, self.n_sms, self.vocab if head else 0)
            stride = max(len(x) for x in lists)
            ins = torch.zeros(self.n_sms, stride, 4, dtype=torch.int32)
            wins = torch.zeros_like(ins)
            n_ins = torch.tensor([len(x) for x in lists], dtype=torch.int32)
            ws = [[t for t in x if t[0] != OP_ATT] for x in lists]
            n_w = torch.tensor([len(x) for x in ws], dtype=torch.int32)
            for s in range(self.n_sms):
                if lists[s]:
                    ins[s, :len(lists[s])] = torch.tensor(lists[s], dtype=torch.int32)
                if ws[s]:
                    wins[s, :len(ws[s])] = torch.tensor(ws[s], dtype=torch.int32)
            marks = (torch.zeros(self.n_sms, stride, TIMELINE_FIELDS, dtype=torch.int64, device=self.device)
                     if self.timeline else None)
            self._plans[(M, head)] = tuple(t.to(self.device) for t in (ins, n_ins, wins, n_w)) + (stride, marks)
        return self._plans[(M, head)]

    def timeline_of(self, M: int, head: bool = False) -> tuple[list[list[tuple]], torch.Tensor]:
        """The profiling build's record of the last launch of M token rows: each program's instruction list
        (`plan`) and [n_sms, stride, TIMELINE_FIELDS] int64, per instruction the SM clock at each of
        TIMELINE_MARKS, then %globaltimer at its start and the SM it ran on."""
        if not self.timeline:
            raise ValueError("timeline_of needs a DraftDecoder made with timeline=True")
        b = self.build_for(M)
        lists = plan(self.shape, b.tiles, self.n_layers, M, b.nchunk, self.n_sms, self.vocab if head else 0)
        return lists, self._plan(M, head)[5].cpu()

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, T: int, head: bool = False) -> None:
        """h [M, dim] (contiguous, the embeddings) becomes the last layer's residual stream, in place; positions
        [M] int64, cos / sin [M, head_dim] fp32; k_cache / v_cache [L, B, Hkv, S, D] get the new keys and values.
        head (`head_for(M)` must hold): also each batch row's greedy token into `best` (`tokens`)."""
        M = h.shape[0]
        b = self.build_for(M)
        ins, n_ins, wins, n_w, stride, marks = self._plan(M, head)
        p = _Params(self.layers.data_ptr(), ins.data_ptr(), n_ins.data_ptr(), wins.data_ptr(), n_w.data_ptr(), stride,
                    self.n_layers, M, T, h.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                    k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], k_cache.shape[3], self.sinks,
                    self.window, b.nchunk, self.eps, 1.0 / math.sqrt(self.shape.head_dim), self.q.data_ptr(),
                    self.capture_table.data_ptr(), self.attn.data_ptr(), self.act.data_ptr(),
                    self.att_part.data_ptr(), self.down_part.data_ptr(), self.qkv_part.data_ptr(),
                    self.o_part.data_ptr(), self.gu_part.data_ptr(), self.counters.data_ptr(),
                    self.arrivals.data_ptr(), self.lm_head.data_ptr() if head else 0, self.norm_w.data_ptr(),
                    self.vocab or 0, self.lm_head.shape[0], self.best.data_ptr(),
                    0 if marks is None else marks.data_ptr())
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with torch.cuda.device(self.device):
            err = b.lib.draft_layers_launch(ctypes.byref(p), self.n_sms, ctypes.c_void_p(stream),
                                            self.counters.numel() * 4, self.arrivals.numel() * 4)
        if err:
            raise RuntimeError(f"draft_layers kernel launch failed (cudaError {err})")

    # ---- the model's side: which forwards it takes, and the query observers -----------------------------------
    def takes(self, h: torch.Tensor, ctx) -> bool:
        """A decode forward of this streaming draft (`Transformer.decode_logits` asks): no sparse plan, the
        window the kernel was built for, <= max_rows token rows, a contiguous cache; never fake tensors (the
        warm-up's dry run: a launch would read address 0)."""
        k, v = ctx.cache.k, ctx.cache.v  # addressed as contiguous [L, B, Hkv, S, D], rows read 16 bytes at a time
        return (not is_fake(h) and ctx.sparse is None and ctx.sinks == self.sinks and ctx.window == self.window
                and h.shape[0] * h.shape[1] <= self.max_rows and h.dtype == self.dtype == k.dtype
                and k.is_contiguous() and v.is_contiguous() and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0)

    def tokens(self, rows: int) -> torch.Tensor:
        """The greedy tokens of the last `head` launch's first `rows` batch rows, [rows] long (from `best`'s keys)."""
        return 0xFFFFFFFF - (self.best[:rows] & 0xFFFFFFFF)

    def takes_greedy(self, h: torch.Tensor, ctx, vocab: int) -> bool:
        """`takes`, and the launch can end in this vocabulary's argmax (`head_for`)."""
        return vocab == self.vocab and self.takes(h, ctx) and self.head_for(h.shape[0] * h.shape[1])

    def greedy(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """`forward` and the LM head's argmax in one launch: each row's greedy token at its last position, [B]."""
        self.forward(h, cos, sin, ctx, head=True)
        return self.tokens(h.shape[0])

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx, head: bool = False) -> torch.Tensor:
        """The decoder layers of `Transformer.forward` for h [B, T, dim] (the embeddings) -> [B, T, dim], the
        query observers called after the kernel with each observed layer's rotated queries (the cache they get
        holds the same positions as during a layer-by-layer forward: this forward's keys are appended, no later
        ones)."""
        B, T, dim = h.shape
        M = B * T
        x = h.reshape(M, dim)  # written in place: the embeddings, a fresh tensor of this forward
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
        layers = sorted({layer for obs in ctx.observers for layer in obs.layers})
        captures = self.capture(layers)
        self(x, ctx.positions.reshape(M).contiguous(), cos.reshape(M, -1).float().contiguous(),
             sin.reshape(M, -1).float().contiguous(), ctx.cache.k, ctx.cache.v, T, head)
        a = self.shape
        for obs in ctx.observers:
            for layer in sorted(obs.layers):
                q = captures[layer][:M].view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
                obs(layer, q, ctx.cache.k[layer], ctx)
        return x.view(B, T, dim)


def why_not(model, sinks: int, window: int) -> str | None:
    w = model.embed_tokens.weight
    if not w.is_cuda:
        return "not on a GPU"
    if torch.cuda.get_device_capability(w.device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(w.device)
        return f"the kernel is built for sm_90, this GPU is sm_{major}{minor}"
    if window <= 0:
        return "the draft's cache is not streaming (--draft-kv full)"
    if w.dtype != torch.bfloat16:
        return f"dtype {w.dtype} (bf16 only)"
    if not model.projections_fused or not model.unsharded:
        return "projections not fused, or tensor-parallel layers"
    return unsupported(Shape.of(model.args))


@functools.lru_cache(maxsize=None)
def log_once(message: str) -> None:
    log.warning(message)
