"""LongBench tasks (dustin.tasks.longbench) on fixture JSONL files written here (invented text), with a
character-level fake tokenizer and with the default pair's real one."""
from __future__ import annotations

import json

import pytest

from dustin.errors import InputError
from dustin.tasks import metrics
from dustin.tasks.catalog import REGISTRY
from dustin.tasks.longbench import ENV, SPECS, TASKS, TEMPLATES, LongBenchTask, middle_truncate

# the spec: (max_new_tokens, metric, chat template, first line scored) per task
TABLE = {
    "narrativeqa": (128, "qa_f1", True, False), "qasper": (128, "qa_f1", True, False),
    "multifieldqa_en": (64, "qa_f1", True, False), "hotpotqa": (32, "qa_f1", True, False),
    "2wikimqa": (32, "qa_f1", True, False), "musique": (32, "qa_f1", True, False),
    "gov_report": (512, "rouge", True, False), "qmsum": (512, "rouge", True, False),
    "multi_news": (512, "rouge", True, False), "trec": (64, "classification", False, True),
    "triviaqa": (32, "qa_f1", False, True), "samsum": (128, "rouge", False, True),
    "passage_count": (32, "count", True, False), "passage_retrieval_en": (32, "retrieval", True, False),
    "lcc": (64, "code_sim", False, False), "repobench-p": (64, "code_sim", False, False),
}
LABELS = ["Animal", "Color", "Food"]
ANSWERS = {"trec": "Animal", "passage_count": "4", "passage_retrieval_en": "Paragraph 3", "lcc": "x = 1",
           "repobench-p": "y = 2"}


class CharTok:
    """One token per character (id = ord + 10); BOS id 1 with add_special_tokens when `bos`."""

    def __init__(self, chat: bool = True, bos: bool = False):
        self.chat_template = "fake" if chat else None
        self.bos = bos

    def encode(self, text, add_special_tokens=True, **_):
        return ([1] if self.bos and add_special_tokens else []) + [ord(c) + 10 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 10) if i >= 10 else "<s>" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return f"<u>{messages[0]['content']}</u><a>"


def record(task: str, i: int, context: str | None = None) -> dict:
    return {"input": f"question {i} of {task}?", "context": context or f"Invented context {i} about owls.",
            "answers": [ANSWERS.get(task, f"answer {i}")], "length": 5, "_id": f"{task}-{i}",
            "all_classes": LABELS if task == "trec" else None}


@pytest.fixture
def data(tmp_path, monkeypatch):
    for name in TABLE:
        lines = [json.dumps(record(name, i)) for i in range(3)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")
    monkeypatch.setenv(ENV, str(tmp_path))
    return tmp_path


def fresh(name: str) -> LongBenchTask:
    return LongBenchTask(name, TEMPLATES[name], *SPECS[name])


def test_registered_table():
    assert list(TASKS) == list(TABLE)
    for name, (max_new, metric, chat, first) in TABLE.items():
        t = REGISTRY[name]
        assert t is TASKS[name] and t.family == "longbench"
        assert (t.max_new_tokens, t.metric, t.chat, t.first_line) == (max_new, metric, chat, first), name


def test_middle_truncate():
    ids = list(range(10))
    assert middle_truncate(ids, 4) == [0, 1, 8, 9]
    assert middle_truncate(ids, 5) == [0, 1, 2, 8, 9]  # an odd budget's extra token goes to the head
    assert middle_truncate(ids, 1) == [0]  # no tail: not ids[-0:]
    assert middle_truncate(ids, 10) == ids and middle_truncate(ids, 50) == ids


@pytest.mark.parametrize("name", list(TABLE))
def test_template_and_chat(data, name):
    s = fresh(name).samples(CharTok(), 4096, 2, seed=0)[1]
    raw = TEMPLATES[name].format(**record(name, 1))
    chat = TABLE[name][2]
    assert CharTok().decode(s.prompt_ids) == (f"<u>{raw}</u><a>" if chat else raw)
    assert s.meta["chat"] is chat and s.meta["truncated"] is False
    assert s.references == [ANSWERS.get(name, "answer 1")] and s.max_new_tokens == TABLE[name][0]
    assert record(name, 1)["context"] in raw and ("{" not in raw)


def test_template_fields(data):
    text = CharTok().decode(fresh("hotpotqa").samples(CharTok(), 4096, 1, 0)[0].prompt_ids)
    assert "The following are given passages.\nInvented context 0 about owls.\n\n" in text
    assert text.endswith("Question: question 0 of hotpotqa?\nAnswer:</u><a>")
    text = CharTok().decode(fresh("repobench-p").samples(CharTok(), 4096, 1, 0)[0].prompt_ids)
    assert text == "Please complete the code given below. \nInvented context 0 about owls.question 0 of " \
                   "repobench-p?Next line of code:\n"


def test_no_chat_template_and_bos(data):
    s = fresh("hotpotqa").samples(CharTok(chat=False), 4096, 1, 0)[0]
    assert not s.meta["chat"] and CharTok().decode(s.prompt_ids).startswith("Answer the question")
    s = fresh("lcc").samples(CharTok(bos=True), 4096, 1, 0)[0]  # no chat: the tokenizer's BOS comes first
    assert s.prompt_ids[0] == 1 and s.prompt_ids.count(1) == 1


@pytest.mark.parametrize("name,context", [("hotpotqa", 1000), ("hotpotqa", 1001), ("trec", 777)])
def test_middle_truncation_budget(tmp_path, monkeypatch, name, context):
    long = "HEAD " + "filler text " * 800 + " TAIL"
    (tmp_path / f"{name}.jsonl").write_text(json.dumps(record(name, 0, long)) + "\n")
    monkeypatch.setenv(ENV, str(tmp_path))
    tok = CharTok()
    s = fresh(name).samples(tok, context, 1, 0)[0]
    assert len(s.prompt_ids) == context - TABLE[name][0] and s.meta["truncated"]
    frame = (3, 7) if TABLE[name][2] else (0, 0)  # '<u>' and '</u><a>'
    budget = context - TABLE[name][0] - sum(frame)
    raw = TEMPLATES[name].format(**record(name, 0, long))
    body = tok.decode(s.prompt_ids)[frame[0]: len(s.prompt_ids) - frame[1]]
    head, tail = budget - budget // 2, budget // 2
    assert body == raw[:head] + raw[len(raw) - tail:]
    assert "HEAD" in body and "TAIL" in body and s.meta["raw_tokens"] == len(raw)


def test_first_n_lines_in_file_order(data):
    t = fresh("qasper")
    a, b = t.samples(CharTok(), 4096, 2, seed=0), t.samples(CharTok(), 4096, 2, seed=123)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]  # the seed is unused
    assert [s.meta["id"] for s in a] == ["qasper-0", "qasper-1"] and [s.index for s in a] == [0, 1]
    every = t.samples(CharTok(), 4096, 10, seed=0)  # more than the file holds: all 3 (the blank line skipped)
    assert [s.meta["id"] for s in every] == ["qasper-0", "qasper-1", "qasper-2"]
    assert [s.meta["line"] for s in every] == [1, 2, 4]


def test_all_classes_in_meta_and_score(data):
    t = fresh("trec")
    s = t.samples(CharTok(), 4096, 1, 0)[0]
    assert s.meta["all_classes"] == LABELS and t.all_classes == LABELS
    # matches [Animal, Food] -> 1/2
    assert t.score("Animal or Food", ["Animal"]) == 0.5
    # a task that has read nothing yet reads the labels from its file; explicit labels win
    assert fresh("trec").score("Animal", ["Animal"]) == 1.0
    # with explicit labels 'Animals' matches [Animal, Animals] -> 1/2 (the file's labels: [Animal] -> 1)
    assert fresh("trec").score("Animals", ["Animal"], all_classes=["Animal", "Animals"]) == 0.5


def test_first_line_rule(data):
    # triviaqa scores only 'Paris' (after leading newlines) -> 1
    assert fresh("triviaqa").score("\nParis\nblah blah", ["Paris"]) == 1.0
    # narrativeqa scores all of it: [paris, blah, blah] vs [paris]: P = 1/3, R = 1 -> F1 = 1/2
    assert fresh("narrativeqa").score("Paris\nblah blah", ["Paris"]) == pytest.approx(0.5)
    # trec: first line 'Animal' -> 1 (the whole text would match [Animal, Color] -> 1/2)
    assert fresh("trec").score("Animal\nColor", ["Animal"], all_classes=LABELS) == 1.0
    # samsum: first line 'a b' vs 'a b' -> ROUGE-L 1; gov_report keeps 'c d': distinct hyp words 4 -> P = 1/2
    assert fresh("samsum").score("a b\nc d", ["a b"]) == pytest.approx(1.0, abs=1e-7)
    assert fresh("gov_report").score("a b\nc d", ["a b"]) == pytest.approx(2 * 0.5 / 1.5, abs=1e-7)


@pytest.mark.parametrize("name", list(TABLE))
def test_metric_dispatch(name):
    fn = getattr(metrics, TABLE[name][1])
    kw = {"all_classes": LABELS} if name == "trec" else {}
    refs = [ANSWERS.get(name, "the owl flies")]
    for pred in ["the owl flies at night", "Animal 4", "Paragraph 3", "x = 1", "y = 2", ""]:
        assert fresh(name).score(pred, refs, **kw) == fn(pred, refs, **kw)


def test_missing_data(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(InputError) as e:
        fresh("qmsum").samples(CharTok(), 4096, 1, 0)
    msg = str(e.value)
    assert str(tmp_path / "qmsum.jsonl") in msg and ENV in msg and "data.zip" in msg and "\n" not in msg
    monkeypatch.delenv(ENV)
    with pytest.raises(InputError, match=ENV):
        fresh("qmsum").samples(CharTok(), 4096, 1, 0)


def test_missing_data_is_refused_before_the_models_load(tmp_path, capsys):
    """`dustin eval tasks` asks every task for its data before loading (the target does not even exist here)."""
    from dustin.cli.main import main
    assert main(["eval", "tasks", "--tasks", "vt,qmsum", "--longbench-dir", str(tmp_path),
                 "--target", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dustin: error: LongBench file {tmp_path / 'qmsum.jsonl'} not found")
    assert err.count("\n") == 1


def test_folder_attribute_and_bad_input(data, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    (other / "musique.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"]}\nnot json\n')
    t = fresh("musique")
    t.folder = other  # wins over the environment
    assert t.samples(CharTok(), 4096, 1, 0)[0].meta["line"] == 1
    with pytest.raises(InputError, match="musique.jsonl:2: not JSON"):
        t.samples(CharTok(), 4096, 2, 0)
    with pytest.raises(InputError, match="context 40"):  # 40 - 32 generated - 10 of chat frame < 2
        fresh("hotpotqa").samples(CharTok(), 40, 1, 0)


@pytest.mark.parametrize("name", ["hotpotqa", "trec"])
def test_real_tokenizer(tok, tmp_path, monkeypatch, name):
    long = "The owl library opened in spring. " * 400 + "The last shelf holds maps."
    (tmp_path / f"{name}.jsonl").write_text(json.dumps(record(name, 0, long)) + "\n")
    monkeypatch.setenv(ENV, str(tmp_path))
    s = fresh(name).samples(tok, 1024, 1, 0)[0]
    assert len(s.prompt_ids) == 1024 - TABLE[name][0] and s.meta["truncated"]
    raw = tok.encode(TEMPLATES[name].format(**record(name, 0, long)), add_special_tokens=False)
    if TABLE[name][2]:
        chat = tok.apply_chat_template([{"role": "user", "content": "\x00"}], add_generation_prompt=True,
                                       tokenize=False)
        before, after = (tok.encode(x, add_special_tokens=False) for x in chat.split("\x00"))
    else:
        before, after = [], []  # Qwen's tokenizer adds no BOS
    budget = len(s.prompt_ids) - len(before) - len(after)
    assert s.prompt_ids == before + raw[: budget - budget // 2] + raw[len(raw) - budget // 2:] + after
    text = tok.decode(s.prompt_ids)
    assert ("<|im_start|>" in text) is TABLE[name][2]
    assert text.startswith("<|im_start|>system" if TABLE[name][2] else "Please determine the type")
    assert "question 0 of" in text


def _f1_by_hand(prediction: str, answer: str) -> float:
    """LongBench's QA F1: lowercase, drop punctuation and the articles a/an/the, then word-overlap F1."""
    import string
    from collections import Counter

    def words(t):
        t = "".join(c for c in t.lower() if c not in string.punctuation)
        return [w for w in t.split() if w not in ("a", "an", "the")]

    p, r = words(prediction), words(answer)
    same = sum((Counter(p) & Counter(r)).values())
    return 0.0 if same == 0 else 2 * same / (len(p) + len(r))


@pytest.mark.realmodels
@pytest.mark.slow
def test_eval_tasks_runs_longbench_files_end_to_end(tmp_path, capsys, monkeypatch, real_pair_cli):
    """`dustin eval tasks --tasks trec,hotpotqa --longbench-dir ...` on the (shared) real pair: the runner reads
    the files, scores trec with the sample's own label set, and writes the table (vanilla only). The questions
    are easy enough that the pair answers them, and each score is recomputed here from the prediction the
    runner returns: trec 1 / (labels named on the answer's first line) when the right one is among them, hotpotqa
    the word F1 by hand; the table's row is their mean.
    trec generates 8 tokens here instead of LongBench's 64 (its spec: test_registered_table): its score reads
    the answer's first line only (" Animal", 2 tokens), and the pair never stops on its own after it (it goes on
    explaining), so the other 56 decode steps of the pair checked nothing. hotpotqa keeps its 32 (it stops at EOS
    after "Hedwig")."""
    from dustin.cli.main import main

    monkeypatch.setattr(TASKS["trec"], "max_new_tokens", 8)

    examples = "".join(f"Question: {q}\nType: {t}\n" for q, t in (
        ("Which animal says meow?", "Animal"), ("What color is grass?", "Color"),
        ("Which food is made from milk?", "Food"), ("Which animal has a trunk?", "Animal")))
    records = {
        "trec": {"input": "Question: Which animal barks at the mailman?\nType:", "context": examples,
                 "answers": ["Animal"], "all_classes": LABELS, "length": 5, "_id": "trec-0"},
        "hotpotqa": {"input": "What is the name of the owl that lives in the old tower?",
                     "context": "Passage 1:\nThe old tower is home to an owl named Hedwig.\nPassage 2:\nThe river "
                                "flows past the mill.", "answers": ["Hedwig"], "length": 5, "_id": "hotpotqa-0"}}
    for name, rec in records.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(rec) + "\n")
    out = tmp_path / "lb.json"
    code = main(["eval", "tasks", "--tasks", "trec,hotpotqa", "--longbench-dir", str(tmp_path), "--contexts", "400",
                 "--samples", "1", "--methods", "vanilla", "--json-out", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = {r["task"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"trec", "hotpotqa"}
    assert len(rows["trec"]["token_ids"]) <= 8  # the patched length reached the run
    assert rows["trec"]["meta"]["all_classes"] == LABELS
    first_line = rows["trec"]["prediction"].lstrip("\n").split("\n")[0]
    named = [c for c in LABELS if c in first_line]
    assert rows["trec"]["score"] == (1 / len(named) if "Animal" in named else 0.0)
    assert rows["hotpotqa"]["score"] == pytest.approx(_f1_by_hand(rows["hotpotqa"]["prediction"], "Hedwig"))
    assert "Hedwig" in rows["hotpotqa"]["prediction"] and rows["hotpotqa"]["score"] > 0  # the pair can read
    assert "Animal" in first_line and rows["trec"]["score"] > 0
    t, h = 100 * rows["trec"]["score"], 100 * rows["hotpotqa"]["score"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| vanilla |"))
    cells = [c.split()[0] for c in line.strip("| ").split(" | ")]  # a score cell's first word: its mean
    assert cells == ["vanilla", f"{t:.1f}", f"{h:.1f}", f"{(t + h) / 2:.1f}", "-", "-", "-", "-"]  # Δ, k, τ, agreement
