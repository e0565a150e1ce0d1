"""The host side of the steps in flight: pinned readback, row epochs, and the log-probabilities of generated tokens.

The engine loop launches a step before it reads the previous one back, so two steps' outputs are staged at once
(two pinned buffers, written by non-blocking copies, each with a CUDA event: reading one back is the step's one
host sync). A row may change hands between a step's launch and its readback (released, then admitted to another
request); each row's epoch, bumped whenever it changes hands and recorded per staged step, keeps such a step's
tokens from reaching the new request. A row's first token (chosen on the device by its prefill) is not read back
by the prefill: it rides on the row's next step (`fresh`), so completing a prefill needs no host sync.

Log-probabilities (dustin/engine/logprobs.py): a step computes them, for every row, only while some row asks
(`logprob_rows`); they are staged beside the tokens, and returned for the rows that asked. A row's first token's
come from its prefill's logits, kept on the device (`first_lp`) until that step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dustin.engine.logprobs import token_logprobs
from dustin.engine.request import MAX_LOGPROBS
from dustin.engine.worker.batch import BatchState


@dataclass
class RowTokens:
    """What one step gave a row: the first token (chosen by the row's prefill, read back with its first step) or
    None, then the accepted drafts and the next token; with the row's log-probabilities when it asked for them:
    (values [1 + N], token ids [N]) per token, the first token's first."""

    row: int
    first: int | None
    tokens: list[int]
    logprobs: list[tuple[list[float], list[int]]] | None = None


class Staging:
    """Two staging slots of step outputs, the rows' epochs and first-token flags, and the log-probability rows."""

    def __init__(self, batch: BatchState) -> None:
        self.batch = batch
        B, self.device = batch.B, batch.device
        self.pinned = self.device.type == "cuda"
        self._out = [torch.zeros(B, 3 + batch.gamma, dtype=torch.long, pin_memory=self.pinned) for _ in range(2)]
        self._gamma = [0, 0]  # the G of the step staged in each slot
        self._ready = [torch.cuda.Event() if self.pinned else None for _ in range(2)]
        self._live: list[list[tuple[int, int, bool]]] = [[], []]  # (row, epoch, fresh) each staged step ran for
        self._lp: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]  # host, per staged step
        self._lp_staged = [False, False]
        self._slot = 0
        self.unread = 0  # steps launched and not yet read back
        self.epoch = [0] * B
        self.fresh = [False] * B  # the row's first token is still to be read back
        self.logprob_rows: dict[int, int] = {}  # rows that asked for generated tokens' log-probabilities: top-N
        self.first_lp: tuple[torch.Tensor, torch.Tensor] | None = None  # each row's first token's, on the device

    def new_owner(self, row: int, logprobs: int | None = None) -> None:
        """The row changed hands (admitted or released): steps launched before are not booked to it any more."""
        self.epoch[row] += 1
        self.fresh[row] = False
        self.logprob_rows.pop(row, None)
        if logprobs is not None:
            assert 0 <= logprobs <= MAX_LOGPROBS, logprobs
            self.logprob_rows[row] = logprobs
            if self.first_lp is None:
                self.first_lp = (torch.zeros(self.batch.B, 1 + MAX_LOGPROBS, device=self.device),
                                 torch.zeros(self.batch.B, MAX_LOGPROBS, dtype=torch.long, device=self.device))

    def first_token(self, row: int, logits: torch.Tensor | None = None) -> None:
        """The row's prefill put its first token in `pending`, chosen from `logits` [V] (None: taken from elsewhere,
        a snapshot or noise): it reaches the host with the row's next step, with its log-probabilities when the row
        asked."""
        self.fresh[row] = True
        if logits is not None and row in self.logprob_rows:
            vals, ids = token_logprobs(logits, self.batch.pending[row])
            self.first_lp[0][row].copy_(vals)
            self.first_lp[1][row].copy_(ids)

    @property
    def computing_logprobs(self) -> bool:
        """Whether the next step computes log-probabilities (some row asks)."""
        return bool(self.logprob_rows)

    def live_rows(self) -> list[tuple[int, int, bool]]:
        """(row, epoch, fresh) of the rows a step launched now runs for."""
        return [(b, self.epoch[b], self.fresh[b]) for b in range(self.batch.B) if not self.batch.finished[b]]

    def stage(self, out, G: int, live: list[tuple[int, int, bool]]) -> int:
        """Queue the copy of a launched step's output (`out`: [B, 3 + G], or with log-probabilities (out, values,
        ids)) to pinned host memory; the slot to `read_back` later."""
        slot, self._slot = self._slot, self._slot ^ 1
        self._lp_staged[slot] = isinstance(out, tuple)
        if self._lp_staged[slot]:
            out, vals, ids = out
            stage = self._lp[slot]
            if stage is None or stage[0].shape != vals.shape:
                self._lp[slot] = (torch.empty(vals.shape, dtype=vals.dtype, pin_memory=self.pinned),
                                  torch.empty(ids.shape, dtype=ids.dtype, pin_memory=self.pinned))
            self._lp[slot][0].copy_(vals, non_blocking=True)
            self._lp[slot][1].copy_(ids, non_blocking=True)
        self._staged(slot, G).copy_(out, non_blocking=True)
        self._gamma[slot] = G
        if self._ready[slot] is not None:
            self._ready[slot].record()
        for b, _, fresh in live:
            if fresh:
                self.fresh[b] = False  # the first token rides on this step's output
        self._live[slot] = live
        self.unread += 1
        return slot

    def _staged(self, slot: int, G: int) -> torch.Tensor:
        """The pinned buffer of a step of G drafts' output [B, 3 + G]: the front of the slot's buffer, contiguous (a
        copy from the device into a strided view of pinned memory would not be asynchronous)."""
        B = self.batch.B
        return self._out[slot].view(-1)[:B * (3 + G)].view(B, 3 + G)

    def read_back(self, slot: int) -> list[RowTokens]:
        """Wait for the step staged in `slot` (the step's one host sync); the tokens it made for the rows it was
        launched for that still hold the same sequence and still decode, booked to the batch's host state."""
        if self._ready[slot] is not None:
            self._ready[slot].synchronize()
        self.unread -= 1
        host = self._staged(slot, self._gamma[slot]).tolist()
        lp = self._lp[slot] if self._lp_staged[slot] else None
        batch, out = self.batch, []
        for b, epoch, fresh in self._live[slot]:
            if epoch != self.epoch[b] or batch.finished[b]:
                continue
            row = host[b]
            n_acc, nxt, drafts = row[0], row[1], row[3:]
            new = drafts[:n_acc] + [nxt]
            first = row[2] if fresh else None
            batch.book(b, first, new)
            logprobs = None
            if lp is not None and b in self.logprob_rows:
                vals, ids = lp[0][b].tolist(), lp[1][b].tolist()
                logprobs = list(zip(vals, ids, strict=True))[(0 if fresh else 1):1 + len(new)]
            out.append(RowTokens(b, first, new, logprobs))
        return out
