"""Needle-in-a-haystack prompts with exact token spans, for SRH profiling and `dustin eval needles`.

A needle is a made-up fact (no model knows it beforehand) inserted at a sentence boundary of a long text; the
prompt ends with a question only the fact answers. Profiling needs to know exactly which tokens hold the fact
(heads that attend there while the answer is generated are retrieval heads), so the prompt is built from
separately encoded pieces and `spans` are exact token ranges, not re-tokenization guesses.

PROFILE_NEEDLES and HELDOUT_NEEDLES share no answer word: heads chosen on the first are judged on the second.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dustin.errors import InputError


@dataclass(frozen=True)
class Needle:
    fact: str  # inserted into the haystack
    question: str
    answer: str


PROFILE_NEEDLES: tuple[Needle, ...] = (
    Needle("The secret ingredient of Grandma Lucia's famous soup is smoked paprika.",
           "What is the secret ingredient of Grandma Lucia's famous soup?", "smoked paprika"),
    Needle("The access code for the old observatory in Tromsø is 7391.",
           "What is the access code for the old observatory in Tromsø?", "7391"),
    Needle("Captain Imogen Hale named her sailboat the Silver Heron.",
           "What did Captain Imogen Hale name her sailboat?", "Silver Heron"),
    Needle("The kite festival of the village of Bramblewick is always held on October ninth.",
           "On what date is the kite festival of the village of Bramblewick held?", "October ninth"),
    Needle("Dr. Amara Okafor keeps her research notes in a green leather notebook.",
           "Where does Dr. Amara Okafor keep her research notes?", "green leather notebook"),
    Needle("The password of the school's robotics lab is marigold-35.",
           "What is the password of the school's robotics lab?", "marigold-35"),
)

HELDOUT_NEEDLES: tuple[Needle, ...] = (
    Needle("The rarest stamp in Felix Moreau's collection is a blue Mauritius from 1847.",
           "What is the rarest stamp in Felix Moreau's collection?", "blue Mauritius"),
    Needle("The lighthouse keeper on Skerry Island feeds his cat sardines every Tuesday.",
           "What does the lighthouse keeper on Skerry Island feed his cat every Tuesday?", "sardines"),
    Needle("The combination of the vault at the Harwick Savings Bank is 58-13-77.",
           "What is the combination of the vault at the Harwick Savings Bank?", "58-13-77"),
    Needle("The mascot of the Pinecrest Rowing Club is a purple walrus named Bartholomew.",
           "What is the mascot of the Pinecrest Rowing Club?", "purple walrus"),
    Needle("The first train to Eldermoor leaves the station at 6:42 in the morning.",
           "At what time does the first train to Eldermoor leave the station?", "6:42"),
    Needle("Marco Bellini buried the treasure map under an old fig tree in his garden.",
           "Where did Marco Bellini bury the treasure map?", "old fig tree"),
    Needle("Professor Ingrid Solberg's favorite chess opening is the Catalan Gambit.",
           "What is Professor Ingrid Solberg's favorite chess opening?", "Catalan Gambit"),
    Needle("The winning ticket of the Lakeview charity raffle was number 90512.",
           "What was the number of the winning ticket of the Lakeview charity raffle?", "90512"),
)

# "without repeating the question": otherwise small models restate the fact and run out of new tokens first
INSTRUCTION = "Answer the question using the document above, in a few words and without repeating the question."
_HEAD = "Read the following document carefully.\n\nDocument:\n"
_SENTINEL = "@@DUSTIN-NEEDLE-CONTENT@@"
# Sentence ends: . ! ? (plus closing quotes/brackets) before whitespace, not after an initial ("J. P.") or a
# title; and paragraph breaks (blank lines). A single newline is no boundary: prose may be hard-wrapped.
_BOUNDARY = re.compile(r"(?<![A-Z])(?<!\bMr)(?<!\bMrs)(?<!\bMs)(?<!\bDr)(?<!\bSt)(?<!\bvs)(?<!\be\.g)(?<!\bi\.e)"
                       r"[.!?][\"')\]]*(?=\s)|\n[ \t]*\n\s*")


@dataclass
class NeedlePrompt:
    ids: list[int]  # the whole prompt (chat template applied when chat=True)
    spans: list[tuple[int, int]]  # token [start, end) of each fact in ids, in prompt order
    asked: int  # index into spans of the needle the question asks about
    answer: str
    question: str
    depth: float  # depth of the asked needle, 0..1
    n_tokens: int  # len(ids)


def make_needle_prompt(tokenizer, haystack: str, n_tokens: int, needles: Sequence[Needle], depths: Sequence[float],
                       asked: int = 0, chat: bool = True) -> NeedlePrompt:
    """A prompt of ~n_tokens tokens (within max(2%, 32); at most n_tokens when a cut allows): instructions,
    `haystack` cut to fit with needles[i] inserted at the sentence boundary nearest to depths[i] (0 = start,
    1 = end), then the question of needles[asked]. Spans are listed in prompt order (= the order of `needles`
    when `depths` ascend; ties keep that order), and `asked` of the result indexes them."""
    if not needles or len(needles) != len(depths):
        raise InputError(f"give one depth per needle ({len(needles)} needles, {len(depths)} depths)")
    if not 0 <= asked < len(needles) or any(not 0.0 <= d <= 1.0 for d in depths):
        raise InputError(f"asked must index the needles and depths lie in [0, 1] (asked {asked}, depths {depths})")

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False, verbose=False)  # haystacks exceed the model

    head, tail = _frame(tokenizer, needles[asked].question, chat)
    head_ids, tail_ids = enc(head), enc(tail)
    hay_ids = _prefix_ids(enc, haystack, n_tokens)
    fixed = len(head_ids) + len(tail_ids) + sum(len(enc(" " + n.fact)) + 1 for n in needles)
    budget = n_tokens - fixed
    if budget < 16:
        raise InputError(f"n_tokens {n_tokens} leaves no room for a haystack ({fixed} tokens of frame and needles)")
    if len(hay_ids) < budget:
        raise InputError(f"the haystack has {len(hay_ids)} tokens; a {n_tokens}-token prompt needs {budget}")
    tries = []
    for _ in range(6):  # separately encoded pieces shift the count by a few tokens: re-cut until it fits
        body, spans = _insert(enc, _cut(tokenizer, hay_ids, budget), needles, depths)
        tries.append((head_ids + [t for part in body for t in part] + tail_ids, spans))
        if 0 <= n_tokens - len(tries[-1][0]) <= max(2, n_tokens // 500):
            break
        budget = min(budget + n_tokens - len(tries[-1][0]), len(hay_ids))
    # the longest try that does not exceed n_tokens, if close enough: callers size n_tokens to the model context
    under = [t for t in tries if 0 <= n_tokens - len(t[0]) <= max(32, n_tokens // 50)]
    ids, spans = max(under, key=lambda t: len(t[0])) if under else min(tries, key=lambda t: abs(len(t[0]) - n_tokens))
    spans = [(s + len(head_ids), e + len(head_ids)) for s, e in spans]
    order = sorted(range(len(needles)), key=lambda i: spans[i][0])
    return NeedlePrompt(ids, [spans[i] for i in order], order.index(asked), needles[asked].answer,
                        needles[asked].question, float(depths[asked]), len(ids))


def _prefix_ids(enc, haystack: str, n_tokens: int) -> list[int]:
    """The tokens of a prefix of the haystack that holds more than n_tokens (all of it if shorter). Encoding a
    whole corpus per prompt (~400k tokens of essays) took most of the SRH profile's time; the cut that follows
    drops the possibly split last word."""
    chars = 6 * n_tokens + 1024
    while True:
        ids = enc(haystack[:chars])
        if len(ids) > n_tokens + 64 or chars >= len(haystack):
            return ids
        chars *= 2


def _frame(tokenizer, question: str, chat: bool) -> tuple[str, str]:
    """Text before the haystack and after it (ending with the question, then the generation prompt)."""
    tail = f"\n\n{INSTRUCTION}\nQuestion: {question}"
    if not chat:
        return _HEAD, tail
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError("this tokenizer has no chat template: build the needle prompt with chat=False")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True,
                                         tokenize=False)
    before, after = text.split(_SENTINEL)
    return before + _HEAD, tail + after


def _cut(tokenizer, hay_ids: list[int], budget: int) -> str:
    """The first `budget` tokens of the haystack, ended at the last sentence boundary of its final quarter
    (so a needle at depth 1 follows a whole sentence), else at the last whitespace."""
    text = tokenizer.decode(hay_ids[:budget])
    if budget >= len(hay_ids):
        return text
    ends = [m.end() for m in _BOUNDARY.finditer(text) if m.end() >= 3 * len(text) // 4]
    cut = ends[-1] if ends else max(text.rfind(" "), text.rfind("\n"), len(text) // 2)
    return text[:cut].rstrip(" ")


def _insert(enc, hay: str, needles: Sequence[Needle], depths: Sequence[float]):
    """Token pieces of the haystack with the facts inserted, and each fact's span relative to the pieces."""
    bounds = sorted({0, len(hay), *(m.end() for m in _BOUNDARY.finditer(hay))})
    where = [min(bounds, key=lambda b: (abs(b - d * len(hay)), b)) for d in depths]
    pieces: list[list[int]] = []
    spans: list[tuple[int, int] | None] = [None] * len(needles)
    pos = done = 0
    for i in sorted(range(len(needles)), key=lambda i: (where[i], i)):
        p = where[i]
        lead = "" if p == 0 or hay[p - 1].isspace() else " "
        if p > done:
            pieces.append(enc(hay[done:p]))
            pos += len(pieces[-1])
        fact = enc(lead + needles[i].fact)
        spans[i] = (pos, pos + len(fact))
        pieces.append(fact)
        pos += len(fact)
        if p < len(hay) and not hay[p].isspace():  # keep the fact apart from the following text
            pieces.append(enc("\n" if not lead else " "))
            pos += len(pieces[-1])
        done = p
    if done < len(hay):
        pieces.append(enc(hay[done:]))
    return pieces, spans


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def rouge1_recall(prediction: str, reference: str) -> float:
    """ROUGE-1 recall: the share of the reference's unigrams found in the prediction (clipped counts; lowercase,
    alphanumeric tokens as in the rouge-score package without stemming). Implemented here rather than pulling
    rouge-score, which brings nltk and absl along for these few lines."""
    ref = Counter(_words(reference))
    if not ref:
        return 0.0
    pred = Counter(_words(prediction))
    return sum(min(n, pred[w]) for w, n in ref.items()) / sum(ref.values())
