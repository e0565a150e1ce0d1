"""LongBench's metrics (dustin.tasks.metrics) on cases computed by hand; each computation is next to its assert."""
from __future__ import annotations

import pytest

from dustin.tasks.metrics import classification, code_sim, count, exact_match, normalize_answer, qa_f1, retrieval, rouge

EPS = 1e-7  # ROUGE's F has + 1e-8 in the denominator, as in the rouge package


def test_normalize_answer():
    # lower -> drop punctuation -> drop whole-word articles -> collapse spaces
    assert normalize_answer("The  Eiffel-Tower, in A city!") == "eiffeltower in city"
    assert normalize_answer("anthem theater") == "anthem theater"  # 'an'/'the' inside words stay


def test_qa_f1():
    # "The Eiffel Tower!" -> "eiffel tower" = the reference's tokens: P = R = 1
    assert qa_f1("The Eiffel Tower!", ["eiffel tower"]) == 1.0
    # [paris, france] vs [paris]: 1 common, P = 1/2, R = 1, F1 = 2*(1/2)*1 / (3/2) = 2/3
    assert qa_f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    # empty prediction: no common token -> 0
    assert qa_f1("", ["Paris"]) == 0.0
    # punctuation only normalizes to nothing -> 0
    assert qa_f1("...", ["Paris"]) == 0.0
    # several references, the best counts: [blue, whale] vs [whale] (article dropped): P = 1/2, R = 1 -> 2/3;
    # vs [big, blue, whale]: 2 common, P = 1, R = 2/3 -> 2*(2/3)/(5/3) = 4/5
    assert qa_f1("blue whale", ["the whale", "a big blue whale"]) == pytest.approx(0.8)
    # articles are whole words only: [anthem, theory] vs [anthem]: P = 1/2, R = 1 -> 2/3
    assert qa_f1("anthem theory", ["anthem"]) == pytest.approx(2 / 3)
    # repeated tokens count as a multiset: [x, x, y] vs [x, y, y]: common x:1 + y:1 = 2, P = R = 2/3 -> 2/3
    assert qa_f1("x x y", ["x y y"]) == pytest.approx(2 / 3)
    # a bare string works as one reference
    assert qa_f1("Paris", "paris.") == 1.0


def test_rouge():
    # identical: distinct words m = n = 3, union-LCS words {the, cat, sat} = 3, P = R = 1, F = 2/(2 + 1e-8)
    assert rouge("the cat sat", ["the cat sat"]) == pytest.approx(1.0, abs=EPS)
    # hyp [the cat sat on the mat], ref [the cat is on the mat]: LCS 'the cat on the mat' has the distinct
    # words {the, cat, on, mat} = 4; distinct ref words {the, cat, is, on, mat} = 5, hyp words 5 -> P = R = F = 4/5
    assert rouge("the cat sat on the mat", ["the cat is on the mat"]) == pytest.approx(0.8, abs=EPS)
    # empty prediction (or only dots: no sentence is left after splitting at '.') -> 0 (the package raises)
    assert rouge("", ["the cat sat"]) == 0.0
    assert rouge("...", ["the cat sat"]) == 0.0
    # sentences are cut at '.': ref 'dog ran' matches hyp 'dog ran' ({dog, ran}), ref 'cat sat' matches hyp
    # 'cat sat' ({cat, sat}): union 4 words of m = n = 4 -> F = 1 (one LCS over all words would give 2/4)
    assert rouge("cat sat. dog ran", ["dog ran. cat sat"]) == pytest.approx(1.0, abs=EPS)
    # punctuation other than '.' stays on the word: hyp [cat,, sat] vs ref [cat, sat]: LCS {sat}, P = R = 1/2
    assert rouge("cat, sat", ["cat sat"]) == pytest.approx(0.5, abs=EPS)
    # several references: 'x y' shares nothing -> 0; 'a b d': LCS {a, b}, P = R = 2/3 -> F = 2/3
    assert rouge("a b c", ["x y", "a b d"]) == pytest.approx(2 / 3, abs=EPS)


def test_classification():
    labels = ["Animal", "Color", "Food"]
    # the prediction names only the reference: matches [Animal] -> 1/1
    assert classification("Animal", ["Animal"], all_classes=labels) == 1.0
    # two labels named, the reference among them: 1/len([Animal, Food]) = 1/2
    assert classification("Animal or Food", ["Food"], all_classes=labels) == 0.5
    # a wrong label -> 0; an empty prediction names no label -> 0; matching is case-sensitive -> 0
    assert classification("Color", ["Food"], all_classes=labels) == 0.0
    assert classification("", ["Food"], all_classes=labels) == 0.0
    assert classification("animal", ["Animal"], all_classes=labels) == 0.0
    # a matched label that is a proper substring of the reference is dropped: [Other, Other location] minus
    # 'Other' -> [Other location] -> 1/1
    loc = ["Other", "Other location", "City"]
    assert classification("Other location", ["Other location"], all_classes=loc) == 1.0
    # LongBench removes while iterating: matches [Num, Number, Number of something]; 'Num' is removed, the
    # iterator moves to index 1, now 'Number of something', so 'Number' is never examined -> 1/2
    num = ["Num", "Number", "Number of something"]
    assert classification("Number of something", ["Number of something"], all_classes=num) == 0.5
    # several references: 'Color' scores 0, 'Animal' 1/len([Animal]) = 1 -> 1
    assert classification("Animal", ["Color", "Animal"], all_classes=labels) == 1.0
    with pytest.raises(ValueError):
        classification("Animal", ["Animal"])


def test_retrieval():
    # numbers in the prediction [12], the reference's paragraph 12 -> 1/1
    assert retrieval("Paragraph 12", ["Paragraph 12"]) == 1.0
    # [3, 12]: one of two equals 12 -> 1/2
    assert retrieval("Paragraph 3 or Paragraph 12", ["Paragraph 12"]) == 0.5
    # empty prediction: no numbers -> 0
    assert retrieval("", ["Paragraph 12"]) == 0.0
    # [12, 2]: '2' is its own number, not part of a match of 12 -> 1/2
    assert retrieval("The answer is Paragraph 12, not 2", ["Paragraph 12"]) == 0.5
    # numbers compare as strings: '012' != '12' -> 0
    assert retrieval("Paragraph 012", ["Paragraph 12"]) == 0.0
    # several references: vs paragraph 4 -> 0, vs paragraph 7 -> 1/1 -> 1
    assert retrieval("7", ["Paragraph 4", "Paragraph 7"]) == 1.0


def test_count():
    # [5] vs 5 -> 1
    assert count("5", ["5"]) == 1.0
    # [5, 10]: one of two equals 5 -> 1/2
    assert count("There are 5 unique paragraphs out of 10", ["5"]) == 0.5
    # no digits ('' and 'five') -> 0
    assert count("", ["5"]) == 0.0
    assert count("five", ["5"]) == 0.0
    # '15' is one number, not 5 -> 0/1
    assert count("15", ["5"]) == 0.0
    # [3, 3, 4] vs 3 -> 2/3
    assert count("3, 3 or 4", ["3"]) == pytest.approx(2 / 3)


def test_code_sim():
    # first line 'x = 1' equals the reference -> 1
    assert code_sim("x = 1\n", ["x = 1"]) == 1.0
    # leading newlines stripped; '```python' holds '`' -> skipped; 'return a + b' equals -> 1
    assert code_sim("\n\n```python\nreturn a + b\n```", ["return a + b"]) == 1.0
    # '# comment' skipped; 'foo(bar)' vs 'foo(baz)': LCS 7 chars, Indel distance 16 - 2*7 = 2,
    # ratio 100*(1 - 2/16) = 87.5, rounded half-to-even to 88 (fuzzywuzzy's whole percent) -> 0.88
    assert code_sim("# comment\nfoo(bar)", ["foo(baz)"]) == 0.88
    # 'abc' vs 'abd': LCS 2, distance 6 - 4 = 2, 100*(1 - 2/6) = 66.67 -> 67 -> 0.67
    assert code_sim("abc", ["abd"]) == 0.67
    # a code line with a trailing comment holds '#' -> skipped; 'y = 2' vs 'x = 1': LCS ' = ' (3),
    # distance 10 - 6 = 4, 100*(1 - 4/10) = 60 -> 0.6
    assert code_sim("x = 1  # set x\ny = 2", ["x = 1"]) == 0.6
    # empty prediction -> '' -> 0; an empty line counts as a line: '# c' skipped, then '' -> 0
    assert code_sim("", ["x = 1"]) == 0.0
    assert code_sim("# c\n\nz", ["z"]) == 0.0
    # several references: 'x = 2' gives 100*(1 - 2/10) = 80 -> 0.8, 'x = 1' gives 1 -> 1
    assert code_sim("x = 1", ["x = 2", "x = 1"]) == 1.0


def test_exact_match():
    # stripped equal -> 1
    assert exact_match(" yes \n", ["yes"]) == 1.0
    # case-sensitive -> 0
    assert exact_match("Yes", ["yes"]) == 0.0
    # empty prediction vs a non-empty reference -> 0
    assert exact_match("", ["yes"]) == 0.0
    # several references: 'b' equals the second -> 1
    assert exact_match("b", ["a", "b"]) == 1.0
    # no reference -> 0
    assert exact_match("b", []) == 0.0
