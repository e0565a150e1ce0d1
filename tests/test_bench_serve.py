"""`dustin bench serve`: the load generator against a live in-process server (tiny pair, CPU)."""
from __future__ import annotations

import json

import pytest

from dustin.bench.serve import percentiles
from dustin.cli.main import main


def test_bench_serve_end_to_end(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--target", str(target), "--draft", str(draft), "--methods", "vanilla,magicdec",
                 "--prompts", "random", "--prompt-tokens", "40,200", "--num-requests", "10", "--rate", "inf",
                 "--max-tokens", "9", "--max-slots", "3", "--max-context", "400", "--prefill-chunk", "64",
                 "--json-out", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert len(data["prompt_tokens"]) == 10 and all(40 <= n <= 200 for n in data["prompt_tokens"])
    for row in data["results"]:
        assert row["failed"] == 0 and row["output_tokens"] == 10 * 9  # no lost tokens
        assert row["ttft_s"]["p50"] > 0 and row["tpot_s"]["p99"] >= row["tpot_s"]["p50"] > 0
        assert row["offline_tokens_per_s"] > 0 and row["slots"] == 3
    assert [r["method"] for r in data["results"]] == ["vanilla", "magicdec"]
    assert data["results"][1]["tau"] > 1.0
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
    assert "| magicdec |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--methods", "quest"], "offline-only"), (["--prompt-tokens", "9"], "MIN,MAX"),
    (["--prompt-tokens", "30,10"], "MIN <= MAX"), (["--rate", "0"], "--rate"), (["--max-slots", "0"], "--max-slots")])
def test_bench_serve_flag_errors_before_any_model_loads(argv, needle, capsys, tmp_path):
    code = main(["bench", "serve", "--target", str(tmp_path / "nope"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_percentiles():
    p = percentiles([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (51.0, 91.0, 100.0, 50.5)
    assert percentiles([])["p50"] is None
