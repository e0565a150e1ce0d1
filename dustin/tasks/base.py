"""Long-context accuracy tasks, kept apart from models and decoding (lm-eval style).

A task turns a tokenizer, a context length, a sample count and a seed into `Sample`s (prompt token ids plus the
reference answers) and scores a prediction against the references with the task's own metric. `dustin eval
tasks` runs the samples through each decoding method and aggregates the scores; nothing here imports the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from dustin.errors import InputError


@dataclass
class Sample:
    task: str
    context: int  # the requested prompt length in tokens (the prompt is at most this long)
    index: int  # sample number within (task, context): with the seed it names the sample
    prompt_ids: list[int]
    references: list[str]
    max_new_tokens: int
    meta: dict = field(default_factory=dict)  # task-specific (depth, file, ...), stored with the result


class Task(Protocol):
    name: str
    family: str  # "ruler" | "code" | "longbench"
    max_new_tokens: int

    def samples(self, tokenizer, context: int, n: int, seed: int) -> list[Sample]: ...

    def score(self, prediction: str, references: list[str]) -> float:
        """In [0, 1]; tables show 100x."""
        ...


REGISTRY: dict[str, Task] = {}


def register(task: Task) -> Task:
    if task.name in REGISTRY:
        raise ValueError(f"task {task.name!r} registered twice")
    REGISTRY[task.name] = task
    return task


def _load_families() -> None:
    from dustin.tasks import code, longbench, ruler  # noqa: F401  (each registers its tasks)


def get_tasks(spec: str) -> list[Task]:
    """Comma-separated task names and/or families ('ruler', 'code', 'all'), in registry order."""
    _load_families()
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
