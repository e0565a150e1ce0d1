"""LongBench's answer metrics, written here from their definitions (LongBench's `metrics.py` and `eval.py`).

Every metric takes `(prediction, references, **kw)` and returns a float in [0, 1]: the best score over the
references (LongBench's scorer takes that maximum, starting from 0). `references` may also be one string.
Behaviours of LongBench's code that change scores are kept on purpose and named where they happen:

- `rouge` is ROUGE-L F as the `rouge` package (1.0.1, which LongBench calls) computes it: the text is cut into
  "sentences" at every '.', words are split on single spaces, and the union-LCS summary-level score counts
  *distinct* words (the package's default `exclusive=True`), with `2PR / (P + R + 1e-8)`. An empty
  hypothesis or reference scores 0 (the package raises and LongBench catches it).
- `classification` drops matched labels that are a proper substring of the reference while iterating over the
  same list, so the label after a dropped one is never examined; the difflib fallback in LongBench's code is
  dead (`list != 0` is always true), so a prediction that names no label scores 0.
- `code_sim` takes the first line (after leading newlines) that contains none of '`', '#', '//' — an empty
  line qualifies — and fuzzywuzzy's `ratio`: 100 when equal, 0 when either side is empty, otherwise the
  Indel similarity rounded to a whole percent.
"""
from __future__ import annotations

import re
import string
from collections import Counter

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")


def _refs(references) -> list[str]:
    return [references] if isinstance(references, str) else list(references)


def _best(fn, prediction: str, references, **kw) -> float:
    score = 0.0
    for ref in _refs(references):
        score = max(score, float(fn(prediction, ref, **kw)))
    return score


# ---------------------------------------------------------------- QA F1
def normalize_answer(s: str) -> str:
    """Lowercase, drop ASCII punctuation, then the articles a/an/the, then collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def token_f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def _qa_f1(prediction: str, ref: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ref).split())


def qa_f1(prediction: str, references, **kw) -> float:
    return _best(_qa_f1, prediction, references)


# ---------------------------------------------------------------- ROUGE-L
def _sentences(text: str) -> list[str]:
    return [" ".join(piece.split()) for piece in text.split(".") if piece]


def _lcs_words(x: list[str], y: list[str]) -> set[str]:
    """The distinct words of one longest common subsequence of x (reference) and y (hypothesis), traced back
    from the end with the package's tie rule (move up only when that cell is strictly larger)."""
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        row, prev, xi = table[i], table[i - 1], x[i - 1]
        for j in range(1, len(y) + 1):
            row[j] = prev[j - 1] + 1 if xi == y[j - 1] else max(prev[j], row[j - 1])
    out, i, j = set(), len(x), len(y)
    while i and j:
        if x[i - 1] == y[j - 1]:
            out.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def rouge_l(prediction: str, ref: str) -> float:
    hyp, refs = _sentences(prediction), _sentences(ref)
    if not hyp or not refs:
        return 0.0
    m = len({w for s in refs for w in s.split(" ")})  # distinct reference words
    n = len({w for s in hyp for w in s.split(" ")})  # distinct hypothesis words
    union: set[str] = set()
    for r in refs:
        for h in hyp:
            union |= _lcs_words(r.split(" "), h.split(" "))
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * precision * recall / (precision + recall + 1e-8)


def rouge(prediction: str, references, **kw) -> float:
    return _best(lambda p, r: rouge_l(p, r), prediction, references)


# ---------------------------------------------------------------- classification (trec)
def _classification(prediction: str, ref: str, all_classes) -> float:
    matches = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matches):  # LongBench removes from the list it iterates: the next label is skipped
        if matches[i] in ref and matches[i] != ref:
            del matches[i]
        i += 1
    return 1.0 / len(matches) if ref in matches else 0.0


def classification(prediction: str, references, all_classes=None, **kw) -> float:
    if all_classes is None:
        raise ValueError("classification needs all_classes (the task's label names)")
    return _best(_classification, prediction, references, all_classes=list(all_classes))


# ---------------------------------------------------------------- numbers (passage retrieval / count)
def _fraction_equal(prediction: str, target: str) -> float:
    numbers = _NUMBER.findall(prediction)
    return sum(x == target for x in numbers) / len(numbers) if numbers else 0.0


def _retrieval(prediction: str, ref: str, **_) -> float:
    found = _PARAGRAPH.findall(ref)
    return _fraction_equal(prediction, found[0]) if found else 0.0  # (LongBench raises on such a reference)


def retrieval(prediction: str, references, **kw) -> float:
    return _best(_retrieval, prediction, references)


def count(prediction: str, references, **kw) -> float:
    return _best(lambda p, r: _fraction_equal(p, str(r)), prediction, references)


# ---------------------------------------------------------------- code edit similarity
def first_code_line(prediction: str) -> str:
    """LongBench's pick: the first line (after leading newlines) holding none of '`', '#', '//'; else ''."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def fuzz_ratio(a: str, b: str) -> float:
    """fuzzywuzzy's `ratio` / 100: 1 when equal, 0 when either is empty, else the rounded Indel similarity."""
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    from rapidfuzz import fuzz

    return round(fuzz.ratio(a, b)) / 100


def code_sim(prediction: str, references, **kw) -> float:
    line = first_code_line(prediction)
    return _best(lambda _p, r: fuzz_ratio(line, r), prediction, references)


# ---------------------------------------------------------------- exact match
def exact_match(prediction: str, references, **kw) -> float:
    return _best(lambda p, r: float(p.strip() == r.strip()), prediction, references)


METRICS = {"qa_f1": qa_f1, "rouge": rouge, "classification": classification, "retrieval": retrieval,
           "count": count, "code_sim": code_sim, "exact_match": exact_match}
