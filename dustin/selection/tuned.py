"""Tuned sparse configs shipped with dustin, found by model identity (not by path).

`dustin profile` writes a config whose "models" field records each model's identity:
  * what its config.json and tokenizer say: the architecture's shape (family, layers, widths, heads, vocabulary
    size), its RoPE base and RMSNorm epsilon, and a tokenizer identity (`tokenizer_identity`: the token ids of a
    fixed probe text of prose, code, digits, CJK, emoji and chat / fill-in-the-middle markers);
  * a fingerprint of its weights: sha256 of every RMSNorm weight, rounded to bf16 so that the same checkpoint
    loaded in fp32 on a CPU, bf16 on a GPU or fp16 hashes the same, and of the signs of the first 256 embedding
    rows.
`Engine.default_sparse_config` looks the loaded pair up among the files in dustin/configs/ (`match_tuned`): a
config profiled on exactly these weights (the same fingerprints) comes first, from any folder, in any dtype, on
any device; otherwise one whose two models have the loaded pair's identity, such as Qwen's own release of the
default pair, whose weights differ from the Q4_K_M files the shipped config was profiled on. That second kind of
match prints a one-line notice, once. The identity cannot tell apart checkpoints that share config and tokenizer:
fine-tunes or other quantizations of the same models (and, for the shipped file, Qwen2.5-1.5B / 0.5B-Instruct,
which Qwen2.5-Coder was trained from), so they get the tuned config too, with the notice. A pair without a
tokenizer matches by fingerprint only. Pairs without a match fall back to `selection.config.default_config`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from dustin.selection.config import SparseConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
_ARCH = ("family", "n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size")
_CONFIG = ("rope_theta", "norm_eps")
_IDENTITY = _ARCH + _CONFIG + ("tokenizer",)  # what config.json and the tokenizer say; not the weights
# the tokenizer's identity: the ids it gives these texts (pieces a tokenizer of another family, or another version
# of this one, splits otherwise: words, code, numbers, other scripts, chat and fill-in-the-middle markers)
_PROBE = ("def quicksort(xs):\n    return sorted(xs)  # O(n log n)\n\tif x != 0x1F: print(f'{x!r}')\n",
          "The quick brown fox jumps over the lazy dog, 1,234,567.89 times; naïve café.",
          "数据结构与算法 データ構造 자료 구조 структуры данных 🙂👍",
          "<|im_start|>system\nYou are helpful.<|im_end|>\n<|endoftext|>",
          "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|repo_name|><|file_sep|><tool_call></tool_call>",
          "<s></s><|begin_of_text|><|eot_id|><|start_header_id|>")
log = logging.getLogger("dustin")
_NOTED: set[tuple] = set()  # identity matches already noted in this process


def tokenizer_identity(tokenizer) -> str | None:
    """sha256 (32 hex digits) of the token ids `tokenizer` gives the probe texts; None without a tokenizer. The same
    for a tokenizer built from a GGUF's vocabulary and the original's vocab.json + merges.txt (padding entries past
    the real vocabulary, which only the GGUF lists, are never produced)."""
    if tokenizer is None:
        return None
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in _PROBE]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:32]


def model_identity(model, args=None, tokenizer=None) -> dict:
    """Architecture and config fields, the tokenizer's identity, and a weight fingerprint; equal for the same
    checkpoint in any dtype or device. args: the model's unsharded shape under tensor parallelism (default
    model.args)."""
    a = args or model.args
    h = hashlib.sha256(json.dumps([getattr(a, f) for f in _ARCH]).encode())
    norms = [layer.input_layernorm.weight for layer in model.layers] + [model.norm.weight]
    for w in norms:
        h.update(w.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    # norms alone collide for checkpoints whose norms were never trained (all ones); the signs of the first
    # embedding rows (replicated under TP; no rounding changes a sign) tell such checkpoints apart
    h.update(torch.signbit(model.embed_tokens.weight.detach()[:256]).cpu().numpy().tobytes())
    return {**{f: getattr(a, f) for f in _ARCH + _CONFIG}, "tokenizer": tokenizer_identity(tokenizer),
            "fingerprint": h.hexdigest()[:32]}


class TunedMatch(NamedTuple):
    path: Path
    exact: bool  # profiled on exactly these weights (fingerprints equal), not only on the same models
    profiled_on: str  # what the config says it was profiled on ("" when it does not say)


@functools.cache
def shipped() -> tuple[tuple[dict, dict, str, Path], ...]:
    """(target identity, draft identity, profiled_on, path) of every config in CONFIG_DIR that records its two
    models: what `match_tuned` looks through. Read once per process; `shipped.cache_clear()` forgets it (after
    CONFIG_DIR or its files change)."""
    out = []
    for path in sorted(CONFIG_DIR.glob("*.json")):
        models = json.loads(path.read_text()).get("models", {})
        if "target" in models and "draft" in models:
            out.append((models["target"], models["draft"], models.get("profiled_on", ""), path))
    return tuple(out)


def _same_model(recorded: dict, loaded: dict) -> bool:
    """Whether a config's recorded model has the loaded model's identity (a config written before identities were
    recorded has no tokenizer field, and matches by fingerprint only)."""
    return loaded.get("tokenizer") is not None and all(recorded.get(f) == loaded.get(f) for f in _IDENTITY)


def match_tuned(target_identity: dict, draft_identity: dict | None) -> TunedMatch | None:
    """The shipped config profiled on exactly this target and draft, else one profiled on the same two models
    (identity, not weights), else None."""
    if draft_identity is None:
        return None
    configs = shipped()
    for t, d, profiled_on, path in configs:
        if t["fingerprint"] == target_identity["fingerprint"] and d["fingerprint"] == draft_identity["fingerprint"]:
            return TunedMatch(path, True, profiled_on)
    for t, d, profiled_on, path in configs:
        if _same_model(t, target_identity) and _same_model(d, draft_identity):
            return TunedMatch(path, False, profiled_on)
    return None


def find_tuned(target_identity: dict, draft_identity: dict | None) -> Path | None:
    """The path of `match_tuned`'s config, or None."""
    match = match_tuned(target_identity, draft_identity)
    return None if match is None else match.path


def note_identity_match(match: TunedMatch) -> None:
    """Say once per process and config that a tuned config applies by identity: the weights are not the ones it
    was profiled on (logged as a warning of the "dustin" logger: one line on stderr where logging is not set up)."""
    if match.exact or match.path in _NOTED:
        return
    _NOTED.add(match.path)
    on = match.profiled_on or "other weights of these models"
    log.warning(f"dustin: note: sparse config {match.path.name} applies by model identity (architecture, config "
                f"and tokenizer): it was profiled on {on}, and these weights differ; `--config builtin` takes the "
                f"fallback instead, `dustin profile` makes a config for these weights")


def load_tuned(path: Path, exact: bool = True) -> SparseConfig:
    cfg = SparseConfig.load(path)
    source = f"tuned: {path.name}" if exact else f"tuned: {path.name} (by model identity; other weights)"
    return SparseConfig(**{**cfg.__dict__, "source": source})
