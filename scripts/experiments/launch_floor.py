"""What a kernel boundary costs inside a CUDA graph, against a grid-wide barrier inside one persistent kernel.

    PYTHONPATH=. python3 scripts/experiments/launch_floor.py [--n 240] [--programs 132]

Why: a dustin step is ~940 kernels, ~480 of them the draft's 96 layer-forwards of 5 kernels, each ~4-7 us for
~0.5-4 us of weight bytes. A persistent draft forward (one kernel walking the layers, its stages separated by
device-side barriers) only pays off if a barrier costs less than a kernel boundary; PDL (which hides part of the
boundary) bought only 3-4% of the step. This measures both floors on the machine, each over n back-to-back
instances in one CUDA graph (us per instance = graph replay time / n, median of 5 replays):
- `empty`: n launches of a kernel of `programs` programs that does nothing;
- `chain`: n launches where each program reads one value the previous launch wrote and writes one for the next
  (the data dependency a layer's stages have), with and without PDL;
- `barrier`: one launch of `programs` programs (one wave: at most one program per SM, so all are resident) that
  passes n grid barriers (an arrival counter per barrier, acq_rel atomics, a spin on a relaxed atomic read),
  each program reading the value another program wrote before the barrier;
- `barrier_work`: the same with each program also streaming `--work-kb` KiB of a weight buffer between
  barriers (the time a stage would spend on its weights), against `chain_work`, the same bytes per program in
  n separate launches;
- `*_prefetch`: the weights do not depend on the previous stage, so a program may load its next stage's slice
  before it waits: `barrier_prefetch` loads stage s + 1's slice into registers before barrier s,
  `chain_pdl_prefetch` loads its slice before the PDL grid-dependency wait (a PDL grid's programs can be resident
  while their predecessor runs). Whether either brings a stage near its bytes' time decides whether a persistent
  or a PDL-prefetching draft forward is worth writing (the barrier alone is not: 1.10 us against 1.29 us for a
  kernel boundary, 2026-12-03).
Writes $OUT/launch_floor.json when OUT is set. The barrier kernels deadlock under the CPU interpreter (it runs
programs one after another); `--compile-only` compiles every launch for sm_90 on a machine without a GPU
(tests/triton_compile.py) and prints each kernel's shared memory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dustin.kernels.launch import pdl_start


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _chain_kernel(src_ptr, dst_ptr, w_ptr, W_ELEMS, PDL: tl.constexpr, WORK: tl.constexpr, BLOCK: tl.constexpr):
    """dst[pid] = src[(pid + 1) % P] + 1 (+ a sum over this program's W_ELEMS weights when WORK)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    acc = tl.load(src_ptr + (pid + 1) % n) + 1.0
    if WORK:
        offs = tl.arange(0, BLOCK)
        part = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, W_ELEMS, BLOCK):
            part += tl.load(w_ptr + pid * W_ELEMS + i + offs).to(tl.float32)
        acc += tl.sum(part, 0) * 0.0
    tl.store(dst_ptr + pid, acc)


@triton.jit
def _chain_prefetch_kernel(src_ptr, dst_ptr, w_ptr, W: tl.constexpr):
    """`_chain_kernel` with WORK under PDL, its W weights loaded (one tile, into registers) BEFORE the wait: legal
    because no grid writes them (the engine's kernels wait first; tests/triton_compile.py checks that order)."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    w = tl.load(w_ptr + pid * W + tl.arange(0, W))
    gdc_wait()
    gdc_launch_dependents()
    acc = tl.load(src_ptr + (pid + 1) % n) + 1.0 + tl.sum(w.to(tl.float32), 0) * 0.0
    tl.store(dst_ptr + pid, acc)


@triton.jit
def _barrier_kernel(buf_ptr, cnt_ptr, w_ptr, N, W_ELEMS, WORK: tl.constexpr, BLOCK: tl.constexpr):
    """N stages; stage s: read the value program (pid + 1) % P wrote in stage s - 1, write this program's, arrive
    at barrier s and wait until every program has. Counters start at zero (the caller zeroes them)."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    acc = pid * 0.0
    offs = tl.arange(0, BLOCK)
    for s in range(N):
        prev = buf_ptr + (s % 2) * n
        nxt = buf_ptr + ((s + 1) % 2) * n
        acc = tl.load(prev + (pid + 1) % n, cache_modifier=".cg") + 1.0
        if WORK:
            part = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(0, W_ELEMS, BLOCK):
                part += tl.load(w_ptr + pid * W_ELEMS + i + offs).to(tl.float32)
            acc += tl.sum(part, 0) * 0.0
        tl.store(nxt + pid, acc)
        tl.debug_barrier()  # every thread's store before the arrival
        tl.atomic_add(cnt_ptr + s, 1, sem="acq_rel")
        while tl.atomic_add(cnt_ptr + s, 0, sem="acquire") < n:
            pass
        tl.debug_barrier()


@triton.jit
def _barrier_prefetch_kernel(buf_ptr, cnt_ptr, w_ptr, N, W: tl.constexpr):
    """`_barrier_kernel` with WORK, each stage's W weights loaded (one tile, into registers) before the previous
    stage's barrier; stage s reads slice s % 2 of the program's weights (the buffer holds two)."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    offs = tl.arange(0, W)
    w = tl.load(w_ptr + pid * W + offs)
    for s in range(N):
        prev = buf_ptr + (s % 2) * n
        nxt = buf_ptr + ((s + 1) % 2) * n
        acc = tl.load(prev + (pid + 1) % n, cache_modifier=".cg") + 1.0 + tl.sum(w.to(tl.float32), 0) * 0.0
        tl.store(nxt + pid, acc)
        w = tl.load(w_ptr + (((s + 1) % 2) * n + pid) * W + offs)  # the next stage's weights, before the wait
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + s, 1, sem="acq_rel")
        while tl.atomic_add(cnt_ptr + s, 0, sem="acquire") < n:
            pass
        tl.debug_barrier()


def _time(fn, n: int, reps: int = 5) -> float:
    """us per instance: fn() enqueues n instances; captured once in a graph, replayed `reps` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=240)
    ap.add_argument("--programs", type=int, default=0, help="programs per launch (default: the SM count)")
    ap.add_argument("--work-kb", type=int, default=64, help="weight KiB each program streams per stage (a power of 2)")
    ap.add_argument("--warps", type=int, default=8, help="warps of the prefetch kernels (they hold a stage's slice)")
    ap.add_argument("--compile-only", action="store_true", help="compile every launch for sm_90, run nothing")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args)
    dev = torch.device("cuda")
    P = args.programs or torch.cuda.get_device_properties(dev).multi_processor_count
    n, block = args.n, 1024
    w_elems = args.work_kb * 1024 // 2
    x = torch.zeros(2 * P, device=dev)
    w = torch.randn(P * w_elems, device=dev, dtype=torch.bfloat16)
    rows = {"device": torch.cuda.get_device_name(dev), "programs": P, "n": n, "work_kb": args.work_kb}

    def chain(pdl: bool, work: bool):
        def fn():
            for i in range(n):
                a, b = (x[:P], x[P:]) if i % 2 == 0 else (x[P:], x[:P])
                _chain_kernel[(P,)](a, b, w, w_elems, PDL=pdl, WORK=work, BLOCK=block, launch_pdl=pdl)
        return fn

    def barrier(work: bool):
        cnt = torch.zeros(n, dtype=torch.int32, device=dev)

        def fn():
            cnt.zero_()
            _barrier_kernel[(P,)](x, cnt, w, n, w_elems, WORK=work, BLOCK=block)
        return fn

    rows["empty_us"] = _time(lambda: [_empty_kernel[(P,)](x) for _ in range(n)], n)
    rows["chain_us"] = _time(chain(False, False), n)
    rows["chain_pdl_us"] = _time(chain(True, False), n)
    rows["barrier_us"] = _time(barrier(False), n)
    rows["chain_work_us"] = _time(chain(False, True), n)
    rows["chain_work_pdl_us"] = _time(chain(True, True), n)
    rows["barrier_work_us"] = _time(barrier(True), n)
    w2 = torch.randn(2 * P * w_elems, device=dev, dtype=torch.bfloat16)  # two slices a program (stages alternate)

    def chain_prefetch():
        for i in range(n):
            a, b = (x[:P], x[P:]) if i % 2 == 0 else (x[P:], x[:P])
            _chain_prefetch_kernel[(P,)](a, b, w, W=w_elems, num_warps=args.warps, launch_pdl=True)

    def barrier_prefetch():
        cnt = torch.zeros(n, dtype=torch.int32, device=dev)
        cnt.zero_()
        _barrier_prefetch_kernel[(P,)](x, cnt, w2, n, W=w_elems, num_warps=args.warps)

    rows["prefetch_warps"] = args.warps
    rows["chain_pdl_prefetch_us"] = _time(chain_prefetch, n)
    rows["barrier_prefetch_us"] = _time(barrier_prefetch, n)
    rows["work_bytes_per_stage"] = P * w_elems * 2
    rows["work_us_at_4.2_TBps"] = rows["work_bytes_per_stage"] / 4.2e6  # one stage's bytes at the copy bandwidth
    print(json.dumps(rows, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "launch_floor.json").write_text(json.dumps(rows, indent=1))


def compile_only(args) -> None:
    """Each kernel with each specialization `main` launches, compiled for sm_90 on CPU tensors."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.triton_compile import compile_launches
    P, w_elems = args.programs or 132, args.work_kb * 1024 // 2
    x, w = torch.zeros(2 * P), torch.zeros(P * w_elems, dtype=torch.bfloat16)
    cnt = torch.zeros(args.n, dtype=torch.int32)
    done: list = []
    with compile_launches(done):
        _empty_kernel[(P,)](x)
        for pdl in (False, True):
            for work in (False, True):
                _chain_kernel[(P,)](x[:P], x[P:], w, w_elems, PDL=pdl, WORK=work, BLOCK=1024, launch_pdl=pdl)
        for work in (False, True):
            _barrier_kernel[(P,)](x, cnt, w, args.n, w_elems, WORK=work, BLOCK=1024)
        _chain_prefetch_kernel[(P,)](x[:P], x[P:], w, W=w_elems, num_warps=args.warps, launch_pdl=True)
        _barrier_prefetch_kernel[(P,)](x, cnt, torch.zeros(2 * P * w_elems, dtype=torch.bfloat16), args.n,
                                       W=w_elems, num_warps=args.warps)
    for c in done:
        print(c.name, c.shared, c.constexprs, c.launch_pdl, c.pdl_order)


if __name__ == "__main__":
    main()
