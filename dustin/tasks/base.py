"""Long-context accuracy tasks, kept apart from models and decoding (lm-eval style).

A task turns a tokenizer, a context length, a sample count and a seed into `Sample`s (prompt token ids plus the
reference answers) and scores a prediction against the references with the task's own metric. `dustin eval
tasks` runs the samples through each decoding method and aggregates the scores; nothing here imports the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


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

    def check_data(self) -> None:
        """Raise one InputError line if data the task reads from the user's disk is not there: called before any
        model loads. (Data that dustin downloads itself is fetched on first use.)"""
        ...

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
