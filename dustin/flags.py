"""Argument groups shared by several commands, declared once (generate, demo, bench, eval, profile, serve).

This module sits below every command: the command modules (dustin/bench, dustin/eval, dustin/profiling,
dustin/serve) import their flag groups from here, and `dustin.cli` imports them all. Were the groups declared
under dustin/cli, the commands would import the command line that imports them back. It imports nothing of
dustin at module level; the checks that need the engine or the sparse configs import them when called.
"""
from __future__ import annotations

import argparse

from dustin.defaults import AUTO_MAX, AUTO_MIN, AUTO_P, DRAFT_KERNEL, DRAFT_WINDOW, GAMMA
from dustin.errors import InputError


def add_model_args(p: argparse.ArgumentParser, draft_default: str | None = "default") -> None:
    """--target/--draft (models) and --device/--dtype/--attention (runtime)."""
    g = p.add_argument_group("models")
    g.add_argument("--target", default="default", help="'default' (Qwen2.5-Coder-1.5B-Instruct) or a model folder")
    g.add_argument("--draft", default=draft_default, help="'default' (Qwen2.5-Coder-0.5B-Instruct) or a folder")
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default="auto", help="auto (cuda when a CUDA GPU is available, else cpu), cpu or "
                                                    "cuda[:N]")
    r.add_argument("--dtype", default="auto",
                   help="auto (bf16 on GPU and on CPUs that compute bf16 natively: AVX512-BF16 or AMX; else fp32), "
                        "bf16, fp32 or fp16")
    r.add_argument("--attention", default="auto", choices=["auto", "sdpa", "triton"], help="attention backend")
    r.add_argument("--rope-scaling", default=None, metavar="yarn:F",
                   help="extend both models' context F times with YaRN (Qwen2.5: yarn:4 for 128k, as its model "
                        "cards document)")


# where the commands write: files whose folder must exist, and folders made with their parents
_OUTPUT_FILES = ("json_out", "plot_out")
_OUTPUT_FOLDERS = ("out",)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written, with one InputError line, before any model loads: a file
    flag's folder must be a writable folder, a folder flag's nearest existing ancestor too (the command makes
    the rest). Otherwise an evaluation or benchmark would run for its whole length and fail at its first write."""
    import os
    from pathlib import Path

    for name in _OUTPUT_FILES + _OUTPUT_FOLDERS:
        value = getattr(args, name, None)
        if not value:
            continue
        flag, path = f"--{name.replace('_', '-')}", Path(value)
        if name in _OUTPUT_FILES:
            if path.is_dir():
                raise InputError(f"{flag} {value} is a folder, not a file")
            folder = path.parent
            if not folder.is_dir():
                raise InputError(f"{flag} {value}: the folder {folder} does not exist")
        else:
            folder = next(p for p in (path, *path.parents) if p.exists())
            if not folder.is_dir():
                raise InputError(f"{flag} {value}: {folder} is not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InputError(f"{flag} {value}: the folder {folder} is not writable")


def int_list(flag: str, text: str, low: int = 1) -> list[int]:
    """A comma-separated flag of integers >= low (e.g. --contexts, --budgets), or one InputError line."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise InputError(f"{flag} must be a comma-separated list of integers >= {low}, got {text!r}")
    return values


def budget_list(flag: str, text: str) -> list[int | str]:
    """A sweep's budgets: integers k >= 21 and `auto:P` entries (P in (0, 1]; plain `auto` is auto:0.95), in
    order without repeats, or one InputError line. An auto entry keeps its canonical text ("auto:0.9") as its
    key in result files."""
    out: list[int | str] = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            if x == "auto" or x.startswith("auto:"):
                p = float(x[5:]) if x != "auto" else AUTO_P
                if not 0.0 < p <= 1.0:
                    raise ValueError
                value: int | str = f"auto:{p:g}"
            else:
                value = int(x)
                if value < 21:
                    raise ValueError
        except ValueError:
            raise InputError(f"{flag} must be a comma-separated list of integers >= 21 or auto:P with P in (0, 1], "
                             f"got {text!r}") from None
        if value not in out:
            out.append(value)
    if not out:
        raise InputError(f"{flag} must be a comma-separated list of integers >= 21 or auto:P, got {text!r}")
    return out


def auto_p(budget: int | str | None) -> float | None:
    """The P of a sweep's `auto:P` budget, else None."""
    return float(budget[5:]) if isinstance(budget, str) and budget.startswith("auto:") else None


def method_list(text: str) -> list[str]:
    """--methods: known decoding methods, de-duplicated in order, or one InputError line."""
    from dustin.engine.config import METHODS
    methods = list(dict.fromkeys(m for m in text.split(",") if m))
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown:
        raise InputError(f"--methods: unknown method {', '.join(unknown) or repr(text)}; choose from "
                         f"{', '.join(METHODS)}")
    return methods


def check_sparse_config(path: str | None, budgets: list[int]) -> None:
    """--config (a file, or 'builtin') readable and valid at every budget, before any model loads."""
    if path and path != "builtin":
        from dustin.selection.config import SparseConfig

        cfg = SparseConfig.load(path)
        for k in budgets:
            cfg.with_budget(k)


SPARSE_CONFIG_HELP = ("sparse verification config JSON (score heads, m), or 'builtin' for the hand-written fallback "
                      "(default: the tuned config shipped for this pair, else builtin)")


def add_speculation_args(p: argparse.ArgumentParser, auto: bool = False):
    """--gamma and --draft-window: how the draft speculates (every speculative command, same defaults). auto: --gamma
    may also be auto (the commands that run the engine core: each sequence picks its Γ per step)."""
    g = p.add_argument_group("speculation")
    if auto:
        g.add_argument("--gamma", type=int_or_auto, default=GAMMA,
                       help="draft tokens per step (Γ), or auto: each sequence picks its own Γ per step from step "
                            "costs measured at start and its own acceptance (docs/choosing.md)")
    else:
        g.add_argument("--gamma", type=int, default=GAMMA, help="draft tokens per step (Γ)")
    g.add_argument("--draft-window", type=int, default=DRAFT_WINDOW,
                   help="positions a streaming draft attends: 4 sinks + the most recent (magicdec, dustin, ...)")
    return g


DRAFT_KERNEL_HELP = (
    "the draft's decoder layers as one persistent kernel per forward (default: %s). It applies on sm_90 GPUs (H100, "
    "H200), bf16, to a streaming draft (magicdec's and the sparse methods'; generate's --draft-kv streaming) of the "
    "shapes it is built for (Qwen2.5-0.5B; Llama-3.2-1B and Qwen2.5-1.5B with K in halves), to forwards of up to 64 "
    "token rows (larger batches take the per-layer kernels, forward by forward); the LM head and argmax join the "
    "launch only for all-greedy batches of a build with K whole (the 0.5B draft). Elsewhere the per-layer kernels "
    "run, with the reason logged once; nvcc builds it at first use (`dustin warmup` ahead). Its rounding order "
    "differs, so a draft token may differ at a near-tie")


def add_draft_kernel_arg(g) -> None:
    """--draft-kernel / --no-draft-kernel (ExecutionOptions.draft_kernel; default: defaults.DRAFT_KERNEL)."""
    g.add_argument("--draft-kernel", action=argparse.BooleanOptionalAction, default=DRAFT_KERNEL,
                   help=DRAFT_KERNEL_HELP % ("on" if DRAFT_KERNEL else "off"))




def int_or_auto(text: str) -> int | str:
    """--gamma, --budget: an integer, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {text!r}") from None


def budget_settings(args, sparse: bool = True, tail: bool | None = None) -> dict:
    """The GenerationConfig keywords of --budget and its auto settings (--budget-p, --budget-min,
    --budget-max) and --tail-share, in one place so that no command drops one; a method that verifies against the
    full cache (sparse=False) gets budget None. tail: whether --tail-share applies (default: sparse); a command that
    runs several methods passes it for the dustin ones only, so that the others run without a tail rather than
    refuse it."""
    return {"budget": args.budget if sparse else None, "budget_p": args.budget_p, "budget_min": args.budget_min,
            "budget_max": args.budget_max, "budget_dense": args.budget_dense and sparse,
            "tail_share": args.tail_share if (sparse if tail is None else tail) else None}


def add_sparse_args(p: argparse.ArgumentParser, sweep: str | None = None, auto: bool = True):
    """--budget K (or, for a sweep, --budgets K,...), --config and, where the command runs `auto` budgets, their
    flags: sparse verification, declared once."""
    g = p.add_argument_group("sparse verification")
    if sweep is None:
        g.add_argument("--budget", type=int_or_auto, default=None,
                       help="KV positions per sequence the target verifies against (k; default: the config's, 512), "
                            "or auto: per sequence and step, the fewest positions holding --budget-p of the "
                            "estimated attention mass (dustin methods)")
        g.add_argument("--budget-p", type=float, default=AUTO_P, help="--budget auto: attention mass to cover")
    else:
        g.add_argument("--budgets", default=sweep, help="k values for the sparse methods, comma separated" + (
            "; auto:P entries size k per sequence and step to cover P of the estimated attention mass (dustin "
            "methods only)" if auto else ""))
    if auto:
        # a sweep sizes k with its auto:P entries (no --budget-p); the other commands with --budget auto --budget-p P
        which, mass = ("auto:P entries", "P") if sweep is not None else ("--budget auto", "--budget-p")
        g.add_argument("--budget-min", type=int, default=AUTO_MIN, help=f"{which}: smallest k")
        g.add_argument("--budget-max", type=int, default=AUTO_MAX, help=f"{which}: largest k")
        g.add_argument("--budget-dense", action="store_true",
                       help=f"{which}: a sequence whose --budget-max best positions hold less than {mass} of its "
                            f"estimated attention verifies against the whole cache that step")
    if sweep is None:
        g.add_argument("--tail-share", type=float, default=None,
                       help="dustin, dustin-t, dustin-d: the share of --budget drawn per layer and KV head as a "
                            "sampled, reweighted tail from the positions outside the exact set (0: none; default: "
                            "the config's tail_share, 0 unless it sets one). Sweeps compare it as the dustin-tail rows")
    g.add_argument("--config", default=None, help=SPARSE_CONFIG_HELP)
    return g
