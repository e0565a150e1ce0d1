"""`--gamma auto`: each sequence's Γ for its next step, from a measured cost model and its own acceptance history.

Why per sequence: under sparse verification a row's text depends on its Γ (its drafts' lookahead chooses what the
target attends to), so a Γ chosen from the batch would make a request's text depend on what runs beside it. Here a
row's Γ is a function of the row alone: its context length and the acceptance of its own earlier steps. The step
then runs the largest Γ of its rows (dustin/engine/worker/step.py), and each row keeps to its own.

The rule. A step of Γ drafts whose drafts are each accepted with probability α (until the first rejection) makes
E(Γ, α) = 1 + α + ... + α^Γ tokens, and takes t(Γ, n) seconds at context n; the rule picks the Γ with the most
tokens per second, E / t, in [Γ_min, Γ_max] (Γ = 0: a plain decode step, one token, for methods that verify
against the whole cache). t is measured when the engine starts (`measure_step_costs`, engine/worker/costs.py:
real steps of every Γ at a short and a long context, on the engine's own batch of slots), linear in the context
between them. It is the cost
of a whole batch whose rows all look like this one: the row's share of a step.

α is estimated from the row's steps: accepted drafts over trials (each accepted draft, plus the rejection that
ended the step, if one did), each step's weight decaying by `decay` per later step, with a prior of `prior_weight`
pseudo-trials at `prior`. Steps of Γ = 0 try nothing, so the estimate drifts back to the prior and a row that
stopped speculating tries again after a while.

Determinism: a step's acceptance reaches the host one or two steps later (the engine loop runs the device a step
ahead of the host, and some policies do not), so the rule for a row's step s reads the results of its steps up to
s - 2 only, whatever has arrived: the same decisions whether the row runs alone or in a batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DELAY = 2  # a row's step s is decided from its steps < s - 1 (see the module's docstring)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step of the batch at Γ = gammas[i]: base[i] + per_token[i] * context."""

    gammas: tuple[int, ...]
    base: tuple[float, ...]
    per_token: tuple[float, ...]

    def seconds(self, gamma: int, context: int) -> float:
        i = self.gammas.index(gamma)
        return max(self.base[i] + self.per_token[i] * context, 1e-9)

    @classmethod
    def from_points(cls, points: dict[int, tuple[tuple[int, float], tuple[int, float]]]) -> "StepCosts":
        """points: Γ -> ((context, seconds), (context, seconds)) at two contexts; the line through them (slope >= 0:
        a step never gets cheaper with more context, whatever the timing noise says)."""
        gammas, base, per_token = [], [], []
        for g in sorted(points):
            (n0, t0), (n1, t1) = points[g]
            slope = max((t1 - t0) / (n1 - n0), 0.0) if n1 != n0 else 0.0
            gammas.append(g)
            per_token.append(slope)
            base.append(t0 - slope * n0)
        return cls(tuple(gammas), tuple(base), tuple(per_token))


def expected_tokens(gamma: int, alpha: float) -> float:
    """Tokens a step of Γ drafts makes when each draft is accepted with probability alpha until one is not."""
    return sum(alpha ** i for i in range(gamma + 1))


@dataclass(frozen=True)
class GammaRule:
    """The choice of a row's Γ (see the module's docstring); costs from `measure_step_costs`."""

    costs: StepCosts
    gamma_max: int
    gamma_min: int = 0
    prior: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.9

    def __post_init__(self) -> None:
        missing = [g for g in range(self.gamma_min, self.gamma_max + 1) if g not in self.costs.gammas]
        if missing:
            raise ValueError(f"the step costs lack Γ = {missing}")

    def choose(self, context: int, alpha: float) -> int:
        """The Γ with the most expected tokens per second at this context (the smallest among equals)."""
        best, best_rate = self.gamma_min, -1.0
        for g in range(self.gamma_min, self.gamma_max + 1):
            rate = expected_tokens(g, alpha) / self.costs.seconds(g, context)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = g, rate
        return best


@dataclass
class RowGamma:
    """One sequence's Γ history: the Γ of each step launched for it, the accepted drafts of each step read back,
    and the decayed acceptance counts of the steps folded in so far."""

    context: int  # its prompt's length, then + the tokens of every folded step
    launched: list[int] = field(default_factory=list)
    results: list[int] = field(default_factory=list)
    folded: int = 0
    accepted: float = 0.0
    trials: float = 0.0

    def observe(self, n_accepted: int) -> None:
        """A step read back: its accepted drafts (steps arrive in launch order)."""
        self.results.append(n_accepted)

    def alpha(self, rule: GammaRule) -> float:
        return (self.accepted + rule.prior * rule.prior_weight) / (self.trials + rule.prior_weight)

    def next_gamma(self, rule: GammaRule) -> int:
        """Γ of the next step launched for this row: fold in its steps up to DELAY before it, then choose."""
        upto = min(len(self.launched) - DELAY + 1, len(self.results))
        while self.folded < upto:
            g, n = self.launched[self.folded], self.results[self.folded]
            self.accepted *= rule.decay
            self.trials *= rule.decay
            if g > 0:
                self.accepted += n
                self.trials += n + (1 if n < g else 0)
            self.context += n + 1
            self.folded += 1
        gamma = rule.choose(self.context, self.alpha(rule))
        self.launched.append(gamma)
        return gamma
