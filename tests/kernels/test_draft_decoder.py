"""The persistent draft-decoder kernel's plan and arithmetic (dustin/kernels/draft_decoder.py), on the CPU: the
instruction lists cover every tile once, in an order that cannot deadlock, and executing their tiles in PyTorch
(`reference_plan`, the kernel's semantics tile by tile) gives the model's own streaming forward. The CUDA build is
compile-checked where nvcc exists (CI installs it where it is missing, and DUSTIN_REQUIRE_NVCC=1 turns the skip into a
failure); the kernel itself is checked on the GPU (the tests marked sm90, run by scripts/device_speed.sh draft)."""
from __future__ import annotations

import ctypes
import functools
import math
import os
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.kernels import draft_decoder as dd
from dustin.models import draft_kernel
from dustin.models.args import ModelArgs
from dustin.models.transformer import Transformer
from tests.offline import offline


def _model(dtype, *, heads=4, kv_heads=2, head_dim=64, bias=True, layers=2):
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=97, dim=256, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                     intermediate_size=512, head_dim=head_dim, qkv_bias=bias, family="qwen2")
    m = Transformer(args)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
        for layer in m.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return m.fuse_projections().to(dtype).eval()


# The CUDA build's tests: skipped without nvcc, unless DUSTIN_REQUIRE_NVCC=1 (.ci/run sets it once it has an nvcc),
# where a missing nvcc fails them instead of silently checking nothing.
needs_nvcc = pytest.mark.skipif(dd.find_nvcc() is None and os.environ.get("DUSTIN_REQUIRE_NVCC") != "1",
                                reason="no nvcc")

QWEN_05B = dd.Shape(896, 14, 2, 64, 4864)
QWEN_15B = dd.Shape(1536, 12, 2, 128, 8960)
LLAMA_1B = dd.Shape(2048, 32, 8, 64, 8192)


@pytest.mark.parametrize("shape", [QWEN_05B, QWEN_15B, LLAMA_1B])
@pytest.mark.parametrize("M,n_sms", [(16, 132), (6, 7), (3, 1), (32, 5)])
def test_plan_covers_every_tile_once_in_stage_order(shape, M, n_sms):
    t = dd.tiling(shape)
    nchunk = dd.n_chunks(t, 4, 508)
    lists = dd.plan(shape, t, 3, M, nchunk, n_sms)
    flat = [x for lst in lists for x in lst]
    want = [x for layer in range(3) for tiles in dd.stage_tiles(shape, t, M, nchunk, layer) for x in tiles]
    assert sorted(flat) == sorted(want) and len(flat) == len(set(flat))
    for lst in lists:  # each program's list is in (layer, stage) order: it only ever waits for earlier stages
        order = [(x[1], x[0]) for x in lst]
        assert order == sorted(order)
    # per stage, each output group's splits: what the kernel counts (`dependency`, `merge_splits` in the .cu)
    heads = shape.n_heads + 2 * shape.n_kv_heads
    tiles = dd.stage_tiles(shape, t, M, nchunk, 0)
    assert [len(x) for x in tiles] == [heads * shape.head_dim // 8 * t.ksplit, M * shape.n_kv_heads * nchunk,
                                       shape.dim // 8 * t.ksplit, shape.inter // 8 * t.ksplit,
                                       shape.dim // t.down_n * t.dsplit]


@pytest.mark.parametrize("M,n_sms,vocab", [(16, 132, 151936), (6, 7, 97), (32, 5, 40)])
def test_plan_with_the_lm_head_ends_every_list_with_its_tiles(M, n_sms, vocab):
    """A greedy forward's plan: every layer tile as without the head, then the LM head's tiles of 16 vocabulary rows
    covering the first `vocab` rows once each, after every layer tile in each program's list; builds with K split
    cannot take them."""
    t = dd.tiling(QWEN_05B)
    nchunk = dd.n_chunks(t, 4, 508)
    lists = dd.plan(QWEN_05B, t, 3, M, nchunk, n_sms, vocab)
    heads = [x for lst in lists for x in lst if x[0] == dd.OP_HEAD]
    assert sorted(x[2] for x in heads) == list(range(0, vocab, dd.HEAD_ROWS)) and all(x[1] == 3 for x in heads)
    for lst in lists:
        ops = [x[0] == dd.OP_HEAD for x in lst]
        assert ops == sorted(ops)  # no layer tile after a HEAD tile
    assert [[x for x in lst if x[0] != dd.OP_HEAD] for lst in lists] == dd.plan(QWEN_05B, t, 3, M, nchunk, n_sms)
    with pytest.raises(ValueError, match="K whole"):
        dd.plan(QWEN_15B, dd.tiling(QWEN_15B), 3, M, nchunk, n_sms, vocab)


def _simulate(shape, t, n_layers, M, nchunk, n_sms, seed, vocab=0):
    """Every program's instruction list under the kernel's rules (`dependency`, `counter_of`, `merge_splits` and the
    attention's merge in the .cu, written again here), programs interleaved at random. An instruction reads all its
    inputs once its counter has reached its need, and writes its outputs (and arrives, and signals) at some later
    moment. Each read checks the version of what it reads: written by the right producer, not yet overwritten (a
    read-after-write or write-after-read hazard fails here). At the end nothing is left (no deadlock) and each
    counter holds exactly its need."""
    rng = random.Random(seed)
    gq, nq, nkv, hd = shape.n_heads // shape.n_kv_heads, shape.n_heads, shape.n_kv_heads, shape.head_dim
    kc, half = shape.inter // t.dsplit, hd // 2
    kv_group = lambda head: head // gq if head < nq else (head - nq) % nkv  # noqa: E731
    need = {"down": shape.dim // t.down_n, "qkv": (gq + 2) * (hd // 8), "att": M * nkv, "o": shape.dim // 8,
            "gu": kc // 8}
    counters, arrivals = {}, {}
    h_cols = range(0, shape.dim, 8)
    version = {("h", c): ("down", -1) for c in h_cols}  # the embeddings: "layer -1's down_proj"

    def wait_for(op, layer, a, b):
        if op in (dd.OP_QKV, dd.OP_HEAD):  # the head: after the last layer, as a next layer's q/k/v
            return ((layer - 1, "down"), "down") if layer else None
        return [None, ((layer, "qkv", b // nchunk), "qkv"), ((layer, "att"), "att"), ((layer, "o"), "o"),
                ((layer, "gu", b), "gu")][op]

    def reads(op, layer, a, b):  # (what, the version it must hold); a tile's own `a` never enters
        return stage_reads(op, layer, b)

    @functools.cache  # one list for the tiles of a stage that read the same inputs
    def stage_reads(op, layer, b):
        if op in (dd.OP_QKV, dd.OP_HEAD):
            return [(("h", c), ("down", layer - 1)) for c in h_cols]
        if op == dd.OP_ATT:
            g = b // nchunk
            heads = [*range(g * gq, (g + 1) * gq), nq + g, nq + nkv + g]
            return [(("qkv", h, j), layer) for h in heads for j in range(0, half, 4)]
        if op == dd.OP_O:
            return [(("attn", m, g), layer) for m in range(M) for g in range(nkv)]
        if op == dd.OP_GU:
            return [(("h", c), ("o", layer)) for c in h_cols]
        return [(("act", c), layer) for c in range(b * kc, (b + 1) * kc, 8)]

    def check(items):
        get = version.get
        bad = [(what, want) for what, want in items if get(what) != want]
        assert not bad, bad[0]

    def write(op, layer, a, b):
        if op == dd.OP_HEAD:  # its argmax goes to a buffer no instruction reads
            heads.append(a)
            return
        if op == dd.OP_ATT:
            m, g = a, b // nchunk
            arrivals[(layer, "att", m, g)] = arrivals.get((layer, "att", m, g), 0) + 1
            if arrivals[(layer, "att", m, g)] == nchunk:
                version[("attn", m, g)] = layer
                counters[(layer, "att")] = counters.get((layer, "att"), 0) + 1
            return
        arrivals[(layer, op, a)] = arrivals.get((layer, op, a), 0) + 1
        if arrivals[(layer, op, a)] < (t.dsplit if op == dd.OP_DOWN else t.ksplit):
            return
        if op == dd.OP_QKV:
            version[("qkv", a // half, a % half)] = layer  # the tile's 4 half-dim pairs
            key = (layer, "qkv", kv_group(a // half))
        elif op == dd.OP_GU:
            version[("act", a)] = layer
            key = (layer, "gu", a // kc)
        else:  # o_proj, down_proj: the residual add reads its own columns of h, then writes them
            stage, before = ("o", ("down", layer - 1)) if op == dd.OP_O else ("down", ("o", layer))
            cols = range(a, a + (8 if op == dd.OP_O else t.down_n), 8)
            check([(("h", c), before) for c in cols])
            for c in cols:
                version[("h", c)] = (stage, layer)
            key = (layer, stage)
        counters[key] = counters.get(key, 0) + 1

    lists = dd.plan(shape, t, n_layers, M, nchunk, n_sms, vocab)
    heads: list[int] = []
    at, pending = [0] * n_sms, [None] * n_sms
    live = [sm for sm in range(n_sms) if lists[sm]]  # programs with an instruction or a write left
    while live:
        # One move, by a program drawn uniformly from those that can move: `live` is shuffled lazily (a partial
        # Fisher-Yates shuffle), and the first program of that order that can move does (its writes land, or its
        # next instruction's counter has reached its need). The same draw as shuffling every program before each
        # move and taking the first that can, which cost 60% of the time.
        for i in range(len(live)):
            j = rng.randrange(i, len(live))
            live[i], live[j] = live[j], live[i]
            sm = live[i]
            if pending[sm] is not None:  # its writes land now
                write(*pending[sm])
                pending[sm] = None
                if at[sm] == len(lists[sm]):  # done
                    live[i] = live[-1]
                    live.pop()
                break
            ins = lists[sm][at[sm]]
            dep = wait_for(*ins)
            if dep is None or counters.get(dep[0], 0) >= need[dep[1]]:
                check(reads(*ins))
                pending[sm], at[sm] = ins, at[sm] + 1
                break
        else:
            raise AssertionError("deadlock")
    for key, n in counters.items():
        assert n == need[key[1]], (key, n)
    assert sorted(heads) == list(range(0, vocab, dd.HEAD_ROWS))


@pytest.mark.parametrize("shape", [QWEN_05B, QWEN_15B, LLAMA_1B])
@pytest.mark.parametrize("M,n_sms", [(16, 132), (32, 132), (3, 7), (64, 132), (48, 5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_counters_let_every_instruction_run_after_its_inputs(shape, M, n_sms, seed):
    t = dd.tiling(shape, 32 if M <= 32 else 64)
    _simulate(shape, t, 2, M, dd.n_chunks(t, 4, 508), n_sms, seed)


@pytest.mark.parametrize("M,n_sms,seed", [(16, 132, 0), (32, 7, 1), (3, 5, 2)])
def test_the_lm_head_runs_after_the_last_layer(M, n_sms, seed):
    """With the LM head's tiles: each reads the last layer's whole residual stream (no earlier version), all run,
    nothing deadlocks."""
    t = dd.tiling(QWEN_05B, 32)
    _simulate(QWEN_05B, t, 2, M, dd.n_chunks(t, 4, 508), n_sms, seed, vocab=200)


@pytest.mark.parametrize("dtype,T,window,tol", [(torch.float32, 1, 124, 2e-5), (torch.float32, 2, 300, 2e-5),
                                                 (torch.bfloat16, 1, 124, 0.05), (torch.bfloat16, 2, 60, 0.05)])
@pytest.mark.parametrize("tiles,heads", [(None, (4, 2, 64)), (dd.Tiling(2, 8, 16, 128), (4, 2, 64)),
                                         (dd.Tiling(4, 4, 8, 64), (2, 1, 128))])
def test_reference_plan_matches_the_model(dtype, T, window, tol, tiles, heads):
    """Tiles in stage order == the model's layer-by-layer streaming forward: RoPE's half-dim pairs, attention
    chunks of a window longer than a chunk (merged), sinks, the K splits (added in split order), the residual adds;
    rows at different positions, some inside the sinks; unsplit and split K, head_dim 64 and 128."""
    model = _model(dtype, heads=heads[0], kv_heads=heads[1], head_dim=heads[2])
    a = model.args
    B, S, sinks = 3, 512, 4
    lengths = torch.tensor([300, 2, 150], dtype=torch.int32)
    cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, S, dtype, "cpu")
    torch.manual_seed(1)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    cache2 = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, S, dtype, "cpu")
    cache2.k.copy_(cache.k)
    cache2.v.copy_(cache.v)
    tokens = torch.randint(0, a.vocab_size, (B, T))
    positions = lengths.long()[:, None] + torch.arange(T)
    with torch.inference_mode():
        ctx = ForwardContext(cache, positions, lengths, int(lengths.max()) + T, sinks=sinks, window=window)
        h = model.embed_tokens(tokens)
        residual = None
        cos, sin = model.rotary(positions)
        for layer in model.layers:
            h, residual = layer(h, residual, cos, sin, ctx, model.backend)
        want = (residual + h).reshape(B * T, -1)
        got = dd.reference_plan(model, model.embed_tokens(tokens).reshape(B * T, -1), positions,
                                cos.reshape(B * T, -1), sin.reshape(B * T, -1), cache2.k, cache2.v, T=T,
                                sinks=sinks, window=window, tiles=tiles)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * want.float().abs().max().item(), err
    for li in range(a.n_layers):
        for b in range(B):
            p = positions[b]
            assert torch.allclose(cache2.k[li, b, :, p].float(), cache.k[li, b, :, p].float(), atol=tol, rtol=tol)
            assert torch.allclose(cache2.v[li, b, :, p].float(), cache.v[li, b, :, p].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,vocab", [(1, 97), (2, 97), (2, 40)])
def test_reference_head_is_the_models_greedy_token(dtype, T, vocab):
    """The LM head's tiles (final norm, 16 rows of logits each, rounded to the activation dtype, folded to the first
    maximum) give the model's greedy token of each row's last position (`Transformer.forward(greedy=V)`), or in
    bf16 one whose logit is within a rounding step of the best; never an id >= vocab."""
    model = _model(dtype)
    a = model.args
    B, S = 5, 64
    lengths = torch.tensor([10, 0, 33, 7, 50], dtype=torch.int32)
    cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, S, dtype, "cpu")
    torch.manual_seed(3)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    tokens = torch.randint(0, a.vocab_size, (B, T))
    positions = lengths.long()[:, None] + torch.arange(T)
    with torch.inference_mode():
        k, v = cache.k.clone(), cache.v.clone()
        ctx = ForwardContext(cache, positions, lengths, int(lengths.max()) + T, sinks=4, window=16)
        logits = model(tokens, ctx, float_logits=False)[:, -1, :vocab].float()
        cache.k.copy_(k)
        cache.v.copy_(v)
        greedy = model(tokens, ctx, greedy=vocab)
        cos, sin = model.rotary(positions)
        h = dd.reference_plan(model, model.embed_tokens(tokens).reshape(B * T, -1), positions, cos.reshape(B * T, -1),
                              sin.reshape(B * T, -1), k, v, T=T, sinks=4, window=16)
        got = dd.reference_head(model, h, T, vocab)
    assert torch.equal(greedy, logits.argmax(-1))
    assert got.shape == (B,) and bool((got < vocab).all())
    best = logits.max(-1).values
    step = 0.0 if dtype == torch.float32 else 2 ** -7 * best.abs()
    assert (logits.gather(1, got[:, None])[:, 0] >= best - step - 1e-5).all(), (got, logits.argmax(-1))
    if dtype == torch.float32:
        assert torch.equal(got, greedy)


def test_attention_chunks_merge_to_softmax():
    torch.manual_seed(2)
    q, k, v = torch.randn(3, 64), torch.randn(700, 64), torch.randn(700, 64)
    p, sinks, window = 650, 4, 380
    parts = [dd._attention_chunk(q, k, v, p, c, sinks, window, 128) for c in range(4)]
    got = dd._merge(parts)
    idx = torch.tensor(list(range(sinks)) + list(range(p - window + 1, p + 1)))
    want = torch.softmax(q @ k[idx].T / math.sqrt(64), -1) @ v[idx]
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("shape,rows,want", [
    (QWEN_05B, 32, dd.Tiling(1, 8, 32, 128)),  # the default draft: K unsplit
    (QWEN_05B, 64, dd.Tiling(2, 8, 16, 128, 64)),  # its 64-row build: K in halves
    (QWEN_15B, 32, dd.Tiling(2, 8, 16, 64)),  # Qwen2.5-1.5B as a draft: K in halves, head_dim 128
    (LLAMA_1B, 32, dd.Tiling(2, 8, 16, 128)),  # Llama-3.2-1B
    (LLAMA_1B, 64, dd.Tiling(4, 8, 8, 128, 64)),
    (dd.Shape(8192, 64, 8, 128, 28672), 32, None),  # a 70B's layers fit no tiling
])
def test_tiling_fits_shared_memory(shape, rows, want):
    t = dd.tiling(shape, rows)
    assert t == want
    if rows == 32:
        assert (dd.unsupported(shape) is None) == (want is not None)
    if t is not None:
        assert dd.smem_bytes(shape, t) <= dd.SMEM_LIMIT


@pytest.mark.parametrize("shape", [dd.Shape(896, 14, 2, 80, 4864), dd.Shape(1024, 8, 2, 64, 4864)])
def test_unsupported_shapes_say_why(shape):
    """head_dim outside 64 / 128; o_proj's input narrower than the hidden state: the per-layer kernels."""
    assert dd.unsupported(shape)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every CUDA build the tests below check, each compiled once (an nvcc call took 8 s here, 12-20 s on a busy
    core) into one cache directory: `build_all(QWEN_05B)` first, into the empty directory, then the Llama and the
    profiling (timeline) builds through `dd.build`. build_all's two builds are the compile test's QWEN_05B ones: the
    same `compile_flags`, the same nvcc call, the same library. Returns the cache's home, build_all's answer and
    its files' mtimes right after it, and (shape, rows, timeline) -> the library's path, or why there is none."""
    assert dd.find_nvcc() is not None, "DUSTIN_REQUIRE_NVCC=1 but no nvcc (set CUDA_HOME)"
    home = tmp_path_factory.mktemp("dustin_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DUSTIN_HOME", str(home))
        first = dd.build_all(QWEN_05B)
        stamps = {p: Path(p).stat().st_mtime_ns for p in first.values() if p.endswith(".so")}
        libs = {(QWEN_05B, rows, False): path for rows, path in first.items()}
        for shape, rows, timeline in [(LLAMA_1B, 32, False), (QWEN_05B, 32, True)]:
            try:
                libs[shape, rows, timeline] = str(dd.build(shape, dd.tiling(shape, rows), timeline))
            except dd.BuildError as e:
                libs[shape, rows, timeline] = f"build failed: {e}"
    return SimpleNamespace(home=home, first=first, stamps=stamps, libs=libs)


@needs_nvcc
@pytest.mark.xdist_group("draft_decoder_builds")  # one worker compiles `builds` for all of them
@pytest.mark.parametrize("shape,rows,timeline", [(QWEN_05B, 32, False), (QWEN_05B, 64, False), (LLAMA_1B, 32, False),
                                                 (QWEN_05B, 32, True)])
def test_kernel_compiles_for_sm90_and_exports_what_the_host_binds(shape, rows, timeline, builds):
    """The sm_90 build compiles with nvcc (not g++, which exports what nvcc may not), every function the host binds
    is exported under its name (`dd.bind` looks up each of `dd.EXPORTS`), and its SMEM_BYTES, Params size and
    compiled shape are what the host side assumes; the profiling build (timeline) too. The libraries are the
    `builds` fixture's: nvcc with `dd.compile_flags(shape, tiling, timeline)`, as `dd.build` runs it."""
    t = dd.tiling(shape, rows)
    out = builds.libs[shape, rows, timeline]
    assert out.endswith(".so") and Path(out).is_file(), out  # else nvcc's error
    lib = dd.bind(ctypes.CDLL(out))  # raises BuildError naming any missing export
    exported = subprocess.run(["nm", "-D", "--defined-only", out], capture_output=True, text=True).stdout
    assert set(dd.EXPORTS) <= {line.split()[-1] for line in exported.splitlines() if line.strip()}
    assert lib.draft_layers_smem_bytes() == dd.smem_bytes(shape, t)
    assert lib.draft_layers_params_bytes() == ctypes.sizeof(dd._Params)
    got = (ctypes.c_int * 16)()
    n = lib.draft_layers_shape(got)
    assert list(got[:n]) == [shape.dim, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.inter, t.dsplit,
                             t.down_n, t.chunk, t.rows, 4, t.ksplit]


def test_bind_names_the_missing_exports(tmp_path):
    """A build that lacks a bound function fails at load with a BuildError that names it (the launch function was
    once missing from nvcc builds and surfaced only as an AttributeError at the first GPU forward)."""
    src = tmp_path / "partial.c"
    src.write_text("int draft_layers_smem_bytes(void) { return 1; }\n"
                   "int draft_layers_params_bytes(void) { return 1; }\n")
    out = tmp_path / "partial.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    with pytest.raises(dd.BuildError, match="draft_layers_launch"):
        dd.bind(ctypes.CDLL(str(out)))


sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                          reason="the kernel runs on sm_90")


def _gpu_draft(draft: str, n_layers: int, rows: int, vocab: int | None = None):
    """A fused bf16 draft of a named shape on the GPU, `n_layers` of random weights, with the kernel attached (its
    self-check passed) for forwards of `rows` token rows (and greedy ones over `vocab`). Returns (model, args)."""
    from dataclasses import replace

    from dustin.attention.backend import AttentionBackend
    from dustin.bench.e2e import _shape

    torch.manual_seed(0)
    args = replace(_shape(draft), n_layers=n_layers)
    model = Transformer(args, AttentionBackend.for_device(torch.device("cuda"))).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0, 0.02)
    model.fuse_projections().eval()
    assert draft_kernel.attach(model, 4, 508, rows=(rows,), vocab=vocab) is None
    return model, args


def _apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: how far a lands from b, as the self-check measures it."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _fp32_forward(model, tokens, positions, k_cache, v_cache, *, T: int, layers=()) -> dict:
    """The fp32 forward of a fused bf16 draft's weights (`dd.reference_plan` on an fp32 copy: no rounding but
    fp32's) over fp32 copies of the caches: logits [B * T, V], the caches it wrote (k, v) and the rotated queries
    of `layers` ([B, Hq, T, D] each, as the observers get them)."""
    import copy

    M, kernel, a = tokens.numel(), model.layer_kernel, model.args
    tiles = kernel.build_for(M).tiles
    model.layer_kernel = None  # (the kernel holds its loaded build: no deep copy)
    try:
        m32 = copy.deepcopy(model).float()
    finally:
        model.layer_kernel = kernel
    x = m32.embed_tokens(tokens).reshape(M, -1)
    cos, sin = (t.reshape(M, -1).float().contiguous() for t in m32.rotary(positions))
    k, v = k_cache.float(), v_cache.float()
    q = {layer: torch.empty(M, a.n_heads * a.head_dim, device=x.device) for layer in layers}
    h = dd.reference_plan(m32, x, positions, cos, sin, k, v, T=T, sinks=4, window=508, tiles=tiles, q_capture=q)
    B = tokens.shape[0]
    return {"logits": dd._norm(h, m32.norm) @ m32.lm_head.weight.T, "k": k, "v": v,
            "q": {layer: t.view(B, T, a.n_heads, a.head_dim).transpose(1, 2) for layer, t in q.items()}}


@sm90
@pytest.mark.parametrize("B,T", [(16, 1), (16, 2), (32, 2), (7, 1)])
@pytest.mark.parametrize("draft", ["qwen2.5-0.5b", "llama-3.2-1b"])
def test_kernel_matches_the_per_layer_kernels(B, T, draft):
    """On the GPU: the persistent kernel against the draft's per-layer kernels (their layer-by-layer forward for
    64 token rows) and the fp32 forward, at a draft's shapes (4 layers of random weights; the 1B's K is split), B x T
    token rows (the 64-row build for 32 x 2): logits, argmax, the new keys and values, nothing else of the cache
    written, the observers' queries, and bitwise-equal repeats, eager and replayed from a CUDA graph."""
    dev = torch.device("cuda")
    model, args = _gpu_draft(draft, 4, rows=B * T)
    kernel = model.layer_kernel
    S = 2048
    cache = KVCache(args.n_layers, B, args.n_kv_heads, args.head_dim, S, torch.bfloat16, dev)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    lengths = torch.randint(520, S - 4, (B,), dtype=torch.int32)
    lengths[:3] = torch.tensor([0, 3, 130], dtype=torch.int32)
    lengths = lengths.to(dev)
    tokens = torch.randint(0, args.vocab_size, (B, T), device=dev)
    positions = lengths.long()[:, None] + torch.arange(T, device=dev)

    class Recorder:
        layers = frozenset({1, 3})

        def __init__(self):
            self.seen = {}

        def __call__(self, layer, q, k_cache, ctx):
            self.seen[layer] = q.clone()

    max_len = int(lengths.max()) + T  # a host sync: not inside the graph capture below

    def forward(kern, rec):
        model.layer_kernel = kern
        ctx = ForwardContext(cache, positions, lengths, max_len, sinks=4, window=508, observers=[rec])
        return model(tokens, ctx, float_logits=False).float()

    with torch.inference_mode():
        k0, v0 = cache.k.clone(), cache.v.clone()
        rec_ref, rec = Recorder(), Recorder()
        ref = forward(None, rec_ref)
        k_ref, v_ref = cache.k.clone(), cache.v.clone()
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        got = forward(kernel, rec)
        k_got, v_got = cache.k.clone(), cache.v.clone()
        again = forward(kernel, Recorder())
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        graph = torch.cuda.CUDAGraph()  # captured: the launch, its memsets and the observers replay as one graph
        with torch.cuda.graph(graph):
            graphed = forward(kernel, Recorder())
        graph.replay()
        torch.cuda.synchronize()
        exact = _fp32_forward(model, tokens, positions, k0, v0, T=T, layers=Recorder.layers)
    assert torch.equal(got, again) and torch.equal(got, graphed)
    assert torch.equal(cache.k, k_got) and torch.equal(cache.v, v_got)
    new = torch.zeros(k0.shape[:-1], dtype=torch.bool, device=dev)
    for b in range(B):
        new[:, b, :, positions[b]] = True
    assert torch.equal(k_got[~new], k0[~new]) and torch.equal(v_got[~new], v0[~new])
    # Both are bf16 forwards that round at different points, and random weights amplify a rounding step layer by
    # layer (a one-ulp change of the embeddings moves 4 layers' logits by ~2% of the largest): so the kernel is held
    # to the fp32 forward, no farther from it than the per-layer kernels are, and not to the per-layer kernels
    # themselves. A race or a wrong stage lands far outside.
    logits = exact["logits"].view_as(ref)
    pairs = {"logits": (got, ref, logits), "k": (k_got[new], k_ref[new], exact["k"][new]),
             "v": (v_got[new], v_ref[new], exact["v"][new]),
             **{f"q{layer}": (rec.seen[layer], rec_ref.seen[layer], exact["q"][layer]) for layer in Recorder.layers}}
    for name, (mine, theirs, fp32) in pairs.items():
        assert _apart(mine, fp32) <= 1.5 * _apart(theirs, fp32) + 1e-3, (name, _apart(mine, fp32),
                                                                          _apart(theirs, fp32))
    # the kernel's greedy token is the fp32 forward's, or within the kernel's own error of its best (random weights'
    # logits are nearly flat: a near-tie may go either way), and it picks the fp32 forward's token about as often as
    # the per-layer kernels do
    e_kernel = _apart(got, logits)
    chosen = logits.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
    assert (logits.amax(-1) - chosen <= 2 * e_kernel * logits.abs().max()).all()
    best = logits.argmax(-1)
    assert (got.argmax(-1) == best).sum() >= (ref.argmax(-1) == best).sum() - max(1, best.numel() // 8)


@sm90
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("draft", ["qwen2.5-0.5b", "llama-3.2-1b"])
def test_kernel_stages_of_one_layer(T, draft):
    """On the GPU, one layer through the kernel against `reference_plan`, stage by stage: its scratch after the
    launch holds the layer's q, attention output and SiLU(gate)·up, the cache its k and v, h the layer's output. A
    failure names the first stage that differs."""
    dev, B = torch.device("cuda"), 16
    model, args = _gpu_draft(draft, 1, rows=B * T)
    kernel, M = model.layer_kernel, B * T
    cache = KVCache(1, B, args.n_kv_heads, args.head_dim, 1024, torch.bfloat16, dev)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    k0, v0 = cache.k.clone(), cache.v.clone()
    lengths = torch.randint(0, 1000, (B,), dtype=torch.int32, device=dev)
    positions = lengths.long()[:, None] + torch.arange(T, device=dev)
    with torch.inference_mode():
        x = model.embed_tokens(torch.randint(0, args.vocab_size, (B, T), device=dev)).reshape(M, -1)
        cos, sin = (t.reshape(M, -1).contiguous() for t in model.rotary(positions))
        h = x.clone()
        kernel(h, positions.reshape(-1).contiguous(), cos, sin, cache.k, cache.v, T)
        torch.cuda.synchronize()
        trace, k_ref, v_ref = {}, k0.clone(), v0.clone()
        want = dd.reference_plan(model, x, positions, cos, sin, k_ref, v_ref, T=T, sinks=4, window=508,
                                 tiles=kernel.build_for(M).tiles, trace=trace)

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()

    errors = {"q": rel(kernel.q[:M], trace["q"]), "k": rel(cache.k, k_ref), "v": rel(cache.v, v_ref),
              "attn": rel(kernel.attn[:M], trace["attn"]), "act": rel(kernel.act[:M], trace["act"]),
              "h": rel(h, want)}
    assert all(e <= 0.02 for e in errors.values()), errors


@sm90
@pytest.mark.parametrize("B,T,cut", [(16, 1, 0), (16, 2, 0), (7, 2, 1000), (32, 1, 0)])
def test_kernel_head_chooses_the_greedy_token(B, T, cut):
    """On the GPU (the 0.5B draft's shape, K whole): a greedy forward with the LM head and argmax in the launch
    against the per-layer kernels' logits: each row's token is their argmax or within rounding of it (a near-tie),
    below the vocabulary limit (cut: that many ids left out), the same launched, repeated and replayed from a CUDA
    graph; and `reference_head` of the launch's own residual stream equals its token."""
    dev = torch.device("cuda")
    model, args = _gpu_draft("qwen2.5-0.5b", 4, rows=B * T, vocab=None)
    vocab = args.vocab_size - cut
    kernel = dd.DraftDecoder(model, 4, 508, rows=(B * T,), vocab=vocab)
    assert kernel.head_for(B * T)
    cache = KVCache(args.n_layers, B, args.n_kv_heads, args.head_dim, 2048, torch.bfloat16, dev)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    k0, v0 = cache.k.clone(), cache.v.clone()
    lengths = torch.randint(520, 2040, (B,), dtype=torch.int32, device=dev)
    tokens = torch.randint(0, args.vocab_size, (B, T), device=dev)
    positions = lengths.long()[:, None] + torch.arange(T, device=dev)
    max_len = int(lengths.max()) + T

    def forward(kern, **kw):
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        model.layer_kernel = kern
        return model(tokens, ForwardContext(cache, positions, lengths, max_len, sinks=4, window=508), **kw)

    with torch.inference_mode():
        ref = forward(None, float_logits=False)[:, -1, :vocab].float()
        got = forward(kernel, greedy=vocab)
        again = forward(kernel, greedy=vocab)
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = model(tokens, ForwardContext(cache, positions, lengths, max_len, sinks=4, window=508),
                            greedy=vocab)
        graph.replay()
        M = B * T  # the launch's own residual stream, through the reference's head tiles
        x = model.embed_tokens(tokens).reshape(M, -1).contiguous()
        cos, sin = (t.reshape(M, -1).float().contiguous() for t in model.rotary(positions))
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        kernel(x, positions.reshape(-1).contiguous(), cos, sin, cache.k, cache.v, T, head=True)
        own = kernel.tokens(B).clone()
        torch.cuda.synchronize()
    assert got.shape == (B,) and bool((got < vocab).all())
    assert torch.equal(got, again) and torch.equal(got, graphed) and torch.equal(own, got)
    chosen = ref.gather(1, got[:, None])[:, 0]
    assert (ref.amax(-1) - chosen <= 0.01 * ref.abs().max()).all()
    assert (got == ref.argmax(-1)).float().mean() >= 0.75
    assert torch.equal(dd.reference_head(model, x, T, vocab), own)


@sm90
def test_engine_with_the_kernel_keeps_full_verification_exact():
    """On the GPU, end to end: an engine core with the kernel (its background warm-up's fake twin included, which
    must neither launch it nor detach it) gives magicdec's tokens equal to magicdec's without it (full verification
    emits the target's tokens whatever the draft proposes: the kernel changes none), and dustin runs; random weights
    of the pair's shapes, 2 layers each. Not vanilla's: on this random-weight pair in bf16, magicdec and classic
    without the kernel leave vanilla's tokens at one prompt's 22nd token (H100, 2026-12-07,
    scripts/gpu_draft_engine_check.py); the engine's exactness against vanilla is tests/engine's and
    scripts/gpu_engine_check.py's to hold."""
    from dataclasses import replace

    from dustin.bench.e2e import _shape, build_engine
    from dustin.engine.config import ExecutionOptions, GenerationConfig
    from dustin.engine.core import EngineCore
    from dustin.engine.request import SamplingParams

    engine = build_engine(replace(_shape("qwen2.5-1.5b"), n_layers=2), replace(_shape("qwen2.5-0.5b"), n_layers=2),
                          "cuda")
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(40 + 9 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(method, kernel):
        cfg = GenerationConfig(method=method, max_slots=4, max_context=256, options=ExecutionOptions(
            draft_kernel=kernel), **({"budget": 64} if method == "dustin" else {}))
        core = EngineCore(engine.pair, cfg)
        out = core.generate(prompts, greedy)
        return out, engine.pair.draft.layer_kernel

    want, kernel = run("magicdec", False)  # streaming draft, full verification
    assert kernel is None
    got, kernel = run("magicdec", True)
    assert kernel is not None and kernel.vocab is not None and got == want  # greedy: the head in the launch too
    out, kernel = run("dustin", True)
    assert kernel is not None and all(len(o) == 24 for o in out)
    torch.cuda.synchronize()


def test_the_option_leaves_a_cpu_engine_as_it_was(tiny_pair, monkeypatch):
    """`ExecutionOptions(draft_kernel=True)` where the kernel cannot run (a CPU): nothing attached, the same tokens
    as without it, and `attach` says why. The engine runs as on a user's CPU, Triton's interpreter off (under it,
    dustin's selection ran the interpreted sort: 17 of 18 s)."""
    from dustin.engine.config import ExecutionOptions
    from dustin.engine.engine import Engine
    from tests.conftest import without_interpreter

    without_interpreter(monkeypatch)
    engine = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]))
    prompts = [[5, 9, 14, 3, 22, 7], [11, 4, 8]]
    kw = dict(method="dustin", budget=24, draft_window=32, max_new_tokens=12, stop_at_eos=False)
    off = engine.generate(prompts, *offline(**kw))
    on = engine.generate(prompts, *offline(**kw, options=ExecutionOptions(draft_kernel=True)))
    assert [s.token_ids for s in on.sequences] == [s.token_ids for s in off.sequences]
    assert engine.pair.draft.layer_kernel is None
    assert draft_kernel.attach(engine.pair.draft, 4, 28) == "not on a GPU"


@needs_nvcc
@pytest.mark.xdist_group("draft_decoder_builds")
def test_build_all_fills_the_cache_once(builds, monkeypatch):
    """`build_all` (what `dustin warmup` runs) compiles each build a shape may use into the cache directory, once:
    a second call finds them there (the same files, not rewritten). Its first call, into an empty directory, is the
    `builds` fixture's."""
    first = builds.first
    assert set(first) == set(dd.ROWS) and all(Path(p).is_file() for p in first.values()), first
    monkeypatch.setenv("DUSTIN_HOME", str(builds.home))
    assert dd.build_all(QWEN_05B) == first
    assert {p: Path(p).stat().st_mtime_ns for p in first.values()} == builds.stamps
    assert dd.build_all(dd.Shape(8192, 64, 8, 128, 28672))[32].startswith("unsupported")
