"""Real long inputs that every machine has: Python standard-library modules as code-completion prompts,
and output comparison helpers shared by the demo and the evaluation tools."""
from __future__ import annotations

import sysconfig
from pathlib import Path

from dustin.errors import InputError

DEFAULT_SOURCE = "argparse.py"


def long_code_prompt(tokenizer, n_tokens: int, source: str | None = None) -> tuple[str, str]:
    """The first ~n_tokens of a stdlib module, cut after the last complete `def ...:` line."""
    path = Path(source) if source and Path(source).is_file() else Path(sysconfig.get_paths()["stdlib"]) / (
        source or DEFAULT_SOURCE)
    if not path.is_file():
        raise InputError(f"demo source {path} does not exist")
    text = path.read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n_tokens // 2:
        raise InputError(f"{path.name} has only {len(ids)} tokens; pick a longer --source")
    head = tokenizer.decode(ids[:n_tokens])
    cut = max(head.rfind("\n    def "), head.rfind("\ndef "))
    end = head.find("\n", cut + 1) if cut > len(head) // 2 else -1  # keep the whole `def` line, drop the rest
    return (head[: end + 1] if end > 0 else head), path.name


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
