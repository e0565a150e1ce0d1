"""Incremental detokenization with stop strings, for streamed and non-streamed completions.

Each time new tokens arrive the whole completion is decoded again and the new suffix is emitted (a token may
change how the text before it decodes, e.g. a multi-byte character split over two tokens, so decoding token by
token would be wrong). Text that could still become a stop string is held back until it either completes the stop
string (generation ends there; the stop string and everything after it are dropped) or stops matching. A trailing
U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stops: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in (stops or []) if s]
        self._max_stop = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string was found: nothing more will be emitted
        # ids[:_offset] decode to _settled on their own, and the whole text is _settled + decode(ids[_offset:]):
        # each call decodes a short tail instead of the whole completion (which made a 512-token stream cost
        # 512 decodes of up to 512 tokens, on the server's event loop)
        self._offset = 0
        self._settled = ""

    _TAIL = 8  # tokens kept in the decoded tail (a character or a merge may span a few tokens)

    def _decode(self) -> str:
        if self.tokenizer is None:
            return ""
        dec = self.tokenizer.decode
        tail = dec(self.ids[self._offset:], skip_special_tokens=True)
        cut = len(self.ids) - self._TAIL
        if cut - self._offset >= 2 * self._TAIL:  # try to settle ids[_offset:cut]
            head = dec(self.ids[self._offset:cut], skip_special_tokens=True)
            rest = dec(self.ids[cut:], skip_special_tokens=True)
            # only where decoding splits there exactly (not inside a character or a merge)
            if head + rest == tail and not head.endswith("\ufffd"):
                self._settled += head
                self._offset = cut
                return self._settled + rest
        return self._settled + tail

    def add(self, new_ids: list[int]) -> str:
        """Take the next tokens; return the newly final text (possibly empty). Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        if not new_ids:
            return ""
        full = self._decode()
        emitted = len(self.text)
        if self.stops:
            start = max(0, emitted - self._max_stop)
            hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit(full[:min(hits)])
        end = len(full)
        while end > emitted and full[end - 1] == "\ufffd":
            end -= 1
        end -= self._partial_stop(full[:end])
        return self._emit(full[:end])

    def finish(self) -> str:
        """Generation ended without a stop string: the held-back rest of the text."""
        if self.stopped:
            return ""
        return self._emit(self._decode())

    def _emit(self, final: str) -> str:
        emitted = len(self.text)
        if len(final) <= emitted:
            return ""
        # if earlier text now decodes differently, what was sent stays sent: only the new tail goes out
        delta = final[emitted:]
        self.text += delta
        return delta

    def _partial_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
