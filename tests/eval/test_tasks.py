"""The accuracy suite's runner (`dustin eval tasks`), the code-completion task and the ARR-KL study."""
from __future__ import annotations

import json

import pytest
import torch

from dustin.errors import InputError


@pytest.mark.parametrize("argv,needle", [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
    (["--contexts", "4096,x"], "--contexts must be"),
    (["--methods", "vanilla,bogus"], "unknown method bogus"),
    (["--budgets", "10"], "--budgets must be"),
    (["--samples", "0"], "--samples must be >= 1"),
    (["--config", "/nonexistent.json"], "does not exist"),
])
def test_eval_tasks_flag_errors_before_any_model_loads(capsys, tmp_path, argv, needle):
    from dustin.cli.main import main

    code = main(["eval", "tasks", "--target", str(tmp_path / "nope"), "--tasks", "code_completion", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("dustin: error:") and err.count("\n") == 1 and needle in err, err
    assert "model folder" not in err


def test_eval_tasks_refuses_a_batch_whose_caches_do_not_fit_before_building_samples(capsys, tiny_pair):
    """The batch's session caches and the shared prefill's copy are counted before any sample is built or
    prefilled: one line naming the flag, exit 3 (an out-of-memory refusal), no file written."""
    from dustin.cli.main import main

    target, draft = tiny_pair
    code = main(["eval", "tasks", "--target", str(target), "--draft", str(draft), "--tasks", "code_completion",
                 "--contexts", "500", "--samples", "100000000", "--batch-size", "100000000",
                 "--methods", "vanilla,dustin", "--budgets", "64"])
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1]
    assert code == 3 and last.startswith("dustin: error: the KV caches for 100000000 sequences"), err
    assert "held 2 times" in last and last.endswith("lower --batch-size") and "Traceback" not in err
    assert "building" not in err


def test_candidate_lines_skip_trivial_lines_comments_and_docstrings():
    from dustin.tasks.code import candidate_lines
    from dustin.tasks.metrics import first_code_line

    lines = ['def f(x):\n', '    """Doc string that is long enough\n', '    result = x + 1 inside doc\n',
             '    """\n', '    # a comment that is long enough\n', '    value = compute(x, y)\n', '    else:\n',
             '        frame_idx,\n', '    return value.total()\n', '    )\n']
    assert candidate_lines(lines) == [5, 8]  # compute(...) and return value.total()
    assert first_code_line("```python\n# note\n    y = g(x)\nz = 1\n") == "    y = g(x)"
    assert first_code_line("\n\n") == ""


def test_code_samples_fit_the_context_and_are_stable(tok):
    from dustin.tasks.code import TEMPLATE_TAIL, CodeCompletion

    task = CodeCompletion()
    a = task.samples(tok, 1500, 3, seed=4)
    b = task.samples(tok, 1500, 2, seed=4)  # sample i does not depend on n
    c = task.samples(tok, 1500, 3, seed=5)
    tail = tok.encode(TEMPLATE_TAIL, add_special_tokens=False)
    for s in a:
        assert len(s.prompt_ids) <= 1500 - task.max_new_tokens and s.prompt_ids[-len(tail):] == tail
        assert s.references[0] and s.references[0] == s.references[0].strip()
        assert s.meta["file"].endswith(".py") and s.meta["line"] >= 1
    assert [s.prompt_ids for s in a[:2]] == [s.prompt_ids for s in b]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in c]
    with pytest.raises(InputError, match="at least"):
        task.samples(tok, 200, 1, seed=0)


def test_code_metrics():
    from dustin.tasks.code import CodeCompletion

    task = CodeCompletion()
    m = task.metrics("```python\n    value = compute(x, y)\n```", ["value = compute(x, y)"])
    assert m == {"edit_sim": 1.0, "exact_match": 1.0}
    m = task.metrics("value = compute(x)", ["value = compute(x, y)"])
    # Indel ratio 2 * 18 / (18 + 21) = 0.923, rounded to a whole percent as fuzzywuzzy's ratio (LongBench's) does
    assert m == {"edit_sim": 0.92, "exact_match": 0.0}
    assert task.score("value = compute(x)", ["value = compute(x, y)"]) == 0.92


class _Task:
    def __init__(self, name):
        self.name = name


def test_summary_table_and_oracle_best():
    from dustin.eval.tasks import markdown, summarize

    p = {"tasks": [_Task("a"), _Task("b")], "contexts": [100], "rows": [
        ("vanilla", None), ("dustin-t", 64), ("dustin-d", 64), ("dustin", 64)]}
    rows = []
    scores = {("vanilla", None): (1.0, 1.0), ("dustin-t", 64): (0.5, 1.0), ("dustin-d", 64): (1.0, 0.0),
              ("dustin", 64): (0.75, 0.5)}
    for (m, k), (sa, sb) in scores.items():
        for task, s in (("a", sa), ("b", sb)):
            rows.append({"task": task, "context": 100, "method": m, "budget": k, "index": 0, "score": s,
                         "tau": None if k is None else 2.0, "agreement": None if k is None else 0.5})
    summary = summarize(rows, p)
    assert summary[("a", 100, "oracle-best", 64)]["score"] == 1.0  # dustin-d's 1.0
    assert summary[("b", 100, "oracle-best", 64)]["score"] == 1.0  # dustin-t's 1.0
    md = markdown(summary, p)
    # graded scores of one sample: a zero-width bootstrap interval; a 0/1 score of one sample: Wilson's [21, 100]
    # Δ: the paired difference to vanilla, (0.75 - 1 + 0.5 - 1) / 2 = -37.5 points (one sample: no spread)
    assert ("| dustin@64 | 75.0 [75, 75] | 50.0 [50, 50] | 62.5 [62.5, 62.5] | -37.5 [-37.5, -37.5] | 64 | 2.00 "
            "| 50% |") in md
    assert "| oracle-best@64 | 100.0 | 100.0 | 100.0 | - | - | - | - |" in md
    assert "| vanilla | 100.0 [21, 100] | 100.0 [21, 100] | 100.0 [100.0, 100.0] | - | - | - | - |" in md
    assert "n = 1 samples per task" in md and summary[("a", 100, "vanilla", None)]["n"] == 1
    # each task's own paired difference: dustin loses 25 points on a and 50 on b; oracle-best has no samples
    assert "| dustin@64 | -25.0 [-25.0, -25.0] | -50.0 [-50.0, -50.0] |" in md
    assert "| dustin-d@64 | +0.0 [+0.0, +0.0] | -100.0 [-100.0, -100.0] |" in md
    assert md.count("| oracle-best@64 |") == 1


def test_arr_kl_study_on_a_tiny_model(tiny_qwen2):
    """Subsets holding more of the true attention give outputs closer to the full cache's."""
    from dustin.eval.arr_kl import study
    from dustin.models.loader import load_model

    model = load_model(tiny_qwen2)
    prompt = torch.randint(3, 96, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    res = study(model, prompt, budget=60, subsets=12, new_tokens=6, seed=0)
    arr = [p["arr"] for p in res["points"]]
    assert len(arr) == 12 and all(0 < a < 1 for a in arr) and all(p["kl"] > 0 for p in res["points"])
    assert arr[-1] == max(arr)  # all picks from the top of the attention
    assert res["pearson"] < -0.5
    with pytest.raises(InputError, match="--budget"):
        study(model, prompt, budget=300, subsets=3, new_tokens=2, seed=0)


def _indel_ratio(a: str, b: str) -> float:
    """fuzzywuzzy's ratio / 100 by hand: 2 x LCS / (|a| + |b|) rounded to a whole percent; 1 equal, 0 one empty."""
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    row = [0] * (len(b) + 1)
    for x in a:
        prev = row[:]
        for j, y in enumerate(b, 1):
            row[j] = prev[j - 1] + 1 if x == y else max(prev[j], row[j - 1])
    return round(100 * 2 * row[-1] / (len(a) + len(b))) / 100


@pytest.mark.realmodels
@pytest.mark.slow
def test_eval_tasks_code_on_the_real_pair(tmp_path, capsys, monkeypatch, real_pair_cli, tok):
    """`dustin eval tasks` on the real pair (the shared one), resumed; every number of its rows recomputed here:
    the prediction is the decoded tokens, the score is the edit similarity of the prediction's first code line
    to the reference (by hand: 2 x LCS / total length, whole percent), exact match, dustin's agreement (its
    common prefix with vanilla's tokens over vanilla's length), and the table row that summarizes them.
    Sized for the CPU: 24 new tokens instead of LongBench's 64 (enough for the opening fence and the first code
    line the score reads; the pair never stopped before 64 on its own) and a 400-token context, whose ~370-token
    prompt still holds several times dustin's k = 64 positions."""
    from dustin.cli.main import main
    from dustin.tasks.catalog import REGISTRY

    monkeypatch.setattr(REGISTRY["code_completion"], "max_new_tokens", 24)
    out = tmp_path / "tasks.json"
    argv = ["eval", "tasks", "--tasks", "code_completion", "--contexts", "400", "--samples", "1",
            "--methods", "vanilla,dustin", "--budgets", "64", "--json-out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    first = out.read_text()
    assert main(argv) == 0  # resumed: nothing left to run, the file is unchanged
    assert out.read_text() == first
    rows = json.loads(first)["rows"]
    assert {(r["method"], r["budget"]) for r in rows} == {("vanilla", None), ("dustin", 64)}
    vanilla = next(r for r in rows if r["method"] == "vanilla")
    dustin = next(r for r in rows if r["method"] == "dustin")
    for r in rows:
        assert r["prediction"] == tok.decode(r["token_ids"], skip_special_tokens=True)
        line = next((x for x in r["prediction"].lstrip("\n").split("\n")
                     if "`" not in x and "#" not in x and "//" not in x), "").strip()
        ref = r["references"][0]
        assert r["metrics"] == {"edit_sim": _indel_ratio(line, ref), "exact_match": float(line == ref.strip())}
        assert r["score"] == r["metrics"]["edit_sim"] and 1 <= len(r["token_ids"]) <= 64
        assert len(r["token_ids"]) <= 24 and r["prompt_tokens"] > 4 * 64  # the sizes above reached the run
    n = 0
    while n < min(len(vanilla["token_ids"]), len(dustin["token_ids"])) and \
            vanilla["token_ids"][n] == dustin["token_ids"][n]:
        n += 1
    assert dustin["agreement"] == n / len(vanilla["token_ids"])
    assert vanilla["tau"] is None and vanilla["agreement"] is None and 1.0 <= dustin["tau"] <= 5.0  # Γ = 4
    assert dustin["sparse_config"].startswith("tuned:") and set(dustin["metrics"]) == {"edit_sim", "exact_match"}
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
    s, v = 100 * dustin["score"], 100 * vanilla["score"]
    printed = capsys.readouterr()
    # stderr is no terminal here: one progress line per batch run (the first call's two; the resumed call ran none)
    assert [x.split(" (")[0] for x in printed.err.splitlines() if x.startswith("[")] == [
        "[1/2] 400 vanilla x 1", "[2/2] 400 dustin@64 x 1"], printed.err
    line = next(x for x in printed.out.splitlines() if x.startswith("| dustin@64 |"))
    cells = [c.split()[0] for c in line.strip("| ").split(" | ")]  # a score cell's first word: its mean
    # the task's score, the average over tasks, Δ to vanilla on the same sample, mean k, τ, agreement
    assert cells == ["dustin@64", f"{s:.1f}", f"{s:.1f}", f"{s - v:+.1f}", "64", f"{dustin['tau']:.2f}",
                     f"{100 * dustin['agreement']:.0f}%"]
