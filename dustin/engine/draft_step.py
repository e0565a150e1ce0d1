"""The draft's part of a speculative step, as an interface: G draft tokens per row, their distributions, and the
lookahead queries the selection policy asked for.

Why an interface: the draft's Γ forwards are most of a step's time (docs/benchmarks.md), and the way to run them
fast is to change how they run (one CUDA graph per forward, one per step, one persistent kernel), not what they
compute. Every implementation takes the same inputs, fills the same `LookaheadCapture` buffers (the (layer, heads)
to record are data, not a callback into the forward) and returns the same tokens:
- `EagerDraftStep`: G forwards of the draft through its `ModelRunner` (each replayed as its own CUDA graph when the
  runner graphs and the step is not captured whole), a token chosen after each by the batch's sampling; when every
  row is greedy, each forward returns its tokens (`Transformer.forward(greedy=V)`: with the persistent layer kernel
  attached, the LM head and argmax run inside its launch).

The first forward re-reads [prev, pending] (positions L - 1 and L), which makes the draft cache right whether or
not the previous step accepted every draft; each later one reads the token just drafted. Each row's sampling
counter advances by Γ (the cache's largest) draws whatever G is, so a seeded row's draws do not depend on the G of
the rows beside it (engine/worker/step.py).
"""
from __future__ import annotations

import torch

from dustin.attention.context import LookaheadCapture, QueryObserver
from dustin.engine.model_runner import ModelRunner
from dustin.engine.sampling import RowSampling


class DraftStep:
    """G draft tokens for every row of the batch (see the module's docstring)."""

    def run(self, prev: torch.Tensor, pending: torch.Tensor, lengths: torch.Tensor, max_len: int, G: int, *,
            captures: list[LookaheadCapture], observers: list[QueryObserver], graphed: bool):
        """prev, pending [B]: each row's last cached-but-one and pending token; lengths [B] int32: the target's cache
        lengths (pending sits at lengths[b]); max_len: the host's bound on lengths + 1. Returns (drafts [B, G],
        their distributions [B, G, V] or None when every row is greedy)."""
        raise NotImplementedError


class EagerDraftStep(DraftStep):
    def __init__(self, runner: ModelRunner, sampler: RowSampling, vocab_limit: int, gamma: int,
                 sinks: int = 0, window: int = 0) -> None:
        """gamma: the largest G (each row's sampling counter advances by gamma draws a step); sinks, window: a
        streaming draft's attention (0, 0: the whole cache)."""
        self.runner, self.sampler, self.V, self.gamma = runner, sampler, vocab_limit, gamma
        self.sinks, self.window = sinks, window

    def run(self, prev, pending, lengths, max_len, G, *, captures, observers, graphed):
        observers = [*captures, *observers]  # the eager forwards honour a capture by calling it on each layer
        inp = torch.stack([prev, pending], dim=1)
        pos = lengths.long()[:, None] + torch.arange(-1, 1, device=pending.device)
        cached = lengths - 1
        tokens, probs = [], []
        greedy = self.sampler.greedy  # the same for a whole captured step (a step graph is one sampling mode's)
        for i in range(G):
            kw = dict(sinks=self.sinks, window=self.window, observers=observers, graphed=graphed)
            if greedy:  # the argmax of the same logits `choose` takes for greedy rows
                tok, p = self.runner.forward(inp, pos, cached, max_len + i + 1, greedy=self.V, **kw), None
            else:
                logits = self.runner.forward(inp, pos, cached, max_len + i + 1, float_logits=False, **kw)
                tok, p = self.sampler.choose(logits[:, -1, : self.V])
            tokens.append(tok)
            probs.append(p)
            inp, pos, cached = tok[:, None], pos[:, -1:] + 1, lengths + i + 1
        self.sampler.skip(self.gamma - G)
        drafts = torch.stack(tokens, dim=1)
        return drafts, (None if probs[0] is None else torch.stack(probs, dim=1))
