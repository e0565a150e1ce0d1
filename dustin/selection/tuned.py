"""Tuned sparse configs shipped with dustin, found by model identity (not by path).

`dustin profile` writes a config whose "models" field records each model's identity: its architecture and a
fingerprint of its weights (sha256 of every RMSNorm weight, rounded to bf16 so that the same checkpoint loaded
in fp32 on a CPU, bf16 on a GPU or fp16 hashes the same, and of the signs of the first 256 embedding rows).
`Engine.make_policy` looks the loaded pair up among the files in dustin/configs/; a folder moved or renamed
still matches, a different checkpoint of the same architecture does not. Pairs without a tuned file fall back
to `selection.config.default_config`.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch

from dustin.selection.config import SparseConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
_ARCH = ("family", "n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size")


def model_identity(model, args=None) -> dict:
    """Architecture fields plus a weight fingerprint; equal for the same checkpoint in any dtype or device.
    args: the model's unsharded shape under tensor parallelism (default model.args)."""
    a = args or model.args
    h = hashlib.sha256(json.dumps([getattr(a, f) for f in _ARCH]).encode())
    norms = [layer.input_layernorm.weight for layer in model.layers] + [model.norm.weight]
    for w in norms:
        h.update(w.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    # norms alone collide for checkpoints whose norms were never trained (all ones); the signs of the first
    # embedding rows (replicated under TP; no rounding changes a sign) tell such checkpoints apart
    h.update(torch.signbit(model.embed_tokens.weight.detach()[:256]).cpu().numpy().tobytes())
    return {**{f: getattr(a, f) for f in _ARCH}, "fingerprint": h.hexdigest()[:32]}


@functools.cache
def _shipped() -> tuple[tuple[str, str, Path], ...]:
    out = []
    for path in sorted(CONFIG_DIR.glob("*.json")):
        models = json.loads(path.read_text()).get("models", {})
        if "target" in models and "draft" in models:
            out.append((models["target"]["fingerprint"], models["draft"]["fingerprint"], path))
    return tuple(out)


def find_tuned(target_identity: dict, draft_identity: dict | None) -> Path | None:
    """The shipped config profiled on exactly this target and draft, or None."""
    if draft_identity is None:
        return None
    for t, d, path in _shipped():
        if t == target_identity["fingerprint"] and d == draft_identity["fingerprint"]:
            return path
    return None


def load_tuned(path: Path) -> SparseConfig:
    cfg = SparseConfig.load(path)
    return SparseConfig(**{**cfg.__dict__, "source": f"tuned: {path.name}"})
