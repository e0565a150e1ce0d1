"""Every verification policy by name: `POLICIES`, the class of each (`policy_class`) and its construction
(`make_policy`). Apart from the policies themselves so that policies built on others (the sampled-tail rows on
`DustinSelection`) and the registry import each other in one direction only."""
from __future__ import annotations

from dataclasses import replace

from dustin.selection.base import FullSelection, SelectionPolicy
from dustin.selection.config import DUSTIN_POLICIES, DUSTIN_TAIL_ROWS, ORACLE_RUNGS, ORACLE_TAIL_ROWS, SparseConfig
from dustin.selection.ladder import LadderOracle
from dustin.selection.layerwise import QuestSelection, SpecAttnSelection
from dustin.selection.policies import DustinSelection, OracleSelection, StreamingSelection
from dustin.selection.snapkv import SnapKVSelection
from dustin.selection.tail import DustinTail, LayerTailOracle

POLICIES = ("full", "streaming", *DUSTIN_POLICIES, *DUSTIN_TAIL_ROWS, "quest", "specattn", "snapkv", "oracle",
            *ORACLE_RUNGS, *ORACLE_TAIL_ROWS)


def policy_class(name: str) -> type[SelectionPolicy]:
    """The class of a verification policy by name (its class attributes say how the engine may run it:
    `row_local`, `graph_safe`)."""
    if name == "full":
        return FullSelection
    if name == "streaming":
        return StreamingSelection
    if name in DUSTIN_POLICIES or name in DUSTIN_TAIL_ROWS:
        return DustinSelection
    if name == "oracle":
        return OracleSelection
    if name in ORACLE_RUNGS:
        return LadderOracle
    if name in ORACLE_TAIL_ROWS:
        return LayerTailOracle if ORACLE_TAIL_ROWS[name].source == "layer" else DustinTail
    if name in ("quest", "specattn"):
        return QuestSelection if name == "quest" else SpecAttnSelection
    if name == "snapkv":
        return SnapKVSelection
    raise ValueError(f"unknown selection policy {name!r}; choose from {POLICIES}")


def make_policy(name: str, cfg: SparseConfig | None) -> SelectionPolicy:
    cls = policy_class(name)
    if cls is FullSelection:
        return FullSelection()
    if cfg is None:
        raise ValueError(f"policy {name!r} needs a SparseConfig")
    if name in DUSTIN_TAIL_ROWS:
        return DustinSelection(replace(cfg, tail_share=DUSTIN_TAIL_ROWS[name]), "dustin", name=name)
    if cls is DustinSelection or name in ORACLE_RUNGS or name in ORACLE_TAIL_ROWS:
        return cls(cfg, name)
    return cls(cfg)
