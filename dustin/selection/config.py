"""Sparse-verification configuration: which heads score positions, and how the budget k is split (Eq. 6).

A small JSON file, e.g. configs/qwen2.5-coder-1.5b+0.5b.json:
    {"target": [{"layer": 20, "heads": [3, 9]}],
     "draft":  [{"layer": 6, "heads": [0, 5]}, {"layer": 12, "heads": [2, 11]}],
     "budget": 512, "draft_topm": 128, "sinks": 4, "window": 16}
`target` heads score S_target (the last accepted token's query); `draft` heads score S_draft (the draft's Γ
lookahead queries). Heads are query-head indices. The profiling tools write tuned files in this format.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dustin.defaults import AUTO_MAX, AUTO_MIN, AUTO_P
from dustin.errors import InputError
from dustin.models.args import ModelArgs


@dataclass(frozen=True)
class ScoreHeads:
    layer: int
    heads: tuple[int, ...]


@dataclass(frozen=True)
class SparseConfig:
    target: tuple[ScoreHeads, ...] = ()
    draft: tuple[ScoreHeads, ...] = ()
    budget: int = 512  # k: positions read per sequence while verifying (protected ones included)
    draft_topm: int = 128  # m: positions filled from S_draft before S_target fills the rest
    sinks: int = 4
    window: int = 16
    # the sampled tail's share of k (selection/tail.py `stratified_tail`): round(tail_share * k) of the k positions
    # are drawn per layer and KV head from outside the exact set and reweighted, the other k - that are Eq. 6's
    # exact set (its draft_topm scaled as `with_budget` scales it); 0: no tail, k exact positions
    tail_share: float = 0.0
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.budget < self.sinks + self.window + 1:
            raise InputError(f"--budget {self.budget} must exceed sinks + window = {self.sinks + self.window}")
        if not 0 <= self.draft_topm <= self.budget - self.sinks - self.window:
            raise InputError(f"draft_topm (m = {self.draft_topm}) must be in [0, budget - sinks - window = "
                             f"{self.budget - self.sinks - self.window}]")
        if not 0.0 <= self.tail_share < 1.0:
            raise InputError(f"tail_share must be in [0, 1), got {self.tail_share}")
        self.tail_split()

    def tail_split(self) -> tuple[int, int]:
        """(exact positions, sampled positions) of the budget: k - m and m = round(tail_share * k); one InputError
        line when the exact set would not hold the sinks, the window and one more."""
        m = round(self.tail_share * self.budget)
        if m and self.budget - m < self.sinks + self.window + 1:
            raise InputError(f"--budget {self.budget} with a {self.tail_share:.0%} tail leaves {self.budget - m} exact "
                             f"positions: they must exceed sinks + window = {self.sinks + self.window}; raise --budget "
                             f"or lower tail_share")
        return self.budget - m, m

    def exact_part(self) -> "SparseConfig":
        """The config of the tail's exact set: k - m positions, no tail (itself when there is no tail)."""
        exact, m = self.tail_split()
        return replace(self, tail_share=0.0).with_budget(exact) if m else self

    @property
    def free_budget(self) -> int:
        return self.budget - self.sinks - self.window

    def with_budget(self, budget: int) -> "SparseConfig":
        """Change k keeping m's share of the unprotected budget (m scales with k - sinks - window)."""
        free = budget - self.sinks - self.window
        m = max(0, min(free, round(self.draft_topm / max(self.free_budget, 1) * free)))
        return replace(self, budget=budget, draft_topm=m)

    def validate_for(self, target: ModelArgs, draft: ModelArgs | None) -> None:
        for role, items, args in (("target", self.target, target), ("draft", self.draft, draft)):
            if args is None:
                continue
            for sh in items:
                if not 0 <= sh.layer < args.n_layers:
                    raise InputError(f"{self.source or 'config'}: {role} layer {sh.layer} out of range "
                                     f"(model has {args.n_layers} layers)")
                bad = [h for h in sh.heads if not 0 <= h < args.n_heads]
                if bad or not sh.heads:
                    raise InputError(f"{self.source or 'config'}: {role} layer {sh.layer} heads {list(sh.heads)} "
                                     f"invalid (model has {args.n_heads} query heads)")

    @classmethod
    def load(cls, path: str | Path) -> "SparseConfig":
        path = Path(path)
        if not path.is_file():
            raise InputError(f"sparse config {path} {'is a directory' if path.is_dir() else 'does not exist'}")
        try:
            raw = json.loads(path.read_text())
            heads = {role: tuple(ScoreHeads(int(e["layer"]), tuple(int(h) for h in e["heads"]))
                                 for e in raw.get(role, [])) for role in ("target", "draft")}
            scalars = {k: int(raw[k]) for k in ("budget", "draft_topm", "sinks", "window") if k in raw}
            if "tail_share" in raw:
                scalars["tail_share"] = float(raw["tail_share"])
        except OSError as e:
            raise InputError(f"sparse config {path} cannot be read: {e.strerror or e}") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise InputError(f"sparse config {path} is malformed ({e})") from None
        return cls(**heads, **scalars, source=str(path))

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("source")
        return d


BUILTIN = "builtin"  # --config builtin: the hand-written fallback below, even when a tuned file exists


def default_config(target: ModelArgs, draft: ModelArgs | None) -> SparseConfig:
    """A hand-written fallback when no tuned file exists: a deep target layer and three draft layers,
    2 heads each (the profiling issue replaces this with heads found by Algorithm 1)."""
    t_layer = (2 * target.n_layers) // 3
    tgt = (ScoreHeads(t_layer, (0, target.n_heads // 2)),)
    drf: tuple[ScoreHeads, ...] = ()
    if draft is not None:
        layers = sorted({draft.n_layers // 4, draft.n_layers // 2, (3 * draft.n_layers) // 4})
        drf = tuple(ScoreHeads(layer, (0, draft.n_heads // 2)) for layer in layers)
    return SparseConfig(target=tgt, draft=drf, source="built-in default")


@dataclass(frozen=True)
class AutoBudget:
    """`--budget auto`'s settings (the rule is dustin/selection/adaptive.py): target mass p and the range of k.
    Plain data, so the engine's config checks it while the flags are parsed, without torch."""

    p: float = AUTO_P
    k_min: int = AUTO_MIN
    k_max: int = AUTO_MAX
    dense: bool = False  # rows that k_max positions cannot serve verify against the whole cache

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise InputError(f"--budget-p must be in (0, 1], got {self.p}")
        if not 21 <= self.k_min <= self.k_max:
            raise InputError(f"--budget auto needs 21 <= --budget-min ({self.k_min}) <= --budget-max ({self.k_max})")


# Dustin's hybrid selection (selection/policies.py DustinSelection): both estimators, the target's only, the
# draft's only; the policies that can size k themselves (--budget auto)
DUSTIN_POLICIES = ("dustin", "dustin-t", "dustin-d")

# The oracle ladder (selection/ladder.py): one exact oracle per granularity, the first N layers optionally dense
ORACLE_GRANULARITIES = ("layer", "kv", "head")
ORACLE_DENSE_LAYERS = (0, 1, 2)
ORACLE_RUNGS: dict[str, tuple[str, int]] = {
    f"oracle-{g}" + (f"-d{n}" if n else ""): (g, n) for g in ORACLE_GRANULARITIES for n in ORACLE_DENSE_LAYERS}


def oracle_rung(name: str) -> tuple[str, int]:
    """(granularity, leading dense layers) of a ladder method name such as oracle-kv-d1."""
    return ORACLE_RUNGS[name]


@dataclass(frozen=True)
class TailRow:
    """A sampled-tail row (selection/tail.py): an exact set S plus m positions drawn uniformly from the rest R of
    the row's context, each weighted |R| / m. source: where S comes from ("layer": the ladder's rung (b), the exact
    per-layer set; "dustin": dustin's own selection); share: the tail's part of the budget (m = share * k, |S| =
    k - m); weighted False: the tail taken with weight 1 (the control that shows what the weight does); adaptive:
    m per row, layer and KV head from an (ε, δ) bound on the estimate's error, at most share * k."""

    source: str
    share: float
    weighted: bool = True
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.source not in TAIL_SOURCES:
            raise InputError(f"tail source {self.source!r} must be one of {', '.join(TAIL_SOURCES)}")
        if not 0.0 < self.share < 1.0:
            raise InputError(f"the tail's share of the budget must be in (0, 1), got {self.share}")

    def split(self, budget: int, min_exact: int) -> tuple[int, int]:
        """(|S|, m) of a budget k: m = round(share * k) >= 1 sampled, the rest exact, at least `min_exact` (the
        sinks, the recent window and one more)."""
        m = round(self.share * budget)
        if m < 1 or budget - m < min_exact:
            raise InputError(f"--budget {budget} with a {self.share:.0%} tail leaves {budget - m} exact positions "
                             f"and {m} sampled: the exact set needs >= {min_exact} (sinks + window + 1) and the tail "
                             f">= 1; raise --budget")
        return budget - m, m


# The sampled-tail rows: oracle-{source}-tail[75][-w1|-auto]. No number: the even split (half the budget sampled);
# 75: the tail-heavy one. -w1: not reweighted; -auto: m from (ε, δ) under the split's m as a cap.
TAIL_SOURCES = ("layer", "dustin")
TAIL_SHARES = {"": 0.5, "75": 0.75}
_TAIL_VARIANTS = {"": {}, "-w1": {"weighted": False}, "-auto": {"adaptive": True}}
ORACLE_TAIL_ROWS: dict[str, TailRow] = {
    f"oracle-{src}-tail{suffix}{variant}": TailRow(src, share, **kw)
    for src in TAIL_SOURCES for suffix, share in TAIL_SHARES.items() for variant, kw in _TAIL_VARIANTS.items()}
# The engine's own tail (`--method dustin` with tail_share: dustin's exact set plus a stratified sample per layer
# and KV head, selection/stratified.py) at the rows' shares, as named rows for sweeps that compare it with the
# others in one run: dustin-tail is `--method dustin --tail-share 0.5`, dustin-tail75 the same at 0.75
DUSTIN_TAIL_ROWS: dict[str, float] = {f"dustin-tail{suffix}": share for suffix, share in TAIL_SHARES.items()}
