"""The task catalogue: every family's module imported (each registers its tasks in `base.REGISTRY` on import), and
the lookup by name or family. Kept apart from `base`, which the family modules import: a registry that imported
its own members would be an import circle."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from dustin.errors import InputError
from dustin.tasks import code, longbench, ruler  # noqa: F401  (importing a family registers its tasks)
from dustin.tasks.base import REGISTRY, Sample, Task

__all__ = ["REGISTRY", "build_samples", "get_tasks"]


def get_tasks(spec: str) -> list[Task]:
    """Comma-separated task names and/or families ('ruler', 'code', 'all'), in registry order."""
    picked: list[Task] = []
    for item in [x.strip() for x in spec.split(",") if x.strip()]:
        if item == "all":
            found = list(REGISTRY.values())
        elif item in {t.family for t in REGISTRY.values()}:
            found = [t for t in REGISTRY.values() if t.family == item]
        elif item in REGISTRY:
            found = [REGISTRY[item]]
        else:
            raise InputError(f"--tasks: unknown task {item!r}; choose from {', '.join(REGISTRY)}, ruler, code or all")
        picked += [t for t in found if t not in picked]
    if not picked:
        raise InputError("--tasks: no task given")
    return picked


def build_samples(tasks: list[Task], tokenizer, context: int, n: int, seed: int,
                  workers: int | None = None) -> list[Sample]:
    """Every task's `samples(tokenizer, context, n, seed)`, in task order, the tasks built on `workers` threads
    (default: one per task, at most one per CPU core). Why threads: building a long prompt is mostly tokenization
    (a RULER sample at 64k tokenizes its whole prompt 4-7 times while it sizes its haystack) and the tokenizer
    releases the GIL while it encodes; built serially, RULER's 13 tasks x 20 samples at 64k kept an H200 waiting
    for minutes before its first prefill. A sample depends only on (task, context, seed, index), so the result
    is the same whatever the thread count."""
    workers = min(len(tasks), os.cpu_count() or 1) if workers is None else max(1, min(workers, len(tasks)))
    if workers == 1:
        return [s for t in tasks for s in t.samples(tokenizer, context, n, seed)]
    with ThreadPoolExecutor(workers, thread_name_prefix="dustin-samples") as pool:
        built = [pool.submit(t.samples, tokenizer, context, n, seed) for t in tasks]
        return [s for job in built for s in job.result()]
