"""`dustin eval fidelity` end to end on the tiny pair (character tokenizer) on the CPU: every number in its JSON
is recomputed here from the token lists of the generations it ran, and the values known in closed form (a
budget holding the whole cache is full verification; full verification is lossless) are checked."""
from __future__ import annotations

import json

import pytest

from dustin.cli.main import main
from tests.conftest import without_interpreter

NEW, CONTEXT, SOURCES = 10, 160, ("argparse.py", "inspect.py")


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_eval_fidelity_numbers_follow_from_its_generations(text_pair, tmp_path, capsys, monkeypatch):
    """Guards what `eval fidelity` reports: τ of each run, "same_as_vanilla" and the first divergences (--with-vanilla),
    "same_as_classic", "mean_common_prefix" and "tau_vs_full_verify" of each sparse run, all recomputed from the
    tokens of the generations it made (recorded by wrapping Engine.generate); at k = 300 > context + new tokens
    the sparse methods select every position, so they must reproduce classic (100%, the full common prefix) and
    recover all attention (ARR 1); the lossless full-verification runs must equal vanilla. Selection runs the
    CPU's PyTorch code, as on a user's CPU (TRITON_INTERPRET unset): the interpreted selection kernel took ~80% of
    this test's time, and tests/kernels hold it to that code."""
    without_interpreter(monkeypatch)
    from dustin.engine.engine import Engine
    from dustin.eval.inputs import long_code_prompt

    seen: list[tuple[str, int | None, str, object]] = []
    generate = Engine.generate

    def recording(self, prompts, cfg, *a, **k):
        r = generate(self, prompts, cfg, *a, **k)
        if k.get("policy") is None:  # the ARR probe's run (classic's trajectory) is not one of the compared ones
            seen.append((cfg.method, cfg.budget, cfg.draft_kv, r))
        return r

    monkeypatch.setattr(Engine, "generate", recording)
    monkeypatch.setenv("COLUMNS", "200")
    target, draft = text_pair
    out = tmp_path / "fidelity.json"
    code = main(["eval", "fidelity", "--target", str(target), "--draft", str(draft), "--device", "cpu",
                 "--sources", ",".join(SOURCES), "--context", str(CONTEXT), "--methods", "dustin,streaming",
                 "--max-new-tokens", str(NEW), "--gamma", "3", "--draft-window", "24", "--budgets", "300,32",
                 "--with-vanilla", "--json-out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    data = json.loads(out.read_text())

    engine = Engine.from_pretrained(target, draft)
    assert data["prompt_tokens"] == [len(engine.pair.encode(long_code_prompt(engine.pair.tokenizer, CONTEXT, s)[0]))
                                     for s in SOURCES]
    runs = {(m, k, kv): r for m, k, kv, r in seen}
    assert len(runs) == len(seen) == 3 + 2 * 2  # classic x 2 draft caches, vanilla, 2 methods x 2 budgets
    tokens = {key: [s.token_ids for s in r.sequences] for key, r in runs.items()}
    assert all(len(t) == NEW for ts in tokens.values() for t in ts)  # EOS is a word the char tokenizer never makes
    vanilla, classic = tokens[("vanilla", None, "streaming")], tokens[("classic", None, "full")]
    full = runs[("classic", None, "streaming")]
    for name, key in (("classic", ("classic", None, "full")), ("full-verify (streaming draft)",
                                                               ("classic", None, "streaming"))):
        row, outs = data["runs"][name], tokens[key]
        assert row["tau"] == runs[key].tau
        assert row["same_as_vanilla"] == sum(o == v for o, v in zip(outs, vanilla, strict=True)) / len(vanilla)
        assert row["first_divergence_from_vanilla"] == [None if o == v else _prefix(o, v)
                                                        for o, v in zip(outs, vanilla, strict=True)]
        assert row["same_as_vanilla"] == 1.0  # full verification is lossless
    for k in (300, 32):
        for m in ("dustin", "streaming"):
            row, outs = data["runs"][f"{m}@{k}"], tokens[(m, k, "streaming")]
            assert row["tau"] == runs[(m, k, "streaming")].tau
            assert row["tau_vs_full_verify"] == pytest.approx(row["tau"] / full.tau, rel=1e-12)
            assert row["same_as_classic"] == sum(o == c for o, c in zip(outs, classic, strict=True)) / len(classic)
            assert row["mean_common_prefix"] == sum(_prefix(o, c) for o, c in zip(outs, classic, strict=True)) / 2
            first = [_prefix(o, v) for o, v in zip(outs, vanilla, strict=True)]
            assert row["first_divergence_from_vanilla"] == first
            assert row["median_first_divergence"] == sorted(first)[0] + (sorted(first)[1] - sorted(first)[0]) / 2
            if k == 300:  # every position selected: full verification
                assert row["same_as_classic"] == 1.0 and row["mean_common_prefix"] == NEW
    assert all(v == pytest.approx(1.0, abs=1e-5) for v in data["arr"]["300"].values())
    arr = data["arr"]["32"]
    assert set(arr) == {"oracle-topk", "oracle", "dustin", "streaming"} and all(0 < v < 1 for v in arr.values())
    assert arr["oracle-topk"] >= max(arr.values()) - 1e-6  # Eq. 3's top-k bounds every set of k positions
    r = data["runs"]["streaming@32"]
    line = next(x for x in printed.out.splitlines() if "streaming@32" in x)
    assert [c.strip() for c in line.split("│")[1:-1]] == [
        "streaming@32", f"{r['tau']:.3f}", f"{r['tau_vs_full_verify']:.3f}", f"{100 * r['same_as_classic']:.0f}%",
        f"{r['mean_common_prefix']:.1f}", f"{r['median_first_divergence']:g}"]
