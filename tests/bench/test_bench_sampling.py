"""`dustin bench sampling` on the CPU: a step greedy, sampled with one rule, and with per-row rules (the table, the
JSON, the sampler modes really taken), the sampler alone, and one error line for bad flags. Timings are not
asserted: the command reports them."""
from __future__ import annotations

import json

import pytest

from dustin.cli.main import main


def _bench(tmp_path, *argv) -> dict:
    out = tmp_path / "sampling.json"
    assert main(["bench", "sampling", "--device", "cpu", "--dtype", "fp32", "--batch", "2", "--steps", "2",
                 "--warmup", "1", "--json-out", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_bench_sampling_steps_every_mode_on_a_pair(tiny_pair, tmp_path, capsys):
    got = _bench(tmp_path, "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--method", "classic",
                 "--context", "24", "--top-p", "0.9")
    assert [(r["mode"], r["sampler_mode"], r["steps"]) for r in got["results"]] == [
        ("greedy", "uniform", 2), ("sampled", "uniform", 2), ("rows", "mixed-cut", 2)]
    assert got["results"][0]["x_greedy"] == 1.0 and all(r["ms_per_step"] > 0 for r in got["results"])
    assert (got["method"], got["batch"], got["context"], got["top_p"], got["sampler_only"]) == (
        "classic", 2, 24, 0.9, False)
    table = capsys.readouterr().out
    assert "| mode | ms/step (median) | mean | x greedy | CPU ms/step (median) | x greedy |" in table
    assert "| rows |" in table


def test_bench_sampling_of_the_sampler_alone(tmp_path):
    got = _bench(tmp_path, "--sampler-only", "--vocab", "3000", "--modes", "rows,greedy", "--top-k", "5")
    assert [(r["mode"], r["sampler_mode"]) for r in got["results"]] == [("rows", "mixed-cut"), ("greedy", "uniform")]
    assert got["vocab"] == 3000 and got["results"][1]["x_greedy"] == 1.0


@pytest.mark.parametrize("argv, message", [
    (["--modes", "greedy,bogus"], "--modes must name some of greedy, sampled, rows once each, got 'greedy,bogus'"),
    (["--temperature", "0"], "--temperature must be > 0 (the greedy mode is temperature 0), got 0.0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--target", "qwen2.5-1.5b"], "--target and --draft: both named configs (random weights) or both model folders"),
])
def test_bench_sampling_flag_errors(argv, message, capsys):
    assert main(["bench", "sampling", "--device", "cpu", *argv]) == 2
    assert capsys.readouterr().err == f"dustin: error: {message}\n"
