"""The 16 English LongBench (v1) tasks of the paper's Table 14, read from LongBench's own JSONL files.

The data set is not shipped and not downloaded: get `data.zip` from LongBench's Hugging Face repository
(`DATA_URL`), unzip it, and point `DUSTIN_LONGBENCH_DIR` (or `--longbench-dir`, or a task's `folder`
attribute) at the folder that holds `<task>.jsonl` (fields `input`, `context`, `answers`, `all_classes`,
`length`, `_id`). A task then follows LongBench's `pred.py` / `eval.py`:

- the prompt is the task's template (`dataset2prompt`) filled with the line's `context` and `input`;
- a prompt longer than the budget keeps its first and last halves (`ids[:head] + ids[-tail:]`), in tokens of
  the raw prompt. The budget is `context - max_new_tokens` minus what the chat template adds, so the final
  prompt is exactly `context - max_new_tokens` tokens when cut. LongBench cuts to `2 * (max_length // 2)`
  and re-encodes the decoded halves; we cut token ids directly and give an odd budget's extra token to the head;
- the chat template (the tokenizer's own; none when it has none, like LongBench's `build_chat` for an unknown
  model) wraps the prompt except for trec, triviaqa, samsum, lsht, lcc and repobench-p; a prompt without it
  starts with the tokenizer's own special prefix (BOS for Llama, nothing for Qwen), as LongBench's
  `tokenizer(prompt)` does;
- generation length `dataset2maxlen`, metric `dataset2metric` (`dustin.tasks.metrics`), and for trec,
  triviaqa and samsum only the first line of the prediction is scored. (LongBench also stops samsum's
  generation at a newline; scoring the first line gives the same score.)

`samples(tokenizer, context, n, seed)` takes the first n lines in file order (fewer when the file is shorter):
the seed is unused, LongBench has a fixed test set and no sampling. trec's label names (`all_classes`) go into
each sample's meta and are kept on the task, since `score(prediction, references)` does not see the sample.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from dustin.errors import InputError
from dustin.tasks.base import Sample, register
from dustin.tasks.metrics import METRICS

ENV = "DUSTIN_LONGBENCH_DIR"
DATA_URL = "https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip"
NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
_SENTINEL = "\x00LONGBENCH-PROMPT\x00"

# LongBench's prompt templates (THUDM/LongBench, config/dataset2prompt.json, MIT licence), English tasks only.
_QASPER = ("as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
           "answered based on the information in the article, write \"unanswerable\". If the question is a yes/no "
           "question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.")
_PASSAGES = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
             "words.")
_MULTIHOP = (f"{_PASSAGES}\n\nThe following are given passages.\n{{context}}\n\n{_PASSAGES}\n\n"
             "Question: {input}\nAnswer:")
_CODE = "Please complete the code given below. \n{context}"
TEMPLATES = {
    # "asconcisely" (sic) as in LongBench v1's config; a later commit of the old root config added the space
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
                   "question asconcisely as you can, using a single phrase if possible. Do not provide any "
                   "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as "
                   "you can, using a single phrase if possible. Do not provide any explanation.\n\n"
                   "Question: {input}\n\nAnswer:",
    "qasper": f"You are given a scientific article and a question. Answer the question {_QASPER}\n\nArticle: "
              f"{{context}}\n\n Answer the question based on the above article {_QASPER}\n\nQuestion: {{input}}\n\n"
              "Answer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
                       "based on the above text, only give me the answer and do not output any other words.\n\n"
                       "Question: {input}\nAnswer:",
    "hotpotqa": _MULTIHOP,
    "2wikimqa": _MULTIHOP,
    "musique": _MULTIHOP,
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
                  "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
             "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
             "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
                  "Now, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
            "{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other "
                "words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
              "{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
                     "carefully read these paragraphs and determine how many unique paragraphs there are after "
                     "removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n"
                     "{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The "
                     "output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer "
                     "is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
                            "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n"
                            "{input}\n\n"
                            "Please enter the number of the paragraph that the abstract is from. The answer format "
                            "must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": _CODE + "Next line of code:\n",
    "repobench-p": _CODE + "{input}Next line of code:\n",
}
# (max_new_tokens, metric): LongBench's dataset2maxlen and dataset2metric
SPECS = {
    "narrativeqa": (128, "qa_f1"), "qasper": (128, "qa_f1"), "multifieldqa_en": (64, "qa_f1"),
    "hotpotqa": (32, "qa_f1"), "2wikimqa": (32, "qa_f1"), "musique": (32, "qa_f1"),
    "gov_report": (512, "rouge"), "qmsum": (512, "rouge"), "multi_news": (512, "rouge"),
    "trec": (64, "classification"), "triviaqa": (32, "qa_f1"), "samsum": (128, "rouge"),
    "passage_count": (32, "count"), "passage_retrieval_en": (32, "retrieval"),
    "lcc": (64, "code_sim"), "repobench-p": (64, "code_sim"),
}


def middle_truncate(ids: list[int], budget: int) -> list[int]:
    """The first ceil(budget/2) and last floor(budget/2) ids when there are more than `budget`."""
    if len(ids) <= budget:
        return list(ids)
    tail = budget // 2
    return list(ids[: budget - tail]) + list(ids[len(ids) - tail:])


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text by default (BOS for Llama; none for Qwen)."""
    plain, full = _encode(tokenizer, "a"), list(tokenizer.encode("a", add_special_tokens=True))
    return full[: len(full) - len(plain)] if len(full) > len(plain) and full[-len(plain):] == plain else []


def chat_frame(tokenizer) -> tuple[list[int], list[int]] | None:
    """Token ids the chat template puts before and after a user message (with the generation prompt)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True,
                                         tokenize=False)
    before, after = text.split(_SENTINEL)
    return _encode(tokenizer, before), _encode(tokenizer, after)


class LongBenchTask:
    family = "longbench"

    def __init__(self, name: str, template: str, max_new_tokens: int, metric: str):
        self.name, self.template, self.max_new_tokens, self.metric = name, template, max_new_tokens, metric
        self.chat = name not in NO_CHAT
        self.first_line = name in FIRST_LINE
        self.folder: str | os.PathLike | None = None  # set by the CLI; else $DUSTIN_LONGBENCH_DIR
        self.all_classes: list[str] | None = None  # from the last line read (LongBench scores with the last one)

    def __repr__(self) -> str:
        return f"LongBenchTask({self.name!r})"

    def check_data(self) -> None:
        self.path()

    def path(self) -> Path:
        folder = self.folder or os.environ.get(ENV)
        if not folder:
            raise InputError(f"LongBench task {self.name}: no data folder; download {DATA_URL}, unzip it and set "
                             f"{ENV} (or --longbench-dir) to the folder holding {self.name}.jsonl")
        path = Path(folder).expanduser() / f"{self.name}.jsonl"
        if not path.is_file():
            raise InputError(f"LongBench file {path} not found; download {DATA_URL}, unzip it and set {ENV} "
                             f"(or --longbench-dir) to the folder holding {self.name}.jsonl")
        return path

    def read(self, n: int) -> list[dict]:
        """The first n records of the task's file, in file order (blank lines skipped)."""
        path, out = self.path(), []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if len(out) >= n:
                    break
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{lineno}: not JSON ({e.msg})") from None
                missing = [k for k in ("context", "input", "answers") if k not in rec]
                if missing:
                    raise InputError(f"{path}:{lineno}: no field {', '.join(missing)} (a LongBench line has "
                                     f"input, context, answers, all_classes, length, _id)")
                rec["_line"] = lineno
                out.append(rec)
        if out and out[-1].get("all_classes") is not None:
            self.all_classes = list(out[-1]["all_classes"])
        return out

    def prompt_ids(self, tokenizer, record: dict, context: int) -> tuple[list[int], dict]:
        """The record's prompt as token ids of at most `context - max_new_tokens`, and facts for the meta."""
        raw = _encode(tokenizer, self.template.format(context=record["context"], input=record["input"]))
        frame = chat_frame(tokenizer) if self.chat else None
        before, after = frame if frame is not None else (special_prefix(tokenizer), [])
        budget = context - self.max_new_tokens - len(before) - len(after)
        if budget < 2:
            raise InputError(f"LongBench task {self.name}: context {context} leaves {budget} prompt tokens after "
                             f"{self.max_new_tokens} generated ones and the prompt frame; use a longer context")
        ids = before + middle_truncate(raw, budget) + after
        return ids, {"raw_tokens": len(raw), "truncated": len(raw) > budget, "chat": frame is not None}

    def samples(self, tokenizer, context: int, n: int, seed: int) -> list[Sample]:
        """The first n lines of `<folder>/<task>.jsonl`; `seed` is unused (a fixed test set, in file order)."""
        out = []
        for i, rec in enumerate(self.read(n)):
            ids, facts = self.prompt_ids(tokenizer, rec, context)
            meta = {"id": rec.get("_id"), "line": rec["_line"], "length": rec.get("length"),
                    "all_classes": rec.get("all_classes"), **facts}
            refs = [str(a) for a in rec["answers"]]
            out.append(Sample(self.name, context, i, ids, refs, self.max_new_tokens, meta))
        return out

    def score(self, prediction: str, references: list[str], all_classes: list[str] | None = None) -> float:
        if self.first_line:
            prediction = prediction.lstrip("\n").split("\n")[0]
        kw = {}
        if self.metric == "classification":
            if all_classes is None and self.all_classes is None:
                self.read(1)  # the label names are the same on every line
            kw["all_classes"] = all_classes if all_classes is not None else self.all_classes
            if kw["all_classes"] is None:
                raise InputError(f"LongBench task {self.name}: its file has no all_classes")
        return METRICS[self.metric](prediction, references, **kw)


TASKS = {name: register(LongBenchTask(name, TEMPLATES[name], *SPECS[name])) for name in TEMPLATES}
