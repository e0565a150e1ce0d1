"""`dustin bench serve`: the load generator against a live in-process server (tiny pair, CPU)."""
from __future__ import annotations

import json

import pytest

from dustin.bench.serve import percentiles
from dustin.cli.main import main


def test_bench_serve_end_to_end(tiny_pair, tmp_path, capsys):
    """Two scenarios (explicit flags override their sizes; poisson keeps its arrival rate) x two methods: no lost
    tokens, the offline Engine.generate baseline on the same prompts, a table row and a plot per scenario."""
    target, draft = tiny_pair
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--target", str(target), "--draft", str(draft), "--methods", "vanilla,magicdec",
                 "--scenario", "burst,poisson", "--prompts", "random", "--prompt-tokens", "40,200",
                 "--num-requests", "6", "--max-tokens", "9", "--max-slots", "3", "--max-context", "400",
                 "--prefill-chunk", "64", "--prefill-tokens", "128", "--json-out", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [(r["method"], r["scenario"]) for r in rows] == [
        ("vanilla", "burst"), ("vanilla", "poisson"), ("magicdec", "burst"), ("magicdec", "poisson")]
    for row in rows:
        assert row["failed"] == 0 and row["output_tokens"] == 6 * 9  # no lost tokens
        assert 6 * 40 <= row["prompt_tokens"] <= 6 * 200 and row["num_requests"] == 6
        assert row["ttft_s"]["p50"] > 0 and row["tpot_s"]["p99"] >= row["tpot_s"]["p50"] > 0
        assert row["offline_wall_s"] > 0 and row["server_vs_offline"] == pytest.approx(
            row["offline_wall_s"] / row["wall_s"]) and row["slots"] == 3
    assert rows[1]["rate"] == 4.0 and rows[0]["rate"] is None
    assert rows[1]["wall_s"] > 5 / 4 * 0.5  # poisson arrivals spread the 6 requests over about 5 / 4 s
    assert rows[2]["tau"] > 1.0
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
    assert "| poisson | magicdec |" in capsys.readouterr().out


def test_bench_serve_decode_heavy_row_from_another_process(tiny_pair, tmp_path, capsys):
    """The decode-heavy scenario (its sizes scaled down by the flags) with the requests sent from another process:
    the server's tokens/s beside Engine.generate's on the same prompts in the same run."""
    target, draft = tiny_pair
    out = tmp_path / "decode.json"
    code = main(["bench", "serve", "--target", str(target), "--draft", str(draft), "--methods", "vanilla",
                 "--scenario", "decode", "--client", "process", "--prompts", "random", "--prompt-tokens", "30,30",
                 "--num-requests", "4", "--max-tokens", "12", "--max-slots", "4", "--max-context", "128",
                 "--prefill-chunk", "32", "--prefill-tokens", "64", "--json-out", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["settings"]["client"] == "process"
    (row,) = data["results"]
    assert (row["scenario"], row["failed"], row["output_tokens"], row["prompt_tokens"]) == ("decode", 0, 48, 120)
    assert row["offline_tokens_per_s"] > 0 and row["tokens_per_s"] == pytest.approx(48 / row["wall_s"])
    assert row["server_vs_offline"] == pytest.approx(row["tokens_per_s"] / row["offline_tokens_per_s"])
    table = capsys.readouterr().out
    assert "| server tokens/s | Engine.generate wall s | Engine.generate tokens/s | server / Engine.generate |" in table
    assert f"| decode | vanilla | {row['wall_s']:.2f} | {row['tokens_per_s']:.0f} | {row['offline_wall_s']:.2f} | " \
           f"{row['offline_tokens_per_s']:.0f} | {100 * row['server_vs_offline']:.0f}% |" in table


@pytest.mark.parametrize("argv, needle", [
    (["--prompt-tokens", "9"], "MIN,MAX"),
    (["--prompt-tokens", "30,10"], "MIN <= MAX"), (["--rate", "0"], "--rate"), (["--max-slots", "0"], "--max-slots"),
    (["--scenario", "steady"], "--scenario"),
    (["--prefill-tokens", "100", "--prefill-chunk", "512"], "--prefill-tokens")])
def test_bench_serve_flag_errors_before_any_model_loads(argv, needle, capsys, tmp_path):
    code = main(["bench", "serve", "--target", str(tmp_path / "nope"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_percentiles():
    p = percentiles([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (51.0, 91.0, 100.0, 50.5)
    assert percentiles([])["p50"] is None
