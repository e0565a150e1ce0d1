"""`dustin bench e2e --real`: the real-weights mode end to end on the tiny pair (CPU), its flag errors, and the
exactness of the prefill it shares between methods."""
from __future__ import annotations

import json

import pytest

from dustin.cli.main import main
from tests.conftest import on_cpu_paths
from tests.offline import offline


@pytest.fixture
def cpu_selection():
    """The CPU's PyTorch selection and estimation for one test (`on_cpu_paths`; the module's other tests keep the
    interpreter): a benchmark run that checks what the benchmark reports, not the kernels. The interpreted
    selection kernel (a bitonic sort per sequence and step, tests/kernels hold it to the PyTorch code) took most of
    these tests' time."""
    with on_cpu_paths():
        yield


def _kinds() -> list[str]:
    """code always (Python sources of this machine); prose when the essays data package is at hand."""
    from dustin.data import corpora
    from dustin.errors import InputError

    try:
        corpora.essays("heldout")
        return ["code", "prose"]
    except InputError:
        return ["code"]


def test_bench_e2e_real_end_to_end(text_pair, tmp_path, capsys, cpu_selection):
    """Every row's fields are there, and agree with one another as their definitions say: tokens/s = τ x batch /
    (ms/step), τ x batch x steps a whole number of tokens, the speedup the ratio of the tokens/s of the row and
    of its group's vanilla row, the roofline share the bytes a step reads at the run's read-only bandwidth over the
    measured step time, the timed phases inside the step, the draft's ms per forward and read rate from its phase."""
    target, draft = text_pair
    kinds = _kinds()
    out, png = tmp_path / "real.json", tmp_path / "real.png"
    code = main(["bench", "e2e", "--real", "--device", "cpu", "--target", str(target), "--draft", str(draft),
                 "--prompts", ",".join(kinds), "--contexts", "64,96", "--batches", "2", "--steps", "2",
                 "--warmup", "1", "--gamma", "3", "--budget", "32", "--draft-window", "24",
                 "--json-out", str(out), "--plot-out", str(png)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    data = json.loads(out.read_text())
    assert data["label"] == "real weights" and data["device"] == "cpu" and data["date"]
    assert data["models"] == {"target": "target", "draft": "draft"}
    assert data["settings"]["real"] is True and data["settings"]["steps"] == 2
    rows = data["results"]
    methods = ["vanilla", "classic", "magicdec", "streaming", "dustin"]
    assert [(r["prompts"], r["batch"], r["context"], r["method"]) for r in rows] == [
        (k, 2, c, m) for k in kinds for c in (64, 96) for m in methods]
    for r in rows:
        assert r["prompt_tokens"] == r["context"] and r["steps"] == 2 and r["accept_prob"] is None
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["warmup_s"] > 0
        assert r["phases_ms_per_step"] and r["speedup_vs_vanilla"] > 0
        b = r["bytes_per_step"]
        assert b["total"] == b["target"] + b["draft"] + b["estimate"] > 0 and r["pct_of_byte_roofline"] > 0
        if r["method"] == "vanilla":
            assert r["tau"] == 1.0 and r["speedup_vs_vanilla"] == 1.0 and b["draft"] == 0
        else:
            assert b["draft"] > 0 and r["tau"] <= 4.0
        assert (b["estimate"] > 0) == (r["method"] == "dustin")
    bw = data["settings"]["read_bw"]
    vanilla = {(r["prompts"], r["context"]): r for r in rows if r["method"] == "vanilla"}
    for r in rows:
        per_step = r["ms_per_step"] / 1e3
        assert r["tokens_per_s"] == pytest.approx(r["tau"] * r["batch"] / per_step, rel=2e-3), r
        tokens = r["tau"] * r["batch"] * r["steps"]  # every row decodes every timed step (EOS ignored)
        assert abs(tokens - round(tokens)) <= r["batch"] * r["steps"] * 5e-4, r
        base = vanilla[(r["prompts"], r["context"])]["tokens_per_s"]
        assert r["speedup_vs_vanilla"] == pytest.approx(r["tokens_per_s"] / base, rel=2e-3, abs=1e-3), r
        seconds = r["bytes_per_step"]["total"] / bw
        assert r["roofline_ms_per_step"] == pytest.approx(1e3 * seconds, rel=5e-4)
        # ms_per_step is rounded to 1 us and the percentage to 4 significant digits: the exact value lies between
        # these bounds
        lo, hi = (100 * seconds / ((r["ms_per_step"] + d) / 1e3) for d in (5e-4, -5e-4))
        assert lo * (1 - 5e-4) <= r["pct_of_byte_roofline"] <= hi * (1 + 5e-4), r
        assert 0 < sum(r["phases_ms_per_step"].values()) <= 1.1 * r["ms_per_step"] + 0.5, r
        if r["method"] != "vanilla":  # eager forwards on the CPU: the draft's phase is timed apart
            draft_s = r["phases_ms_per_step"]["draft"] / 1e3
            assert r["draft_ms_per_forward"] == pytest.approx(1e3 * draft_s / 3, rel=1e-3, abs=1e-4)
            assert r["draft_read_gb_s"] == pytest.approx(r["bytes_per_step"]["draft"] / draft_s / 1e9, rel=1e-2,
                                                          abs=0.1)
            assert r["draft_pct_of_read_bw"] == pytest.approx(100 * r["bytes_per_step"]["draft"] / draft_s / bw,
                                                              rel=1e-2, abs=0.1)
        else:
            assert "draft_ms_per_forward" not in r
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| code | 2 | 96 | dustin |" in printed.out


def test_real_prompts_are_exact_and_distinct(text_pair):
    from transformers import AutoTokenizer

    from dustin.bench.e2e import real_prompts

    tok = AutoTokenizer.from_pretrained(str(text_pair[0]))
    four = real_prompts(tok, "code", 80, 4, seed=0)
    assert [len(p) for p in four] == [80] * 4 and len({tuple(p) for p in four}) == 4
    assert real_prompts(tok, "code", 80, 2, seed=0) == four[:2]  # a smaller batch is a prefix of a larger one


def test_shared_prefill_is_exact(text_pair, cpu_selection):
    """A greedy session through the shared PrefillCache (as the benchmark runs every method) decodes exactly what
    a session with its own fresh prefill does, also when run twice; lossless methods agree with vanilla."""
    from transformers import AutoTokenizer

    from dustin.bench.e2e import real_prompts
    from dustin.engine.engine import Engine
    from dustin.engine.offline.prefill import PrefillCache

    engine = Engine.from_pretrained(text_pair[0], text_pair[1])
    prompts = real_prompts(AutoTokenizer.from_pretrained(str(text_pair[0])), "code", 72, 3, seed=1)

    def outputs(method, cache):
        cfg, params = offline(method=method, gamma=3, max_new_tokens=17, stop_at_eos=False, budget=32,
                               draft_window=24)
        core = engine.start(prompts, cfg, params, prefill_cache=cache)
        ids = {}
        outs = [o for _ in range(4) for o in core.step()]  # the prefill and 4 steps
        core.drain()
        outs += core.step()  # it returns what the drained step booked (and launches a fifth)
        for o in outs:
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [ids[k] for k in sorted(ids, key=lambda k: int(k.split("-")[1]))]

    shared = PrefillCache()
    methods = ("vanilla", "classic", "magicdec", "dustin")
    first = {m: outputs(m, shared) for m in methods}
    assert shared.state is not None and shared.state.draft_kv is not None
    for m in methods:
        assert outputs(m, shared) == first[m] == outputs(m, None), m
    for m in ("classic", "magicdec"):  # greedy speculative decoding is lossless: vanilla's tokens, more per step
        assert all(len(o) >= len(v) and o[:len(v)] == v for o, v in zip(first[m], first["vanilla"], strict=True)), m


@pytest.mark.parametrize("argv, needle", [
    (["--accept-prob", "0.5"], "--accept-prob sets acceptance control"),
    (["--tau", "2.2"], "--tau sets acceptance control"),
    (["--pairs", "qwen2.5-7b:qwen2.5-0.5b"], "--pairs names random-weight pairs"),
    (["--prompts", "code,poetry"], "--prompts wants kinds from code, prose"),
    (["--contexts", "5000"], "past the model context (4096 positions)"),
    (["--contexts", "17000", "--rope-scaling", "yarn:4"], "past the model context (16384 positions)"),  # 4 x 4096
    (["--steps", "0"], "--steps >= 1"),
])
def test_bench_e2e_real_bad_flags(text_pair, capsys, argv, needle):
    target, draft = text_pair
    code = main(["bench", "e2e", "--real", "--device", "cpu", "--target", str(target), "--draft", str(draft), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, needle", [
    (["--real", "--target", "/nonexistent/model"], "does not exist"),
    (["--prompts", "code"], "apply to --real"),
    (["--methods", "vanilla,snapkv"], "unknown methods ['snapkv']"),
])
def test_bench_e2e_model_and_mode_errors(capsys, argv, needle):
    code = main(["bench", "e2e", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err


def test_bench_e2e_real_without_the_default_pair(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DUSTIN_HOME", str(tmp_path))
    code = main(["bench", "e2e", "--real", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "dustin models fetch" in err, err


def test_bench_e2e_random_weights_share_the_timing(tiny_pair, tmp_path, capsys):
    """The acceptance-controlled mode runs through the same per-method timing: its rows carry the same fields."""
    target, draft = tiny_pair
    out = tmp_path / "random.json"
    code = main(["bench", "e2e", "--device", "cpu", "--pairs", f"{target}:{draft}", "--contexts", "64",
                 "--batches", "2", "--steps", "2", "--warmup", "1", "--gamma", "3", "--tau", "2.0",
                 "--json-out", str(out), "--plot-out", str(tmp_path / "random.png")])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    data = json.loads(out.read_text())
    assert data["label"] == "acceptance-controlled" and "target" not in data["settings"]
    assert [r["method"] for r in data["results"]] == ["vanilla", "classic", "magicdec", "dustin"]
    for r in data["results"]:
        assert {"warmup_s", "bytes_per_step", "pct_of_byte_roofline", "phases_ms_per_step"} <= set(r)
        assert (r["accept_prob"] is None) == (r["method"] == "vanilla")
    assert "| 2 | 64 | dustin |" in printed.out and (tmp_path / "random.png").is_file()
    assert all(r["budget_k"] is None for r in data["results"])  # fixed k: nothing to report


def test_bench_e2e_reports_the_k_of_an_auto_budget(tiny_pair, tmp_path):
    """--budget auto: each row carries the k of its timed steps (the warm-up's are not counted)."""
    target, draft = tiny_pair
    out = tmp_path / "auto.json"
    code = main(["bench", "e2e", "--device", "cpu", "--pairs", f"{target}:{draft}", "--contexts", "96",
                 "--batches", "2", "--steps", "3", "--warmup", "2", "--gamma", "3", "--tau", "2.0", "--methods",
                 "dustin", "--budget", "auto", "--budget-min", "21", "--budget-max", "64", "--draft-window", "32",
                 "--json-out", str(out), "--plot-out", str(tmp_path / "auto.png")])
    assert code == 0
    k = json.loads(out.read_text())["results"][0]["budget_k"]
    assert k["samples"] == 2 * 3 and 21 <= k["p50"] <= 64  # 2 sequences x 3 timed steps


def test_bench_e2e_reports_the_gammas_of_gamma_auto(tiny_pair, tmp_path):
    """--gamma auto: each speculative row carries how many sequence steps of its timed steps took each Γ (the
    warm-up's not counted), and no byte roofline (its steps differ in what they read)."""
    target, draft = tiny_pair
    out = tmp_path / "gamma_auto.json"
    code = main(["bench", "e2e", "--device", "cpu", "--pairs", f"{target}:{draft}", "--contexts", "96",
                 "--batches", "2", "--steps", "3", "--warmup", "2", "--gamma", "auto", "--tau", "3.0", "--methods",
                 "vanilla,magicdec", "--draft-window", "32", "--json-out", str(out)])
    assert code == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    steps = rows["magicdec"]["gamma_steps"]
    assert sum(steps.values()) == 2 * 3 and all(0 <= int(g) <= 6 for g in steps)
    costs = rows["magicdec"]["step_costs_ms"]  # the measured cost model at the row's context, every Γ it may take
    assert sorted(map(int, costs)) == list(range(0, 7)) and all(v > 0 for v in costs.values())
    assert "gamma_steps" not in rows["vanilla"] and "pct_of_byte_roofline" in rows["vanilla"]
    assert "pct_of_byte_roofline" not in rows["magicdec"]


def test_bench_e2e_per_layer_baselines(tiny_pair, tmp_path, capsys, cpu_selection):
    """quest and specattn (graph-safe now: their steps replay as one CUDA graph on a GPU) have speed rows, with
    their estimation bytes counted (page statistics; every draft layer's keys)."""
    target, draft = tiny_pair
    out = tmp_path / "baselines.json"
    code = main(["bench", "e2e", "--device", "cpu", "--pairs", f"{target}:{draft}", "--contexts", "96",
                 "--batches", "2", "--steps", "2", "--warmup", "1", "--gamma", "3", "--tau", "2.0", "--budget", "32",
                 "--methods", "vanilla,quest,specattn", "--json-out", str(out), "--plot-out", str(tmp_path / "b.png")])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"vanilla", "quest", "specattn"}
    assert rows["quest"]["bytes_per_step"]["estimate"] > 0 and rows["specattn"]["bytes_per_step"]["estimate"] > 0
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
