"""Where a speculative step's time goes, against its byte roofline: per method, ms/step and phases (the engine's
timers), GPU busy time vs wall time over profiled steps (the gap = Python + launch overhead between kernels),
kernels per step, the top kernels, and the step's bytes / copy bandwidth. Random weights of real shapes,
acceptance-controlled (label any figure taken from here so).

    python3 scripts/gpu_step_anatomy.py --pair qwen2.5-1.5b:qwen2.5-0.5b --batch 16 --context 32768 \
        --methods vanilla,magicdec,streaming,dustin --tau 3.8 \
        --config dustin/configs/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.json

Writes $OUT/anatomy_<target>.json (and prints a table) when OUT is set.

Programmatic Dependent Launch (dustin/kernels/launch.py: our Triton kernels of the step launched so that each one's
launch overlaps its predecessor's tail, on sm_90+) is opt-in. Its A/B is this script run twice, once with
`DUSTIN_PDL=1` in the environment; the header line and the JSON's "pdl" say which, and the file of the PDL-on run
is named anatomy_<target>_pdl.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def busy_us(events) -> float:
    """Union of the CUDA kernels' intervals (us): time the GPU was executing anything."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def main() -> int:
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from dustin.bench import e2e
    from dustin.bench.decode import copy_bandwidth
    from dustin.kernels.launch import use_pdl

    p = argparse.ArgumentParser()
    p.add_argument("--pair", default="qwen2.5-1.5b:qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--top", type=int, default=14, help="kernels printed per method (the JSON keeps all)")
    p.add_argument("--no-fused-ops", action="store_true",
                   help="plain PyTorch ops instead of our fused kernels: the decode-layer kernels of "
                        "dustin/kernels/decode_linear.py and the fused norm / RoPE / SiLU (ExecutionOptions.fused_ops)")
    p.add_argument("--tag", default="", help="appended to the JSON's name (A/B runs of one setting)")
    e2e.add_arguments(p)
    a = p.parse_args()
    t_name, d_name = a.pair.split(":")
    reach = a.context + 4096
    t_args = e2e._shape(t_name)
    d_args = e2e._shape(d_name)
    t_args = replace(t_args, max_position_embeddings=max(t_args.max_position_embeddings, reach))
    d_args = replace(d_args, max_position_embeddings=max(d_args.max_position_embeddings, reach))
    a.tau = a.tau if a.tau is not None else e2e.DEFAULT_TAU
    engine = e2e.build_engine(t_args, d_args, "cuda")
    bw = a.copy_bw = copy_bandwidth()
    pdl = use_pdl(torch.device("cuda", torch.cuda.current_device()))
    print(f"# {a.pair} B={a.batch} ctx={a.context} tau={a.tau} gamma={a.gamma} | {torch.cuda.get_device_name()} "
          f"| copy {bw / 1e12:.2f} TB/s | PDL {'on' if pdl else 'off'} | {time.strftime('%Y-%m-%d')} | random "
          f"weights, acceptance-controlled")
    rows = []
    for method in a.methods.split(","):
        row = e2e.run_method(engine, method, a.batch, a.context, a)
        row["roofline_ms"] = row["roofline_ms_per_step"]
        row["pct_of_roofline"] = row["pct_of_byte_roofline"]
        # profiled steps of a warm session: GPU busy vs wall, kernel count, top kernels
        steps = a.profile_steps
        core, _ = e2e.bench_session(engine, method, a.batch, a.context, a, 3 + steps)
        e2e.run_steps(core, 3)  # the prefill and 3 steps
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            e2e.run_steps(core, steps)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        del core
        kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
        row["profiled_wall_ms_per_step"] = round(1e3 * wall / steps, 3)
        row["gpu_busy_ms_per_step"] = round(busy_us(kern) / 1e3 / steps, 3)
        row["kernels_per_step"] = round(len(kern) / steps, 1)
        avg = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        row["top_kernels"] = [{"name": e.key[:160], "calls_per_step": round(e.count / steps, 1),
                               "ms_per_step": round(e.device_time_total / 1e3 / steps, 3)}
                              for e in avg if e.device_time_total > 0]
        rows.append(row)
        print(f"\n## {method}: {row['ms_per_step']:.2f} ms/step, tau {row['tau']}, "
              f"roofline {row['roofline_ms']:.2f} ms ({row['pct_of_roofline']}%), "
              f"GPU busy {row['gpu_busy_ms_per_step']:.2f} ms/step, "
              f"{row['kernels_per_step']} kernels/step; phases {row['phases_ms_per_step']}; bytes "
              f"{ {k: round(v / 1e9, 3) for k, v in row['bytes_per_step'].items()} } GB", flush=True)
        for k in row["top_kernels"][:a.top]:
            print(f"   {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:6.1f}  {k['name']}")
    if os.environ.get("OUT"):
        tag = (("_no_overlap" if a.no_overlap else "") + ("_no_fused_ops" if a.no_fused_ops else "")
               + ("_pdl" if pdl else "") + (f"_{a.tag}" if a.tag else ""))
        Path(os.environ["OUT"], f"anatomy_{t_name}{tag}.json").write_text(json.dumps(
            {"pair": a.pair, "batch": a.batch, "context": a.context, "tau": a.tau, "copy_bw": bw,
             "device": torch.cuda.get_device_name(), "pdl": pdl, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
