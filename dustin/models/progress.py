"""Progress output on stderr (rich), so stdout stays clean for scripts: messages, bars, spinners."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Sequence


def stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an in-memory stream (pytest, notebooks)
        return None


def say(enabled: bool, message: str) -> None:
    if enabled:
        from rich.console import Console
        Console(stderr=True).print(message, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def bar(enabled: bool, description: str, total: int, as_bytes: bool = False) -> Iterator[Callable[..., None]]:
    """A rich progress bar on stderr (stdout stays clean for scripts); yields `advance(n=1)`."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    columns: Sequence = ((DownloadColumn(), TransferSpeedColumn()) if as_bytes else (MofNCompleteColumn(),))
    with Progress(TextColumn("{task.description}"), BarColumn(), *columns, TimeRemainingColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def spinner(enabled: bool, message: str):
    if not enabled:
        return contextlib.nullcontext()
    from rich.console import Console
    return Console(stderr=True).status(message)
