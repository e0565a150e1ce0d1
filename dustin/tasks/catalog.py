"""The task catalogue: every family's module imported (each registers its tasks in `base.REGISTRY` on import), and
the lookup by name or family. Kept apart from `base`, which the family modules import: a registry that imported
its own members would be an import circle."""
from __future__ import annotations

from dustin.errors import InputError
from dustin.tasks import code, longbench, ruler  # noqa: F401  (importing a family registers its tasks)
from dustin.tasks.base import REGISTRY, Task

__all__ = ["REGISTRY", "get_tasks"]


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
