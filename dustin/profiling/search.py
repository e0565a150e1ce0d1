"""Algorithm 1 (paper Sec. 4.2.2): the sparse-estimation configuration, chosen by ARR on stored traces.

    Phase 1  the one target layer whose S_target (its SRHs, history query) gives the best ARR with m = 0;
    Phase 2  draft layers added greedily: each candidate scored by the mean ARR over the search draft
             budgets m in SEARCH_M (at the deployment budget k), stopping when the best addition no longer
             improves that mean;
    Phase 3  Optuna (TPE, seeded) on m in [0, k - sinks - window] for the chosen layers.

The objective is the windowed ARR (Eq. 2) over the SRHs: the share of Ā = Σ_{SRH heads, target layers,
first w = 4 verify queries} attention that the set selected by Eq. 6 (`select_dustin`, the engine's own
selection) keeps, averaged over the validation steps. Sets are the engine's exactly: sinks and window
protected, top-m by S_draft, the rest by S_target. Everything runs on the stored rows: no model is loaded.
"""
from __future__ import annotations

import time

import torch

from dustin.eval.arr import recovery
from dustin.kernels.selection import select_dustin, select_streaming
from dustin.selection.oracle import oracle_set, topk_set

SEARCH_M = (128, 192, 256)
# Phase 2 stops when the best draft layer adds less ARR than this. Each added layer costs one read of that layer's
# keys per step (estimation time), so raise it (--min-gain) for a leaner config: on the default pair the first 3
# layers gave 0.692 and the next 8 only +0.006; --min-gain 0.003 stops after those 3 (docs/profiling.md, "A cheaper
# S_draft"; `draft_layer_curve` shows what each layer buys).
MIN_GAIN = 1e-4


class ARRObjective:
    """ARR of configurations on a trace set (see `trace.load_traces`), all steps at once."""

    def __init__(self, traces: dict[str, torch.Tensor], sinks: int = 4, window: int = 16) -> None:
        self.t = traces
        self.L = traces["lengths"].long()
        self.oracle = traces["oracle"].float().sum(1)  # Ā over the SRHs of every target layer
        self.oracle_all = traces["oracle_all"].float()
        self.sinks, self.window = sinks, window
        self.n_target, self.n_draft = traces["hist"].shape[1], traces["draft"].shape[1]

    def rows(self, name: str, layers) -> torch.Tensor:
        if not layers:
            return torch.zeros_like(self.oracle)
        return self.t[name][:, list(layers)].float().sum(1)

    def select(self, t_layers, d_layers, k: int, m: int):
        # the torch path: the same sets as the engine's kernels (tests/selection/test_selection.py), without compiling a
        # kernel for every (k, m) that phases 2-3 try
        return select_dustin(self.rows("hist", t_layers), self.rows("draft", d_layers), self.L, k=k, m=m,
                             sinks=self.sinks, window=self.window, impl="torch")

    def arr(self, t_layers, d_layers, k: int, m: int, oracle: torch.Tensor | None = None) -> float:
        idx, counts = self.select(t_layers, d_layers, k, m)
        return float(recovery(self.oracle if oracle is None else oracle, idx, counts).mean())

    def arr_topk(self, scores: torch.Tensor, k: int, oracle: torch.Tensor | None = None) -> float:
        """ARR of the plain top-k of a score row (Figs. 2-3; with scores = Ā itself, Eq. 3's oracle)."""
        idx, counts = topk_set(scores, self.L, k)
        return float(recovery(self.oracle if oracle is None else oracle, idx, counts).mean())


def search(obj: ARRObjective, budget: int = 512, search_m=SEARCH_M, optuna_trials: int = 40, seed: int = 0,
           progress=None, min_gain: float = MIN_GAIN) -> dict:
    """Run Algorithm 1; returns the chosen layers, m, the ARR after each phase and each phase's seconds."""
    free = budget - obj.sinks - obj.window
    ms = [m for m in search_m if m <= free] or [free // 2]
    log: dict = {"budget": budget, "search_m": ms, "phases": {}}
    task = progress.add_task("Algorithm 1", total=obj.n_target + obj.n_draft * 2 + optuna_trials) \
        if progress else None
    tick = (lambda n=1: progress.advance(task, n)) if progress else (lambda n=1: None)

    t0 = time.perf_counter()
    phase1 = {}
    for layer in range(obj.n_target):
        phase1[layer] = obj.arr([layer], [], budget, 0)
        tick()
    best_t = max(phase1, key=lambda layer: (phase1[layer], -layer))
    log["phases"]["1"] = {"target_layer": best_t, "arr": phase1[best_t], "arr_by_layer": phase1,
                          "seconds": time.perf_counter() - t0}

    t0 = time.perf_counter()
    chosen: list[int] = []
    current = phase1[best_t]
    rounds = []
    while len(chosen) < obj.n_draft:
        cand = {d: sum(obj.arr([best_t], chosen + [d], budget, m) for m in ms) / len(ms)
                for d in range(obj.n_draft) if d not in chosen}
        tick(len(cand) if len(chosen) < 2 else 0)
        d_best = max(cand, key=lambda d: (cand[d], -d))
        rounds.append({"added": d_best, "arr": cand[d_best], "candidates": cand})
        if cand[d_best] < current + min_gain:
            rounds[-1]["added"] = None  # no candidate improved: stop
            break
        chosen.append(d_best)
        current = cand[d_best]
    log["phases"]["2"] = {"draft_layers": sorted(chosen), "arr": current, "rounds": rounds,
                          "seconds": time.perf_counter() - t0}

    t0 = time.perf_counter()
    best_m, best_arr = _tune_m(obj, best_t, chosen, budget, free, optuna_trials, seed, tick, ms)
    log["phases"]["3"] = {"draft_topm": best_m, "arr": best_arr, "trials": optuna_trials,
                          "seconds": time.perf_counter() - t0}
    log["target_layer"], log["draft_layers"], log["draft_topm"] = best_t, sorted(chosen), best_m
    return log


def _tune_m(obj, t_layer, d_layers, budget, free, trials, seed, tick, start=()) -> tuple[int, float]:
    if not d_layers:  # no draft layer helped: target history alone (m = 0)
        return 0, obj.arr([t_layer], [], budget, 0)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    for m in start:  # phase 2's m values first: phase 3 never ends below the best of them (or their mean)
        study.enqueue_trial({"m": int(m)})

    def objective(trial):
        value = obj.arr([t_layer], d_layers, budget, trial.suggest_int("m", 0, free))
        tick()
        return value

    study.optimize(objective, n_trials=trials)
    return int(study.best_params["m"]), float(study.best_value)


def draft_layer_curve(val: ARRObjective, held: ARRObjective | None, t_layer: int, order, budget: int = 512,
                      search_m=SEARCH_M, optuna_trials: int = 40, seed: int = 0, budgets=(128, 256, 512)) -> list[dict]:
    """What each draft layer buys, for choosing phase 2's stopping point: for n = 0 .. len(order), the config of
    target layer t_layer and the first n draft layers of `order` (phase 2's order of addition), with m tuned by
    phase 3 on `val` (the same trials and seed as `search`, so row n is the config a search stopped after n
    layers would write). Each row: its phase-2 objective (mean ARR over search_m at k = budget) and its ARR at
    each k in budgets (m scaled with k as `SparseConfig.with_budget` does), on `val` and on `held` if given."""
    free = budget - val.sinks - val.window
    ms = [m for m in search_m if m <= free] or [free // 2]
    rows = []
    for n in range(len(order) + 1):
        layers = list(order[:n])
        m = _tune_m(val, t_layer, layers, budget, free, optuna_trials, seed, lambda n=1: None, ms)[0]
        row: dict = {"n": n, "draft_layers": layers, "draft_topm": m}
        for split, obj in (("validation", val), ("heldout", held)):
            if obj is None:
                continue
            row[split] = {"objective": sum(obj.arr([t_layer], layers, budget, x) for x in ms) / len(ms) if n else
                          obj.arr([t_layer], [], budget, 0),
                          "arr": {str(k): obj.arr([t_layer], layers, k, round(m / free * (k - obj.sinks - obj.window)))
                                  for k in budgets}}
        rows.append(row)
    return rows


def evaluate(obj: ARRObjective, t_layers, d_layers, m_share: float, budgets=(128, 256, 512)) -> dict:
    """ARR (over the SRHs and over all heads) of each policy's set per budget k, on one trace set."""
    table = {}
    for k in budgets:
        free = k - obj.sinks - obj.window
        m = round(m_share * free)
        row = {}
        for oracle_name, oracle in (("srh", obj.oracle), ("all_heads", obj.oracle_all)):
            row[oracle_name] = {
                "oracle-topk": obj.arr_topk(oracle, k, oracle),
                "oracle": _arr_oracle_method(obj, oracle, k),
                "dustin": obj.arr(t_layers, d_layers, k, m, oracle),
                "dustin-t": obj.arr(t_layers, [], k, 0, oracle),
                "dustin-d": obj.arr([], d_layers, k, free, oracle) if d_layers else None,
                "streaming": _arr_streaming(obj, k, oracle),
            }
        table[str(k)] = row
    return table


def _arr_oracle_method(obj, oracle, k) -> float:
    idx, counts = oracle_set(oracle, obj.L, k, obj.sinks, obj.window)
    return float(recovery(oracle, idx, counts).mean())


def _arr_streaming(obj, k, oracle) -> float:
    idx, counts = select_streaming(obj.L, k, obj.sinks)
    return float(recovery(oracle, idx, counts).mean())
