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
