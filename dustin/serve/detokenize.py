"""Incremental detokenization with stop strings, for streamed and non-streamed completions.

Each time new tokens arrive the whole completion is decoded again and the new suffix is emitted (a token may
change how the text before it decodes, e.g. a multi-byte character split over two tokens, so decoding token by
token would be wrong). Text that could still become a stop string is held back until it either completes the stop
string (generation ends there; the stop string and everything after it are dropped) or stops matching. A trailing
U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it.
"""
from __future__ import annotations


def text_decoder(tokenizer):
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a function of `ids` (None without a tokenizer). For a
    fast tokenizer whose decode is transformers' own and cleans up no spaces (Qwen2.5's, for one), that decode is
    the Rust tokenizer's alone, so it is called directly: transformers first converts and checks every id in
    Python, which cost more than the decode itself on the short tails a stream decodes per step."""
    if tokenizer is None:
        return None
    try:
        from transformers import PreTrainedTokenizerFast
        base = PreTrainedTokenizerFast._decode
    except (ImportError, AttributeError):
        base = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (base is not None and getattr(type(tokenizer), "_decode", None) is base
            and callable(getattr(backend, "decode", None))
            and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False):
        dec = backend.decode
        return lambda ids: dec(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stops: list[str] | None = None, decode=None) -> None:
        """decode: `text_decoder(tokenizer)`, if the caller has it already (one per tokenizer will do)."""
        self.tokenizer = tokenizer
        self._dec = decode or text_decoder(tokenizer)
        self.stops = [s for s in (stops or []) if s]
        self._max_stop = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string was found: nothing more will be emitted
        self.kept = 0  # tokens the text stands for: all of `ids`, or those through the one that completed a stop
        # ids[:_offset] decode to _settled on their own, and the whole text is _settled + decode(ids[_offset:]):
        # each call decodes a short tail instead of the whole completion (which made a 512-token stream cost
        # 512 decodes of up to 512 tokens, on the server's event loop)
        self._offset = 0
        self._settled = ""

    _TAIL = 8  # tokens kept in the decoded tail (a character or a merge may span a few tokens)

    @property
    def settled_tokens(self) -> int:
        """The leading tokens whose text is decoded for good: each new token decodes only the tokens after them."""
        return self._offset

    def _decode(self) -> str:
        if self.tokenizer is None:
            return ""
        dec = self._dec
        tail = dec(self.ids[self._offset:])
        cut = len(self.ids) - self._TAIL
        if cut - self._offset >= 2 * self._TAIL:  # try to settle ids[_offset:cut]
            head = dec(self.ids[self._offset:cut])
            rest = dec(self.ids[cut:])
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
        before = len(self.ids)
        self.ids.extend(new_ids)
        self.kept = len(self.ids)
        if not new_ids:
            return ""
        full = self._decode()
        emitted = len(self.text)
        if self.stops:
            start = max(0, emitted - self._max_stop)
            hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                self.kept = self._through_stop(before, start)
                return self._emit(full[:min(hits)])
        end = len(full)
        while end > emitted and full[end - 1] == "\ufffd":
            end -= 1
        end -= self._partial_stop(full[:end])
        return self._emit(full[:end])

    def _through_stop(self, before: int, start: int) -> int:
        """The fewest tokens whose text holds a stop string found at or after `start` (the first `before` did
        not)."""
        for k in range(max(before, self._offset) + 1, len(self.ids)):
            text = self._settled + self._dec(self.ids[self._offset:k])
            if any(text.find(s, start) >= 0 for s in self.stops):
                return k
        return len(self.ids)

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


class TokenText:
    """Each token's own text and UTF-8 bytes, for log-probabilities (cached per id).

    The text is the token decoded alone (special tokens included), as vLLM reports it; a token holding part of a
    multi-byte character decodes to U+FFFD. The bytes are the token's own: for byte-level BPE tokenizers (GPT-2's,
    Qwen's, Llama 3's) read through the byte alphabet, so that a character split over tokens is rebuilt by joining
    their bytes (what OpenAI's `bytes` is for); else the text's UTF-8. Without a tokenizer a token is
    `token_id:N`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_of = _byte_alphabet(tokenizer)

    def texts(self, ids: list[int]) -> list[str]:
        missing = list({i for i in ids if i not in self._text})
        if missing:
            tok = self.tokenizer
            texts = [f"token_id:{i}" for i in missing] if tok is None else \
                tok.batch_decode([[i] for i in missing], skip_special_tokens=False)
            self._text.update(zip(missing, texts, strict=True))
        return [self._text[i] for i in ids]

    def text(self, i: int) -> str:
        return self.texts([i])[0]

    def bytes(self, i: int) -> list[int]:
        b = self._bytes.get(i)
        if b is None:
            piece = None if self._byte_of is None else self.tokenizer.convert_ids_to_tokens(i)
            if piece is not None and all(ch in self._byte_of for ch in piece):
                b = [self._byte_of[ch] for ch in piece]
            else:
                b = list(self.text(i).encode("utf-8"))
            self._bytes[i] = b
        return b


def _byte_alphabet(tokenizer) -> dict[str, int] | None:
    """GPT-2's byte-to-character table, inverted, when the tokenizer decodes with it (byte-level BPE)."""
    try:
        decoder = tokenizer.backend_tokenizer.decoder
    except AttributeError:
        return None
    if decoder is None or "ByteLevel" not in type(decoder).__name__ and "ByteLevel" not in repr(decoder):
        return None
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}
