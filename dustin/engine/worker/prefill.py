"""Prompts into the caches: chunked prefill, a gang's prefill, the prefix copy of n sequences of one prompt, prompt
log-probabilities, and the draft's catch-up after plain steps.

- `prefill`: the next chunks of admitted rows, all in ONE packed forward of the target and one of the draft
  (dustin/kernels/prefill_attention.py: each chunk attends over its row's cached prefix), padded to a fixed size so
  the forward's shape does not depend on what is packed. A chunk that completes its prompt chooses the row's first
  token on the device and makes the row decode; the token reaches the host with the row's next step.
- `prefill_gang`: every admitted row's whole prompt, one sequence at a time with the policy's target observers
  watching (policies with whole-batch state build it here), for a gang admission (`Scheduler`). Its parts
  (`begin_gang`, `prefill_rows`, `observe_last_tokens`, `activate_gang`) are public so that an offline batch can
  fill the prompt caches another way (dustin/engine/offline/prefill.py).
- prefix copy: a row admitted with `prefix_from` waits for that row's prefill, then takes a copy of its cache of
  all prompt tokens but the last and prefills only that one itself (its numbers are those of its own whole
  prefill: K/V do not depend on how a prompt is cut into chunks).
- catch-up: a row at Γ = 0 takes steps without a draft forward, so its draft cache falls behind; before it drafts
  again its missing positions are written in one draft-only prefill of its own shapes.
"""
from __future__ import annotations

import torch

from dustin.engine.kv_manager import KVManager
from dustin.engine.logprobs import HostLogprobs, head_logprobs
from dustin.engine.model_runner import ModelRunner
from dustin.engine.request import Logprob
from dustin.engine.worker.batch import BatchState
from dustin.engine.worker.staging import Staging
from dustin.selection.base import SelectionPolicy


class Prefill:
    """The prefill work of one batch (see the module's docstring)."""

    def __init__(self, batch: BatchState, staging: Staging, policy: SelectionPolicy, models: dict[str, ModelRunner],
                 kv: KVManager) -> None:
        self.batch, self.staging, self.policy, self.models, self.kv = batch, staging, policy, models, kv
        self.prompt_logprob_rows: dict[int, int] = {}  # rows that asked for prompt log-probabilities: top-N
        self._prompt_lp: dict[int, HostLogprobs] = {}
        self._prefix_wait: dict[int, list[int]] = {}  # row -> rows waiting to copy its prompt cache

    # ---------------------------------------------------------------- rows joining and leaving
    def admit(self, row: int, prompt: list[int], prompt_logprobs: int | None, prefix_from: int | None) -> None:
        assert prefix_from is None or self.batch.prompt_rows.get(prefix_from) == list(prompt), prefix_from
        self.prompt_logprob_rows.pop(row, None)
        self._prompt_lp.pop(row, None)
        if prompt_logprobs is not None:
            self.prompt_logprob_rows[row] = prompt_logprobs
            self._prompt_lp[row] = HostLogprobs()
        if prefix_from is not None:
            self._prefix_wait.setdefault(prefix_from, []).append(row)

    def release(self, row: int) -> None:
        """A row released before its prefill completed leaves the rows waiting for its prompt cache to prefill the
        whole prompt themselves (their prefilled count is still 0); a waiting row stops waiting."""
        self.prompt_logprob_rows.pop(row, None)
        self._prompt_lp.pop(row, None)
        self._prefix_wait.pop(row, None)
        for waiting in self._prefix_wait.values():
            if row in waiting:
                waiting.remove(row)

    def prompt_logprobs(self, row: int) -> list[Logprob | None] | None:
        """The prompt log-probabilities of the row's sequence (None for its first token), once its first token was
        read back (the device passed the prefill by then); None when it did not ask for them."""
        host = self._prompt_lp.get(row)
        return None if host is None else [None, *host.rows()]

    def _activate(self, row: int, logits: torch.Tensor | None = None) -> None:
        """The row's prompt is cached and its first token in `pending` (chosen from `logits` when given)."""
        self.staging.first_token(row, logits)
        self.prompt_logprob_rows.pop(row, None)
        self.batch.activate(row)

    # ---------------------------------------------------------------- chunked
    @torch.inference_mode()
    def prefill(self, pieces: list[tuple[int, int]], pad_to: int = 0) -> None:
        """Prefill the next `n` prompt tokens of each admitted row in `pieces` [(row, n)] in one packed forward per
        model, padded to `pad_to` tokens. A row may appear twice (consecutive chunks)."""
        b = self.batch
        chunks, done_rows = [], []
        for row, n in pieces:
            prompt, n0 = b.prompt_rows[row], b.prefilled[row]
            n1 = n0 + n
            assert 1 <= n and n1 <= len(prompt), (row, n0, n, len(prompt))
            chunks.append((row, n0, prompt[n0:n1]))
            b.prefilled[row] = n1
            if n1 == len(prompt):
                done_rows.append((len(chunks) - 1, row))
        observers = self.policy.target_observers(b) if done_rows else []
        at, targets, owners = self._prompt_logprob_positions(chunks)
        out = self.models["target"].prefill_packed(chunks, pad_to, b.B, observers, hidden_at=at)
        if at:
            logits, hidden, head = out
            k = max(k for _, _, k in owners)
            tgt = torch.tensor(targets, dtype=torch.long).to(b.device)
            vals, ids = head_logprobs(head, hidden, tgt, k, b.V)
            i = 0
            for row, n, k_row in owners:
                self._prompt_lp[row].add(vals[i:i + n], ids[i:i + n], k_row)
                i += n
        else:
            logits = out
        logits = logits[:, : b.V]
        if "draft" in self.models:
            self.models["draft"].prefill_packed(chunks, pad_to, b.B)
        for row, _, _ in chunks:
            if row in b.prompt_rows and b.prefilled[row] < len(b.prompt_rows[row]):
                b.set_cached(row, b.prefilled[row])
        for i, row in done_rows:
            n = len(b.prompt_rows[row])
            b.reseed(row)
            b.pending[row:row + 1].copy_(b.sampler.choose_row(row, logits[i:i + 1]))
            self._activate(row, logits[i])
            for other in self._prefix_wait.pop(row, ()):
                self._copy_prefix(row, other, n - 1)

    def _prompt_logprob_positions(self, chunks: list[tuple[int, int, list[int]]]):
        """The packed-token indices whose logits give prompt log-probabilities in this forward (each position of a
        row that asked, but its prompt's last: that one's is its first generated token's), the prompt tokens they
        predict, and (row, positions, top-N) per chunk that has any."""
        at, targets, owners = [], [], []
        offset = 0
        for row, n0, toks in chunks:
            k = self.prompt_logprob_rows.get(row)
            if k is not None:
                prompt = self.batch.prompt_rows[row]
                stop = min(n0 + len(toks), len(prompt) - 1)
                if stop > n0:
                    at += range(offset, offset + stop - n0)
                    targets += prompt[n0 + 1:stop + 1]
                    owners.append((row, stop - n0, k))
            offset += len(toks)
        return at, targets, owners

    def _copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row `dst` (admitted with `prefix_from=src`) takes `src`'s cache of its first n prompt tokens and prefills
        the rest itself; the prompt's log-probabilities are `src`'s too."""
        self.kv.copy_prefix(src, dst, n)
        self.batch.set_cached(dst, n)
        if dst in self._prompt_lp and src in self._prompt_lp:
            self._prompt_lp[dst] = self._prompt_lp[src]
        self.prompt_logprob_rows.pop(dst, None)

    # ---------------------------------------------------------------- a gang
    def begin_gang(self) -> list[int]:
        """Start a gang's prefill: its rows (every admitted row; none prefilled by a chunk yet), the policy's
        whole-batch state started over, and seeded rows' draws set to start at their first token."""
        b = self.batch
        rows = sorted(b.prompt_rows)
        assert rows and not any(b.prefilled[r] for r in rows), "a gang wants admitted rows that no chunk prefilled"
        self.policy.begin_gang(b)
        for row in rows:
            b.reseed(row)
        return rows

    @torch.inference_mode()
    def prefill_rows(self, rows: list[int], target: bool = True, draft: bool = True) -> None:
        """Each row's whole prompt through the target (choosing its first token, the policy's target observers
        watching) and the draft, one sequence at a time: a packed prefill of one whole-prompt chunk."""
        b = self.batch
        for row in rows:
            chunk = [(row, 0, b.prompt_rows[row])]
            if target:
                logits = self.models["target"].prefill_packed(chunk, 0, 1, self.policy.target_observers(b))
                logits = logits[:, : b.V]
                b.pending[row:row + 1].copy_(b.sampler.choose_row(row, logits))
                self.staging.first_token(row, logits[0])
            if draft and "draft" in self.models:
                self.models["draft"].prefill_packed(chunk, 0, 1)

    @torch.inference_mode()
    def observe_last_tokens(self, rows: list[int]) -> None:
        """The policy's target observers see each row's last prompt token's query again (prompt caches copied in
        from elsewhere: a policy that `observes_prefill` builds its first step's state from it)."""
        b = self.batch
        prompts = [b.prompt_rows[r] for r in rows]
        last = torch.tensor([[p[-1]] for p in prompts], device=b.device)
        L = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int32, device=b.device)
        self.models["target"].forward(last, L.long()[:, None], L, max(len(p) for p in prompts), float_logits=False,
                                      observers=self.policy.target_observers(b))
        self.policy.after_verify(b, torch.zeros(b.B, dtype=torch.long, device=b.device))

    def activate_gang(self, rows: list[int]) -> None:
        """The gang's rows decode from the next step (prompt caches and first tokens in place)."""
        for row in rows:
            self._activate(row)

    def prefill_gang(self) -> None:
        """A gang's prefill, computed (see the module's docstring)."""
        rows = self.begin_gang()
        self.prefill_rows(rows)
        self.activate_gang(rows)

    # ---------------------------------------------------------------- the draft's catch-up
    def catch_up_draft(self, rows: list[int]) -> None:
        """Write the draft cache positions of `rows`' plain steps, a draft-only prefill per row (its shapes the
        row's own, so its numbers do not depend on the other rows): a row that ran g plain steps lacks positions
        L - 1 - g .. L - 2 (the step re-reads L - 1 and L, [prev, pending], itself). Needs every launched step read
        back: it feeds the tokens those steps chose."""
        b = self.batch
        assert not self.staging.unread, "the draft's catch-up needs every launched step read back first"
        b.timer.start("draft")
        for row in rows:
            L, g = b.host_lengths[row], b.draft_lag[row]
            assert len(b.tokens[row]) == L + 1, (row, len(b.tokens[row]), L)
            self.models["draft"].prefill_packed([(row, L - 1 - g, b.tokens[row][L - 1 - g:L - 1])], 0, 1)
            b.draft_lag[row] = 0
        b.timer.stop("draft")
