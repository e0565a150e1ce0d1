"""Where the time of one decode step goes: torch.profiler over a few steps of one method, random weights.

    torchrun --nproc-per-node 2 scripts/gpu_profile_step.py qwen2.5-72b qwen2.5-0.5b vanilla 8 8192
    python3 scripts/gpu_profile_step.py qwen2.5-7b qwen2.5-0.5b dustin 16 32768

Prints (rank 0) the GPU kernels by total time and the kernel count per step; writes $OUT/profile_<method>.txt.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from dustin.bench import e2e
    from dustin.models.args import named_config
    from dustin.parallel.tp import is_main_process

    target, draft, method, batch, context = sys.argv[1:6]
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    a = p.parse_args(["--steps", "3", "--warmup", "2"])
    engine = e2e.build_engine(named_config(target), named_config(draft), "cuda")
    from torch.profiler import ProfilerActivity, profile

    e2e.run_method(engine, method, int(batch), int(context), a)  # warm: graphs captured, kernels compiled
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        row = e2e.run_method(engine, method, int(batch), int(context), a)
    if not is_main_process():
        return 0
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    n_kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    head = (f"{target} + {draft}, {method}, batch {batch}, context {context}: {row['ms_per_step']} ms/step, "
            f"~{n_kernels / (a.steps + a.warmup):.0f} GPU kernels per step (incl. warm-up steps)\n")
    print(head + table, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"profile_{method}.txt").write_text(head + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
