"""Log-probabilities of chosen tokens and the most likely ones, computed on the device.

They are of the raw distribution: the log-softmax of the target's logits, before temperature, top-k and top-p (as
vLLM's default). Generated tokens' come from the forward that chose them (the verify forward at each accepted
position; the prefill's last position for a row's first token); prompt tokens' from the dense prefill, whose LM
head runs over the prompt in pieces of `PROMPT_ROWS` positions (16k positions x 152k vocabulary would be 9.7 GB
of fp32 logits at once).
"""
from __future__ import annotations

import torch

from dustin.engine.request import MAX_LOGPROBS, Logprob

PROMPT_ROWS = 512  # prompt positions per LM-head piece (~0.3 GB of fp32 logits at a 152k vocabulary)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int = MAX_LOGPROBS
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] (any float dtype), chosen [...] token ids -> (values [..., 1 + k] fp32: the chosen token's
    log-probability, then the k largest; ids [..., k] long: their tokens, most likely first). No host sync: a
    CUDA graph may capture it."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    picked = x.gather(-1, chosen[..., None]) - lse
    if k == 0:
        return picked, torch.zeros(*chosen.shape, 0, dtype=torch.long, device=x.device)
    top, ids = x.topk(k, dim=-1)
    return torch.cat([picked, top - lse], dim=-1), ids


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, k: int, vocab: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` of `targets` [P] under the logits `head(hidden)` ([P, dim] -> [P, >= vocab]), taken
    `PROMPT_ROWS` rows at a time so that only that many rows of logits exist at once."""
    vals, ids = [], []
    for i in range(0, hidden.shape[0], PROMPT_ROWS):
        v, t = token_logprobs(head(hidden[i:i + PROMPT_ROWS])[:, :vocab], targets[i:i + PROMPT_ROWS], k)
        vals.append(v)
        ids.append(t)
    return torch.cat(vals), torch.cat(ids)


def to_logprob(values: list[float], ids: list[int], k: int) -> Logprob:
    """One position's host row of `token_logprobs` as a Logprob of its k most likely tokens."""
    return Logprob(values[0], tuple(zip(ids[:k], values[1:1 + k], strict=True)))


class HostLogprobs:
    """Rows of `token_logprobs` copied to the host without waiting (pinned memory on a GPU): read them only after
    the device passed the copy (for the engine: once a later step was read back)."""

    def __init__(self) -> None:
        self.pieces: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._rows: list[Logprob] | None = None

    def add(self, values: torch.Tensor, ids: torch.Tensor, k: int) -> None:
        pinned = values.device.type == "cuda"
        hv = torch.empty(values.shape, dtype=values.dtype, pin_memory=pinned)
        hi = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pinned)
        hv.copy_(values, non_blocking=True)
        hi.copy_(ids, non_blocking=True)
        self.pieces.append((hv, hi, k))

    def rows(self) -> list[Logprob]:
        if self._rows is None:
            self._rows = [to_logprob(v, i, k) for hv, hi, k in self.pieces
                          for v, i in zip(hv.tolist(), hi.tolist(), strict=True)]
            self.pieces = []
        return self._rows
