"""Log-probabilities in the two OpenAI forms: the legacy completions form (`logprobs: N`: tokens, token_logprobs,
top_logprobs as {token: logprob}, text_offset) and the chat form (`logprobs: true, top_logprobs: N`:
content[] of {token, logprob, bytes, top_logprobs}).

The engine computes them (dustin/engine/logprobs.py) from the target's raw distribution: the log-softmax of its
logits before temperature, top-k and top-p. JSON has no -inf: a log-probability below -9999 is sent as -9999.0
(as vLLM does).
"""
from __future__ import annotations

from dustin.engine.request import Logprob
from dustin.serve.detokenize import TokenText
from dustin.serve.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

FLOOR = -9999.0


def _v(x: float) -> float:
    return x if x >= FLOOR else FLOOR  # also NaN -> FLOOR


def completion_logprobs(ids: list[int], lps: list[Logprob | None], text: TokenText,
                        offset: int = 0) -> tuple[CompletionLogprobs, int]:
    """The legacy form of tokens `ids` (a None log-probability: a prompt's first token), their text offsets
    counted from `offset` (cumulative lengths of the tokens' texts); and the offset after them. Each
    top_logprobs entry holds the most likely tokens and the chosen one (so up to N + 1, as OpenAI's)."""
    toks = text.texts(ids)
    tops: list[dict[str, float] | None] = []
    offsets = []
    for s, lp in zip(toks, lps, strict=True):
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            tops.append(None)
            continue
        names = text.texts([t for t, _ in lp.top])
        top = {name: _v(v) for name, (_, v) in zip(names, lp.top, strict=True)}
        top.setdefault(s, _v(lp.logprob))
        tops.append(top)
    values = [None if lp is None else _v(lp.logprob) for lp in lps]
    return CompletionLogprobs(tokens=toks, token_logprobs=values, top_logprobs=tops, text_offset=offsets), offset


def chat_logprobs(ids: list[int], lps: list[Logprob], text: TokenText) -> ChatLogprobs:
    """The chat form of generated tokens `ids`: each token's text, log-probability and bytes, and the
    `top_logprobs` most likely tokens'."""
    def top(t: int, v: float) -> TopLogprob:
        return TopLogprob(token=text.text(t), logprob=_v(v), bytes=text.bytes(t))

    return ChatLogprobs(content=[
        TokenLogprob(token=text.text(t), logprob=_v(lp.logprob), bytes=text.bytes(t),
                     top_logprobs=[top(i, v) for i, v in lp.top])
        for t, lp in zip(ids, lps, strict=True)])
