"""Phase timers that do not add host syncs: CUDA events on GPU (read once at the end), wall clock on CPU."""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: dict[str, object] = {}
        self._spans: dict[str, list] = defaultdict(list)
        self._host: dict[str, float] = defaultdict(float)

    def start(self, phase: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open[phase] = ev
        else:
            self._open[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        begin = self._open.pop(phase)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans[phase].append((begin, end))
        else:
            self._host[phase] += time.perf_counter() - begin

    def totals(self) -> dict[str, float]:
        """Seconds per phase (synchronizes once on GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            for phase, spans in self._spans.items():
                self._host[phase] += sum(b.elapsed_time(e) for b, e in spans) / 1e3
            self._spans.clear()
        return dict(self._host)


class NullTimer:
    """A timer that records nothing: phases inside a captured CUDA graph cannot be timed apart (the graph
    replays as one unit; the device step times the replay as the phase "step_graph")."""

    def start(self, phase: str) -> None:
        pass

    def stop(self, phase: str) -> None:
        pass

    def totals(self) -> dict[str, float]:
        return {}
