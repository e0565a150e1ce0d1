"""`dustin eval needles`: flag errors before any model loads, resuming from --json-out, the prompt layout, and
one tiny run on the real default pair (skipped unless fetched)."""
from __future__ import annotations

import json

import pytest

from dustin.cli.main import main
from dustin.errors import InputError

NO_MODEL = ["--target", "/nonexistent/model"]  # reaching the model load would fail differently


@pytest.mark.parametrize("flags, message", [
    (["--contexts", "8192,0"], "--contexts must be a comma-separated list of integers >= 1, got '8192,0'"),
    (["--contexts", "8k"], "--contexts must be a comma-separated list of integers >= 1, got '8k'"),
    (["--budgets", "512,20"],
     "--budgets must be a comma-separated list of integers >= 21 or auto:P with P in (0, 1], got '512,20'"),
    (["--methods", "vanilla,foo"], "--methods: unknown method foo; choose from vanilla,"),
    (["--depths", "0"], "--depths must be >= 1 (prompts per kind and context), got 0"),
    (["--kinds", "single,triple"], "--kinds must be a comma-separated subset of single, multikey"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["--config", "/nonexistent.json"], "sparse config /nonexistent.json does not exist"),
    (["--config", "/"], "sparse config / is a directory"),
])
def test_flag_errors_before_loading(flags, message, capsys):
    assert main(["eval", "needles", *NO_MODEL, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dustin: error: {message}") and "\n" not in err


def _args(tmp_path, **over):
    flags = {"--contexts": "500", "--depths": "1", "--kinds": "single", "--methods": "vanilla",
             "--budgets": "64", "--max-new-tokens": "8", "--json-out": str(tmp_path / "n.json"), **over}
    return ["eval", "needles", *NO_MODEL, *[x for kv in flags.items() for x in kv]]


def test_finished_file_is_not_rerun_and_other_settings_are_refused(tmp_path, capsys):
    settings = {"target": "/nonexistent/model", "draft": "default", "dtype": "auto", "gamma": 4, "draft_window": 512,
                "max_new_tokens": 8, "seed": 0, "needles": "heldout", "depths": 1, "config": None}
    row = {"kind": "single", "context": 500, "method": "vanilla", "budget": None, "score": 1.0, "tau": None,
           "samples": []}
    (tmp_path / "n.json").write_text(json.dumps({"settings": settings, "rows": [row]}))
    assert main(_args(tmp_path)) == 0  # nothing left to do: no model load (the target does not exist)
    assert "vanilla" in capsys.readouterr().out
    assert main(_args(tmp_path, **{"--max-new-tokens": "16"})) == 2
    assert "holds results for other settings (max_new_tokens differ)" in capsys.readouterr().err
    assert main(_args(tmp_path, **{"--contexts": "500,600"})) == 2  # a missing row: the model load is reached
    assert "model folder /nonexistent/model does not exist" in capsys.readouterr().err


def test_depths_whose_caches_do_not_fit_are_refused_before_any_prompt_is_built(tiny_pair, capsys):
    """The depths are one batch: its session caches and the shared prefill's copy are counted right after the
    model loads, one line naming the flag, before any prompt is built (no haystack text is needed to get there)."""
    target, draft = tiny_pair
    code = main(["eval", "needles", "--target", str(target), "--draft", str(draft), "--contexts", "400",
                 "--depths", "100000000", "--kinds", "single", "--methods", "vanilla,dustin", "--budgets", "64"])
    err = capsys.readouterr().err.strip()
    assert code == 3 and err.startswith("dustin: error: the KV caches for 100000000 sequences") and "\n" not in err
    assert "held 2 times" in err and err.endswith("lower --depths")


def test_multikey_prompts_place_four_needles_and_ask_the_right_one(tok):
    from dustin.eval.needles import HELDOUT_NEEDLES
    from dustin.eval.retrieval import build_prompts

    try:
        prompts = build_prompts(tok, "multikey", 1500, 5, HELDOUT_NEEDLES, seed=0)
    except InputError as e:
        pytest.skip(f"essays not available: {e}")
    assert [p.depth for p in prompts] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for i, p in enumerate(prompts):
        assert len(p.spans) == 4 and p.answer == HELDOUT_NEEDLES[i].answer
        facts = [tok.decode(p.ids[s:e]).strip() for s, e in p.spans]
        assert facts[p.asked] == HELDOUT_NEEDLES[i].fact and len(set(facts)) == 4
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(p.spans, p.spans[1:], strict=False))
    single = build_prompts(tok, "single", 1500, 3, HELDOUT_NEEDLES, seed=0)
    assert [len(p.spans) for p in single] == [1, 1, 1] and [p.depth for p in single] == [0.0, 0.5, 1.0]


@pytest.mark.realmodels
@pytest.mark.slow
def test_needles_on_the_real_pair(tmp_path, capsys, real_pair_cli):
    out = tmp_path / "needles.json"
    argv = ["eval", "needles", "--contexts", "400", "--depths", "1", "--kinds", "single", "--rows",
            "vanilla,dustin@64,dustin@auto:0.9", "--budget-min", "32", "--budget-max", "256",
            "--max-new-tokens", "8", "--json-out", str(out)]
    try:
        code = main(argv)
    except InputError as e:  # the held-out essays could not be downloaded
        pytest.skip(str(e))
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["settings"]["max_new_tokens"] == 8
    rows = {(r["method"], r["budget"]): r for r in data["rows"]}
    assert set(rows) == {("vanilla", None), ("dustin", 64), ("dustin", "auto:0.9")}
    for r in rows.values():
        assert r["kind"] == "single" and r["context"] == 400 and 0.0 <= r["score"] <= 1.0
        assert len(r["samples"]) == 1 and r["samples"][0]["depth"] == 0.5
        s = r["samples"][0]
        assert isinstance(s["prediction"], str) and s["answer"] and abs(s["prompt_tokens"] - 400) <= 32
        assert s["retrieved"] == (s["rouge1_recall"] > 0.5)
    assert rows[("vanilla", None)]["tau"] is None and rows[("dustin", 64)]["tau"] >= 1.0
    k = rows[("dustin", "auto:0.9")]["budget_k"]  # the k it used, within --budget-min / --budget-max
    assert k["samples"] > 0 and 32 <= k["p50"] <= k["p99"] <= 256 and 32 <= k["mean"] <= 256
    vanilla = rows[("vanilla", None)]["samples"][0]
    assert vanilla["retrieved"]  # 400 tokens: the pair finds its needle
    for budget in (64, "auto:0.9"):  # and sparse verification finds it too
        assert rows[("dustin", budget)]["samples"][0]["retrieved"] == vanilla["retrieved"], budget
    table = capsys.readouterr().out
    assert "vanilla" in table and "dustin@64" in table and "dustin@auto:0.9" in table
    assert main(argv) == 0  # resumed: every row is there, nothing runs
    assert json.loads(out.read_text()) == data
