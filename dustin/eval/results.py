"""Result files of the evaluation commands: resumable and written atomically.

A file holds the settings that produced it and a list of rows. A rerun with the same file and settings skips
the rows (or samples) already there; a file written under other settings is refused rather than mixed."""
from __future__ import annotations

import json
import os
from pathlib import Path

from dustin.errors import InputError


def load_results(path: str | None, settings: dict, what: str) -> dict:
    """{"settings": ..., "rows": [...]} from `path`, or a fresh one; InputError if its settings differ."""
    if not path or not Path(path).is_file():
        return {"settings": settings, "rows": []}
    try:
        data = json.loads(Path(path).read_text())
        old = data["settings"]
        data["rows"] = list(data["rows"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"--json-out {path} exists but is not a {what} result file ({e}): pick another file"
                         ) from None
    diff = [k for k in settings if old.get(k) != settings[k]]
    if diff:
        raise InputError(f"--json-out {path} holds results for other settings ({', '.join(diff)} differ): "
                         f"pick another file to start fresh")
    return data


def save_results(path: str | None, results: dict) -> None:
    """Write via a temporary file and a rename: a crash mid-write keeps the previous file whole."""
    if not path:
        return
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
