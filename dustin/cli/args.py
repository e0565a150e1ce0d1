"""Argument groups shared by several commands, declared once (generate, demo, eval, profile)."""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser, draft_default: str | None = "default") -> None:
    """--target/--draft (models) and --device/--dtype/--attention (runtime)."""
    g = p.add_argument_group("models")
    g.add_argument("--target", default="default", help="'default' (Qwen2.5-Coder-1.5B-Instruct) or a model folder")
    g.add_argument("--draft", default=draft_default, help="'default' (Qwen2.5-Coder-0.5B-Instruct) or a folder")
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    r.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp32 or fp16")
    r.add_argument("--attention", default="auto", choices=["auto", "sdpa", "triton"], help="attention backend")


def int_list(flag: str, text: str, low: int = 1) -> list[int]:
    """A comma-separated flag of integers >= low (e.g. --contexts, --budgets), or one InputError line."""
    from dustin.errors import InputError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise InputError(f"{flag} must be a comma-separated list of integers >= {low}, got {text!r}")
    return values


def method_list(text: str) -> list[str]:
    """--methods: known decoding methods, de-duplicated in order, or one InputError line."""
    from dustin.engine.config import METHODS
    from dustin.errors import InputError

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
