"""`dustin eval tasks` with auto:P budgets: parsing, which rows run, the mean k and the paired difference to the
lossless row, each checked against values computed by hand."""
from __future__ import annotations

import json

import pytest

from dustin.errors import InputError


def test_budget_list_parses_fixed_and_auto_entries():
    from dustin.flags import auto_p, budget_list

    assert budget_list("--budgets", "512,auto:0.9, 256,auto,512,auto:0.90") == [512, "auto:0.9", 256, "auto:0.95"]
    assert [auto_p(k) for k in (512, "auto:0.9", None)] == [None, 0.9, None]
    for bad in ("10", "auto:0", "auto:1.5", "auto:x", "k", ","):
        with pytest.raises(InputError, match="--budgets must be"):
            budget_list("--budgets", bad)


class _Task:
    def __init__(self, name):
        self.name = name


def _args(**kw):
    from argparse import Namespace

    base = dict(tasks="niah_single_1,vt", contexts="4096", budgets="256,auto:0.9", methods="vanilla,dustin,quest",
                samples=2, batch_size=4, gamma=4, draft_window=512, config=None, seed=0, budget_min=128,
                budget_max=1024, budget_dense=False, target="default", draft="default", dtype="auto",
                longbench_dir=None, report_only=False)
    base.update(kw)
    return Namespace(**base)


def test_auto_rows_only_for_dustin_methods_and_their_settings():
    from dustin.eval.sweep import row_config as generation_config
    from dustin.eval.sweep import row_params
    from dustin.eval.tasks import plan

    p = plan(_args())
    assert p["rows"] == [("vanilla", None), ("dustin", 256), ("quest", 256), ("dustin", "auto:0.9")]
    assert p["settings"]["budget_range"] == [128, 1024]
    cfg = generation_config("dustin", "auto:0.9", _args())
    assert (cfg.budget, cfg.budget_p, cfg.budget_min, cfg.budget_max) == ("auto", 0.9, 128, 1024)
    params = row_params(32)  # every row's sampling: greedy, the tasks' answer length at most
    assert (params.max_tokens, params.temperature) == (32, 0)
    assert generation_config("quest", 256, _args()).budget == 256
    # --budget-dense reaches the auto rows (and is recorded with the results), never a fixed-k row
    assert p["settings"]["budget_dense"] is False and plan(_args(budget_dense=True))["settings"]["budget_dense"]
    assert generation_config("dustin", "auto:0.9", _args(budget_dense=True)).budget_dense
    assert not generation_config("dustin", 256, _args(budget_dense=True)).budget_dense
    assert "budget_range" not in plan(_args(budgets="256"))["settings"]  # older result files still resume
    with pytest.raises(InputError, match="add dustin"):
        plan(_args(methods="vanilla,quest"))
    with pytest.raises(InputError, match="budget-min"):
        plan(_args(budget_min=2048))


def test_eval_tasks_rejects_a_bad_auto_budget_before_loading(capsys, tmp_path):
    from dustin.cli.main import main

    code = main(["eval", "tasks", "--target", str(tmp_path / "nope"), "--tasks", "vt", "--budgets", "auto:2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("dustin: error:") and "--budgets must be" in err and err.count("\n") == 1


def _rows():
    """Two tasks x 3 samples; dustin@auto:0.9 ran in two batches whose k histograms differ."""
    vanilla = {"a": [1, 1, 0], "b": [0.5, 1.0, 0.25]}
    auto = {"a": [1, 0, 0], "b": [0.5, 0.5, 0.25]}
    rows = []
    for method, budget, scores in (("vanilla", None, vanilla), ("dustin", "auto:0.9", auto)):
        for task, xs in scores.items():
            for i, x in enumerate(xs):
                k = None
                if budget is not None:  # samples 0, 1 in a batch of mean k 300 over 40 steps, sample 2: 600 over 10
                    k = {"mean": 300.0, "samples": 40} if i < 2 else {"mean": 600.0, "samples": 10}
                rows.append({"task": task, "context": 100, "method": method, "budget": budget, "index": i,
                             "score": float(x), "tau": None if budget is None else 2.5,
                             "agreement": None if budget is None else 0.5, "budget_k": k})
    return rows


def test_mean_k_and_paired_difference_by_hand(tmp_path):
    from dustin.eval.tasks import markdown, plot, row_average, summarize, summary_records

    p = {"tasks": [_Task("a"), _Task("b")], "contexts": [100], "rows": [("vanilla", None), ("dustin", "auto:0.9")]}
    summary = summarize(_rows(), p)
    # per task: (4 rows of k 300 x 40 steps + 2 rows of 600 x 10) / (4 x 40 + 2 x 10) ... per task 2 + 1 rows:
    # (2 * 300 * 40 + 600 * 10) / (2 * 40 + 10) = 30000 / 90
    assert summary[("a", 100, "dustin", "auto:0.9")]["k"] == pytest.approx(30000 / 90)
    row = row_average(summary, ["a", "b"], 100, "dustin", "auto:0.9")
    # a: 1/3 - 2/3 = -1/3; b: 1.25/3 - 1.75/3 = -1/6; average -0.25
    assert row["delta"] == pytest.approx(-0.25) and row["score"] == pytest.approx((1 / 3 + 1.25 / 3) / 2)
    lo, hi = row["delta_ci"]
    assert lo <= -0.25 <= hi and hi <= 0  # every paired difference is <= 0
    assert row["k"] == pytest.approx(30000 / 90)
    md = markdown(summary, p)
    assert "| dustin@auto:0.9 |" in md and f"| {30000 / 90:.0f} | 2.50 | 50% |" in md and "| -25.0 [" in md
    records = summary_records(summary, p)
    avg = next(r for r in records if r["task"] == "avg" and r["method"] == "dustin")
    assert avg["delta"] == pytest.approx(-0.25) and avg["mean_k"] == pytest.approx(30000 / 90)
    json.dumps(records)  # the .summary.json is plain JSON
    plot(summary, p, tmp_path / "front.png")
    assert (tmp_path / "front.png").stat().st_size > 1000


def test_a_fixed_budget_row_that_reports_what_it_read_shows_that(tmp_path):
    """The sampled-tail rows report the positions they read (the adaptive ones fewer than their budget): the mean k
    column shows the measured mean; a fixed row without a report shows its budget."""
    from dustin.eval.tasks import row_average, summarize

    rows = [dict(r, method="oracle-dustin-tail-auto", budget=256) for r in _rows() if r["method"] == "dustin"]
    rows += [dict(r, method="dustin", budget=128, budget_k=None) for r in _rows() if r["method"] == "dustin"]
    p = {"tasks": [_Task("a"), _Task("b")], "contexts": [100],
         "rows": [("oracle-dustin-tail-auto", 256), ("dustin", 128)]}
    summary = summarize(rows, p)
    assert row_average(summary, ["a", "b"], 100, "oracle-dustin-tail-auto", 256)["k"] == pytest.approx(30000 / 90)
    assert row_average(summary, ["a", "b"], 100, "dustin", 128)["k"] == 128


def test_needles_sweep_takes_auto_budgets_and_fidelity_refuses_them(capsys, tmp_path):
    from dustin.cli.main import main
    from dustin.eval.retrieval import plan

    args = _args(contexts="8192", kinds="single", depths=3, methods="vanilla,dustin,quest", budgets="512,auto:0.9",
                 needles="heldout", max_new_tokens=32)
    p = plan(args)
    assert p["rows"] == [("vanilla", None), ("dustin", 512), ("quest", 512), ("dustin", "auto:0.9")]
    assert p["settings"]["budget_range"] == [128, 1024]
    code = main(["eval", "fidelity", "--target", str(tmp_path / "nope"), "--budgets", "512,auto:0.9"])
    err = capsys.readouterr().err
    assert code == 2 and "--budgets must be a comma-separated list of integers >= 21" in err


def test_explicit_rows():
    from dustin.eval.tasks import plan

    p = plan(_args(rows="dustin@512,vanilla,quest@256,dustin@auto:0.9,dustin@512"))
    assert p["rows"] == [("vanilla", None), ("dustin", 512), ("quest", 256), ("dustin", "auto:0.9")]
    assert "budget_range" not in plan(_args(rows="vanilla,quest@256"))["settings"]
    for bad, needle in (("vanilla@512", "takes no @budget"), ("dustin", "needs one"), ("foo@512", "unknown method"),
                        ("quest@auto:0.9", "budget auto"), ("dustin@12", "--rows must be")):
        with pytest.raises(InputError, match=needle):
            plan(_args(rows=bad))
