"""The engine's defaults, written once: the engine's settings (`GenerationConfig`, `LLM`, `AutoBudget`) and the
command line's flags (dustin/flags.py) take them from here, and every layer finds dustin's home folder here
(`dustin_home`: the models, the evaluation data and the draft kernel's builds). This module sits at the bottom of the
package: it imports nothing of dustin."""
from __future__ import annotations

import os
from pathlib import Path

# the decoding method when none is named (sparse verification, the engine's reason to exist)
DEFAULT_METHOD = "dustin"

# draft tokens per speculative step (Γ), and the positions a streaming draft attends (4 sinks + the most recent)
GAMMA = 4
# --gamma auto: the largest Γ a sequence may take (each picks its own per step, dustin/engine/gamma.py)
GAMMA_AUTO_MAX = 6
DRAFT_WINDOW = 512
# a streaming draft's decoder layers as one persistent kernel per forward where it runs (sm_90, the built shapes:
# dustin/kernels/draft_decoder.py); off until it is faster than the per-layer kernels on the GPU (docs/benchmarks.md)
DRAFT_KERNEL = False

# --budget auto: the attention mass to cover, the smallest and the largest k
AUTO_P, AUTO_MIN, AUTO_MAX = 0.95, 128, 2048


def dustin_home(home: str | Path | None = None) -> Path:
    """`home`, else $DUSTIN_HOME, else ~/.cache/dustin."""
    return Path(home or os.environ.get("DUSTIN_HOME") or Path.home() / ".cache" / "dustin").expanduser()
