"""The step-time measurement behind `--gamma auto`'s cost model (dustin/engine/gamma.py): real steps of every Γ a
row may take, on the engine's own batch of slots, run as serving runs them (their step graphs on a GPU, captured
here and kept for serving)."""
from __future__ import annotations

import time

import torch

from dustin.engine.gamma import StepCosts
from dustin.engine.worker.runner import Runner


def time_steps(runner: Runner, gamma: int, context: int, repeats: int = 3) -> float:
    """Median seconds of a step of G = gamma with every row at `context` cached positions. Wants every row idle,
    and leaves them so (the rows ride along as stopped rows, so nothing advances)."""
    b, step = runner.batch, runner.device_step
    if b.active_rows or b.prompt_rows:
        raise RuntimeError("time_steps wants every row idle")
    if not 1 <= context <= step.graph_max_len:
        raise ValueError(f"context must be in [1, {step.graph_max_len}], got {context}")
    b.target_cache.lengths.fill_(context)
    b.host_lengths = [context] * b.B
    b.row_gamma.fill_(gamma)  # what a step of G = gamma does with its rows (a plain row may read densely)
    times = []
    cuda = runner.device.type == "cuda"
    try:
        with torch.inference_mode():
            for i in range(repeats + 2):  # the first runs compile (and capture the graph)
                if cuda:
                    torch.cuda.synchronize(runner.device)
                t0 = time.perf_counter()
                step.launch(True, gamma, False)
                if cuda:
                    torch.cuda.synchronize(runner.device)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
    finally:  # idle again, in place: the graphs captured here read these very tensors
        b.restore_row_gamma()
        b.target_cache.lengths.fill_(1)
        b.host_lengths = [1] * b.B
        for t in (b.pending, b.prev):
            t.zero_()
        b.done.fill_(True)
    return sorted(times)[len(times) // 2]


def measure_step_costs(runner: Runner, contexts: tuple[int, int] | None = None, repeats: int = 3,
                       progress=None) -> StepCosts:
    """`time_steps` of every Γ the runner's rows may take at two contexts: 64 positions and the slots' capacity
    (default)."""
    b = runner.batch
    top = runner.device_step.graph_max_len
    lo, hi = contexts or (min(64, top), top)
    points = {}
    for g in range(b.min_gamma, b.gamma + 1):
        points[g] = ((lo, time_steps(runner, g, lo, repeats)), (hi, time_steps(runner, g, hi, repeats)))
        if progress is not None:
            progress(g)
    return StepCosts.from_points(points)
