"""`dustin bench sampling`: the cost of a sampled decode step against a greedy one.

    dustin bench sampling --device cpu --batch 4 --context 512 --steps 8       # the default pair
    dustin bench sampling --target qwen2.5-1.5b --draft qwen2.5-0.5b --batch 16 --context 8192   # random weights

`--target`/`--draft` take model folders (`default`: the fetched pair) or, both, named configs (random weights of
those shapes: what a step costs does not depend on the weights' values).

One session per mode over the same prompts (random token ids, the prompt caches filled with noise: a step's cost
does not depend on their values). The sessions step in turn, `--warmup` untimed rounds first (the first steps
read the weights from disk; on a GPU: the eager first step and the CUDA-graph capture), then `--steps` timed
rounds; each step ends in its one host sync. Modes:
  greedy   temperature 0: argmax drafts, greedy verification;
  sampled  one rule for the batch (`dustin generate --temperature`): drafts sampled, lossless speculative sampling;
  rows     every row its own rule and seed (`dustin serve`'s requests, `RowSampling`'s per-row path).
Reported per mode: wall ms per step (median and mean of the timed steps) and the median over greedy's, and the
process's CPU time per step (median; on a CPU shared with other jobs a steadier measure of the work than wall
time; run with OMP_WAIT_POLICY=PASSIVE so that idle OpenMP threads do not spin it up).
"""
from __future__ import annotations

import json
import statistics
import time

from dustin.bench.e2e import build_engine
from dustin.defaults import DEFAULT_METHOD
from dustin.engine.config import METHODS, GenerationConfig, methods_help
from dustin.engine.request import SamplingParams, SamplingRule
from dustin.errors import InputError
from dustin.flags import add_model_args
from dustin.models.args import NAMED_CONFIGS, named_config, with_rope_scaling

MODES = ("greedy", "sampled", "rows")


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--method", default=DEFAULT_METHOD, choices=list(METHODS), help=methods_help(DEFAULT_METHOD))
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma separated, of {', '.join(MODES)}")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampled modes' temperature (> 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (GPU: graph capture, compiles)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    p.add_argument("--sampler-only", action="store_true",
                   help="time the sampler's work alone (Γ draft choices and the acceptance on random logits of "
                        "--vocab entries), without the models")
    p.add_argument("--vocab", type=int, default=151936, help="--sampler-only: vocabulary size (default Qwen2.5's)")
    p.add_argument("--json-out", default=None, help="write the results JSON here (default: none)")


def _check(args) -> list[str]:
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise InputError(f"--modes must name some of {', '.join(MODES)} once each, got {args.modes!r}")
    for flag, value, low in (("--batch", args.batch, 1), ("--context", args.context, 2), ("--steps", args.steps, 1),
                             ("--warmup", args.warmup, 0), ("--gamma", args.gamma, 1), ("--vocab", args.vocab, 2)):
        if value < low:
            raise InputError(f"{flag} must be >= {low}, got {value}")
    if not args.temperature > 0:
        raise InputError(f"--temperature must be > 0 (the greedy mode is temperature 0), got {args.temperature}")
    return modes


def make_session(engine, prompts: list[list[int]], mode: str, args):
    """An engine core of `mode` over `prompts` (noise-filled caches), long enough for every warm-up and timed step;
    each `step()` is one engine step (its first also fills the caches: a warm-up step)."""
    from dataclasses import replace

    temperature = 0.0 if mode == "greedy" else args.temperature
    rounds = args.warmup + args.steps + 2
    cfg = GenerationConfig(method=args.method, gamma=args.gamma)
    # one rule for the batch, its rows drawing from the batch's generator
    params = SamplingParams(max_tokens=rounds * (args.gamma + 1), temperature=temperature, top_p=args.top_p,
                            top_k=args.top_k, ignore_eos=True)
    if mode == "rows":  # the serving engine's batch: each row its own rule and seed
        params = [replace(params, temperature=args.temperature, seed=row) for row in range(len(prompts))]
    return EngineStepper(engine.start(prompts, cfg, fill="noise", params=params))


class EngineStepper:
    """`step()`: one engine step of an offline batch on the engine core; `sampler`: its batch's sampling state."""

    def __init__(self, core) -> None:
        self.core = core

    def step(self) -> None:
        self.core.step()

    @property
    def sampler(self):
        return self.core.runner.batch.sampler


class SamplerStep:
    """`--sampler-only`: the sampler's work of one speculative step in `mode`, without the models: Γ draft choices
    over [batch, vocab] logits and the acceptance over [batch, Γ + 1, vocab] (random logits, N(0, 3²), in the
    models' dtype), then the step's read-back of the accepted counts."""

    def __init__(self, mode: str, args, device, dtype) -> None:
        import torch

        from dustin.engine.sampling import RowSampling

        rule = SamplingRule(0.0 if mode == "greedy" else args.temperature, args.top_k, args.top_p)
        self.sampler = RowSampling(args.batch, rule, torch.Generator(device=device).manual_seed(0))
        if mode == "rows":
            for row in range(args.batch):
                self.sampler.set_row(row, rule, seed=row)
        g = torch.Generator(device=device).manual_seed(1)
        shape = (args.batch, args.gamma + 1, args.vocab)
        self.target_logits = (3 * torch.randn(shape, generator=g, device=device)).to(dtype)
        self.draft_logits = [(3 * torch.randn(shape[0], shape[2], generator=g, device=device)).to(dtype)
                             for _ in range(args.gamma)]

    def step(self) -> None:
        import torch

        tokens, probs = zip(*(self.sampler.choose(x) for x in self.draft_logits), strict=True)
        draft_probs = None if probs[0] is None else torch.stack(probs, 1)
        self.sampler.accept(torch.stack(tokens, 1), draft_probs, self.target_logits)[0].tolist()


def time_modes(steppers: dict, args) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each timed step per mode, of sessions (or `SamplerStep`s). They step in turn (greedy,
    sampled, rows, greedy, ...), so that a slower stretch of a shared machine falls on every mode alike; the warm-up
    steps come first."""
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in steppers}
    for i in range(args.warmup + args.steps):
        for mode, stepper in steppers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            stepper.step()
            if i >= args.warmup:
                times[mode].append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def run(args) -> int:
    import torch

    from dustin.engine.engine import Engine
    from dustin.parallel.tp import init_distributed

    modes = _check(args)
    world = init_distributed()[1]
    if args.sampler_only:
        from dustin.engine.pair import parse_device, resolve_dtype

        device = parse_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        steppers = {mode: SamplerStep(mode, args, device, dtype) for mode in modes}
        return _report(args, steppers, str(device), str(dtype).removeprefix("torch."), "sampler only")
    if world > 1:
        raise InputError("dustin bench sampling runs the models in one process (its modes step in turn, each on a "
                         "core of its own; tensor-parallel ranks follow one core's plans): use --sampler-only, or "
                         "bench e2e under torchrun")
    named = [spec in NAMED_CONFIGS for spec in (args.target, args.draft)]
    if all(named):
        t_args, d_args = (with_rope_scaling(named_config(spec), args.rope_scaling)
                          for spec in (args.target, args.draft))
        engine = build_engine(t_args, d_args, args.device, args.attention, args.dtype)
    elif any(named):
        raise InputError("--target and --draft: both named configs (random weights) or both model folders")
    else:
        engine = Engine.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype,
                                        attention=args.attention, rope_scaling=args.rope_scaling)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.pair.vocab_limit, (args.context,), generator=gen).tolist()
               for _ in range(args.batch)]
    steppers = {mode: make_session(engine, prompts, mode, args) for mode in modes}
    pair = engine.pair
    return _report(args, steppers, str(pair.device), pair.dtype_name, f"{args.method}, context {args.context}")


def _report(args, steppers: dict, device: str, dtype: str, what: str) -> int:
    import torch

    from dustin.parallel.tp import is_main_process

    rows = []
    for mode, times in time_modes(steppers, args).items():
        wall, cpu = [t for t, _ in times], [c for _, c in times]
        rows.append({"mode": mode, "sampler_mode": steppers[mode].sampler.mode,
                     "ms_per_step": round(1e3 * statistics.median(wall), 2),
                     "mean_ms": round(1e3 * statistics.fmean(wall), 2),
                     "cpu_ms_per_step": round(1e3 * statistics.median(cpu), 2), "steps": len(times)})
    base = next((r for r in rows if r["mode"] == "greedy"), None)
    for r in rows:
        r["x_greedy"] = None if base is None else round(r["ms_per_step"] / base["ms_per_step"], 3)
        r["cpu_x_greedy"] = None if base is None else round(r["cpu_ms_per_step"] / base["cpu_ms_per_step"], 3)
    out = {"device": device, "dtype": dtype, "torch": torch.__version__, "sampler_only": args.sampler_only,
           "method": args.method, "gamma": args.gamma, "batch": args.batch, "context": args.context,
           "vocab": args.vocab if args.sampler_only else None, "temperature": args.temperature,
           "top_p": args.top_p, "top_k": args.top_k, "threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%d"), "results": rows}
    if not is_main_process():
        return 0
    print(f"# {device} {dtype} | {what}, Γ {args.gamma}, batch {args.batch} | temperature {args.temperature}, "
          f"top-p {args.top_p}, top-k {args.top_k}")
    print("| mode | ms/step (median) | mean | x greedy | CPU ms/step (median) | x greedy |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio, cpu = ("-" if r[k] is None else f"{r[k]:.2f}" for k in ("x_greedy", "cpu_x_greedy"))
        print(f"| {r['mode']} | {r['ms_per_step']:.1f} | {r['mean_ms']:.1f} | {ratio} | {r['cpu_ms_per_step']:.1f} "
              f"| {cpu} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0
