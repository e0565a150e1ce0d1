"""`dustin bench decode`: per-step latency of a vanilla decode step (1 token) and a verify step (Γ+1 tokens)
on random-weight models of real shapes, against the memory-bandwidth limit measured in the same run.

fraction of limit = (weight bytes + KV bytes read per step) / step time / measured copy bandwidth.
Each step is a CUDA-graph replay of the whole forward (see dustin/engine/cuda_graphs.py), timed with events.
"""
from __future__ import annotations

import json
import time

import torch
import triton
import triton.language as tl

from dustin.attention.backend import AttentionBackend
from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.engine.cuda_graphs import GraphedForward
from dustin.errors import InputError
from dustin.kernels.launch import watched
from dustin.models.args import named_config
from dustin.models.loader import random_model
from dustin.parallel.tp import current_parallel, init_distributed, is_main_process


def add_arguments(p) -> None:
    p.add_argument("--models", default="llama-3.1-8b,qwen2.5-7b", help="named configs, comma separated")
    p.add_argument("--contexts", default="8192,16384,32768")
    p.add_argument("--batches", default="8,16")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--attention", default="triton", choices=["triton", "sdpa"])
    p.add_argument("--no-graphs", action="store_true", help="time eager forwards instead of CUDA graphs")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json-out", default=None, help="also write the results JSON here (default: none)")


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy, counting bytes read + written (bytes/s)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / sorted(times)[len(times) // 2]


@watched
@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program sums ITERS consecutive blocks of x in fp32 and writes one partial sum."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_all(x: torch.Tensor, block: int = 4096, iters: int = 64) -> torch.Tensor:
    """The sum of a contiguous tensor in fp32, streamed by a Triton kernel that only reads it (a partial sum per
    program, added by PyTorch): the read-only kernel of `read_bandwidth`. Its reference is x.float().sum()."""
    n = x.numel()
    grid = triton.cdiv(n, block * iters)
    parts = torch.empty(grid, dtype=torch.float32, device=x.device)
    _read_kernel[(grid,)](x, parts, n, BLOCK=block, ITERS=iters)
    return parts.sum()


def read_bandwidth(device: str = "cuda", nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes/s a read-only kernel reaches on the device: a sum of `nbytes` of bf16 in fp32 (each byte read once,
    one number written), the faster of PyTorch's reduction and a streaming Triton kernel, median of `iters`. This is
    the rate a decode step's weight and KV reads are held to: a copy's rate counts its writes too, and a step can
    read faster than a copy moves (one vanilla row once measured 103% of the copy rate). On a CPU, 64 MB through
    torch.sum: a check of the plumbing, not of the hardware."""
    if not device.startswith("cuda"):
        x = torch.ones((nbytes or 64 << 20) // 2, dtype=torch.bfloat16)
        x.sum(dtype=torch.float32)
        t0 = time.perf_counter()
        x.sum(dtype=torch.float32)
        return x.numel() * 2 / (time.perf_counter() - t0)
    nbytes = nbytes or 4 << 30
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    return max(nbytes / _time(lambda: x.sum(dtype=torch.float32), iters), nbytes / _time(lambda: read_all(x), iters))


def _time(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def bench_model(name: str, contexts, batches, gamma: int, attention: str, graphs: bool, iters: int, bw: float):
    model = random_model(named_config(name), "cuda", torch.bfloat16, backend=AttentionBackend(attention),
                         shard=current_parallel())  # under torchrun: this rank's tensor-parallel shard
    args = model.args  # per-rank shape: the KV heads and weights this GPU reads
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if n != "embed_tokens.weight" or args.tie_word_embeddings)
    rows = []
    for B in batches:
        for ctx_len in contexts:
            kv_bytes = B * ctx_len * args.kv_bytes_per_token(2)
            free = torch.cuda.mem_get_info()[0]
            if kv_bytes * 1.1 + (2 << 30) > free:
                rows.append({"model": name, "batch": B, "context": ctx_len, "skipped": "does not fit in memory"})
                continue
            cap = ctx_len + 2 * (gamma + 2)
            cache = KVCache(args.n_layers, B, args.n_kv_heads, args.head_dim, cap, torch.bfloat16, "cuda")
            cache.k.normal_()
            cache.v.normal_()
            lengths = torch.full((B,), ctx_len - gamma - 1, dtype=torch.int32, device="cuda")
            row = {"model": name, "batch": B, "context": ctx_len, "attention": attention, "cuda_graphs": graphs}
            for label, T in (("decode", 1), ("verify", gamma + 1)):
                toks = torch.randint(0, args.vocab_size, (B, T), device="cuda")
                pos = lengths.long()[:, None] + torch.arange(T, device="cuda")
                if graphs:
                    fwd = GraphedForward(model, cache, B, T)
                    def step(fwd=fwd, toks=toks, pos=pos, lengths=lengths):  # binds this iteration's inputs
                        return fwd(toks, pos, lengths)
                else:
                    ctx = ForwardContext(cache, pos, lengths, ctx_len + 1)
                    def step(toks=toks, ctx=ctx):  # binds this iteration's inputs
                        return model(toks, ctx)
                with torch.inference_mode():
                    t = _time(step, iters)
                bytes_read = weight_bytes + B * (ctx_len - gamma - 1 + T) * args.kv_bytes_per_token(2)
                row[f"{label}_ms"] = round(t * 1e3, 3)
                row[f"{label}_fraction_of_limit"] = round(bytes_read / t / bw, 3)
                row[f"{label}_TBps"] = round(bytes_read / t / 1e12, 3)
                del step
                if graphs:
                    del fwd
            rows.append(row)
            del cache
            torch.cuda.empty_cache()
    torch.cuda.empty_cache()
    return rows


def run(args) -> int:
    if not torch.cuda.is_available():
        raise InputError("dustin bench decode needs a CUDA GPU")
    _, world = init_distributed()  # torchrun: tensor-parallel target, bytes and limits per GPU; rank 0 reports
    main = is_main_process()
    say = print if main else (lambda *a, **k: None)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    bw = copy_bandwidth()
    say(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {bw / 1e12:.2f} TB/s "
        f"| tensor parallel {world} | {time.strftime('%Y-%m-%d')}", flush=True)
    say("| model | batch | context | decode ms | decode % of limit | verify (Γ+1) ms | verify % of limit |")
    say("|---|---|---|---|---|---|---|")
    results = []
    for name in args.models.split(","):
        for r in bench_model(name, contexts, batches, args.gamma, args.attention, not args.no_graphs, args.iters, bw):
            results.append(r)
            if "skipped" in r:
                say(f"| {name} | {r['batch']} | {r['context']} | skipped: {r['skipped']} | | | |", flush=True)
                continue
            say(f"| {name} | {r['batch']} | {r['context']} | {r['decode_ms']:.2f} | "
              f"{100 * r['decode_fraction_of_limit']:.0f}% | {r['verify_ms']:.2f} | "
              f"{100 * r['verify_fraction_of_limit']:.0f}% |", flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_Bps": bw,
           "gamma": args.gamma, "tensor_parallel": world, "results": results}
    if args.json_out and main:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0
