"""The top-level Python API (`from dustin import LLM, SamplingParams`): same tokens as `Engine.generate`, per-prompt
parameters, prompt order across sampling groups, bad input, a cheap `import dustin`, and README's example run as
written on the real pair."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dustin import LLM, RequestResult, SamplingParams
from dustin.engine.config import GenerationConfig
from dustin.errors import InputError
from tests.conftest import without_interpreter
from tests.offline import offline

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm(tiny_pair):
    target, draft = tiny_pair
    return LLM(str(target), str(draft), method="classic", gamma=3, device="cpu", dtype="fp32")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def _ids(results):
    return [r.token_ids for r in results]


def test_greedy_equals_engine_generate(llm):
    prompts = _prompts([5, 23, 40])
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    ref = llm.engine.generate(prompts, *offline(method="classic", gamma=3, max_new_tokens=20,
                                                        stop_at_eos=False))
    assert all(isinstance(r, RequestResult) for r in out)
    assert _ids(out) == [s.token_ids for s in ref.sequences]
    assert [r.text for r in out] == [s.text for s in ref.sequences]
    assert [r.prompt_token_ids for r in out] == prompts
    assert all(len(r.token_ids) == 20 and r.finish_reason == "length" for r in out)
    m = out[0].metrics
    assert (m.method, m.dtype) == ("classic", "float32")
    assert 1.0 <= m.tau <= 4 and m.steps > 0 and m.tokens_per_s > 0 and m.decode_s > 0
    assert len({tuple(i) for i in _ids(out)}) == 3  # the outputs differ per prompt: the equality means something


def test_default_sampling_params_are_vllms(llm):
    """`SamplingParams()` has vLLM's defaults: temperature 1.0, so a call without params samples (unseeded rows
    take their seeds from the call's stream: a call is reproducible) and is not the greedy output."""
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.ignore_eos) == (16, 1.0, 1.0, 0, None, False)
    prompts = _prompts([12, 18], seed=4)
    default = llm.generate(prompts)
    assert _ids(llm.generate(prompts)) == _ids(default)
    assert _ids(default) != _ids(llm.generate(prompts, SamplingParams(temperature=0)))


def test_eos_stops_and_is_reported(llm):
    """ignore_eos off: a sequence that emits an EOS id ends there with finish_reason "stop"; the others run to
    max_tokens ("length")."""
    prompts = _prompts([10, 20, 30], seed=1)
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
    eos = full[1].token_ids[6]  # a token the second sequence emits early becomes the stop token
    saved, llm.engine.pair.eos_ids = llm.engine.pair.eos_ids, {eos}
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=25))
        ref = llm.engine.generate(prompts, *offline(method="classic", gamma=3, max_new_tokens=25))
        ignored = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
    finally:
        llm.engine.pair.eos_ids = saved
    assert _ids(out) == [s.token_ids for s in ref.sequences]
    for f, r in zip(full, out, strict=True):
        stopped = eos in f.token_ids
        assert r.token_ids == (f.token_ids[: f.token_ids.index(eos) + 1] if stopped else f.token_ids)
        assert r.finish_reason == ("stop" if stopped else "length")
    assert out[1].finish_reason == "stop"
    assert _ids(ignored) == _ids(full) and all(r.finish_reason == "length" for r in ignored)


def test_per_prompt_max_tokens(llm):
    prompts = _prompts([7, 30, 12], seed=2)
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    caps = [5, 15, 1]
    out = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in caps])
    assert [len(r.token_ids) for r in out] == caps
    # greedy output does not depend on the batch: each is the prefix of the same prompt's longer run
    assert _ids(out) == [f.token_ids[:m] for f, m in zip(full, caps, strict=True)]


def test_per_request_params_in_one_batch(llm):
    """Greedy and seeded sampled prompts interleaved in one batch, each with its own SamplingParams: results in
    prompt order; each prompt's tokens are those of the same prompt run alone with the same params (greedy rows, and
    seeded sampled rows, do not depend on the batch); a seeded call is reproducible, another seed gives other
    tokens."""
    prompts = _prompts([9, 14, 21, 6], seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=7 + i, ignore_eos=True) for i in (0, 1)]
    params = [greedy, sampled[0], greedy, sampled[1]]
    out = llm.generate(prompts, params)
    assert [r.prompt_token_ids for r in out] == prompts
    alone = [llm.generate([p], rp)[0].token_ids for p, rp in zip(prompts, params, strict=True)]
    assert _ids(out) == alone
    assert [len(r.token_ids) for r in out] == [12, 10, 12, 10]
    assert out[0].metrics is out[1].metrics  # one batch, its statistics
    assert _ids(llm.generate(prompts, params)) == _ids(out)
    other = llm.generate([prompts[1]], SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=8,
                                                      ignore_eos=True))
    assert other[0].token_ids != out[1].token_ids


def test_single_prompt_forms(llm):
    """One list of ints is one prompt, as is `[ids]`; (text prompts: the tiny tokenizer encodes none, README's
    example on the real pair covers them)."""
    ids = _prompts([8], seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_ids = llm.generate(ids, params)
    assert len(by_ids) == 1 and by_ids[0].prompt_token_ids == ids and len(by_ids[0].token_ids) == 6
    assert by_ids[0].text == llm.tokenizer.decode(by_ids[0].token_ids, skip_special_tokens=True)
    assert llm.generate(tuple(ids), params)[0].token_ids == by_ids[0].token_ids
    assert llm.generate([ids], params)[0].token_ids == by_ids[0].token_ids
    assert len(llm.generate([ids])[0].token_ids) <= 16  # params None: SamplingParams(), 16 tokens


def test_default_method_and_vanilla(tiny_pair, llm, monkeypatch):
    """The default method (dustin, sparse verification) goes through the same `Engine.generate`; vanilla loads no
    draft, and its greedy tokens are the speculative method's. dustin selects with the CPU's PyTorch code, as on a
    user's CPU (TRITON_INTERPRET unset): the interpreted selection kernel was most of this test's time."""
    without_interpreter(monkeypatch)
    target, draft = tiny_pair
    prompts = _prompts([50, 80], seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sparse = LLM(str(target), str(draft), budget=32, device="cpu", dtype="fp32")
    assert sparse.method == "dustin" and sparse.engine.pair.draft is not None
    ref = sparse.engine.generate(prompts, *offline(method="dustin", budget=32, max_new_tokens=10,
                                                           stop_at_eos=False))
    assert _ids(sparse.generate(prompts, params)) == [s.token_ids for s in ref.sequences]
    vanilla = LLM(str(target), str(draft), method="vanilla", device="cpu", dtype="fp32")
    assert vanilla.engine.pair.draft is None
    out = vanilla.generate(prompts, params)
    assert _ids(out) == _ids(llm.generate(prompts, params)) and out[0].metrics.tau == 1.0


def test_bad_settings_fail_before_loading():
    """Method, gamma and budget are GenerationConfig's checks, run before any weights load (the paths do not
    exist: a load would raise CheckpointError instead)."""
    missing = "/nonexistent/model"
    with pytest.raises(InputError, match="unknown method 'nope'"):
        LLM(missing, missing, method="nope")
    with pytest.raises(InputError, match="gamma must be >= 1"):
        LLM(missing, missing, gamma=0)
    with pytest.raises(InputError, match="budget must be >= 21"):
        LLM(missing, missing, budget=8)
    with pytest.raises(InputError, match="needs a draft model"):
        LLM(missing, None, method="classic")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
def test_a_temperature_that_is_not_a_finite_number_at_least_0_is_refused(value):
    with pytest.raises(InputError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=value)


def test_bad_inputs(llm):
    prompts = _prompts([5, 6, 7])
    with pytest.raises(InputError, match="no prompts given"):
        llm.generate([])
    with pytest.raises(InputError, match="2 SamplingParams for 3 prompts"):
        llm.generate(prompts, [SamplingParams(temperature=0), SamplingParams(temperature=0)])
    with pytest.raises(InputError, match="params\\[1\\] is a dict"):
        llm.generate(prompts[:2], [SamplingParams(temperature=0), {"max_tokens": 4}])
    with pytest.raises(InputError, match="prompt 1 is empty"):  # the index in the call, not in a sampling group
        llm.generate([prompts[0], []], [SamplingParams(temperature=0.5), SamplingParams(temperature=0)])
    with pytest.raises(InputError, match="prompt 1 is a int"):
        llm.generate([prompts[0], 5])
    with pytest.raises(InputError, match="prompt 0 has 4000 tokens; with max_tokens 200"):
        llm.generate([[5] * 4000], SamplingParams(temperature=0, max_tokens=200))
    with pytest.raises(InputError, match="max_tokens must be an integer >= 1"):
        SamplingParams(temperature=0, max_tokens=0)


def test_logprobs_are_those_the_engine_core_serves(llm):
    """`logprobs` / `prompt_logprobs` in SamplingParams: each generated token's and each prompt token's (None for the
    first), with the asked number of most likely tokens, equal to what the engine core serves for the same request;
    a prompt that did not ask gets none."""
    from dustin.engine.core import EngineCore
    from dustin.engine.request import Request

    prompts = _prompts([9, 17], seed=6)
    asked = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompts, [asked, plain])
    assert out[1].logprobs is None and out[1].prompt_logprobs is None
    r = out[0]
    assert len(r.logprobs) == 6 and all(len(lp.top) == 2 for lp in r.logprobs)
    assert len(r.prompt_logprobs) == 9 and r.prompt_logprobs[0] is None
    assert all(len(lp.top) == 1 for lp in r.prompt_logprobs[1:])
    core = EngineCore(llm.engine.pair, GenerationConfig(method="classic", gamma=3, max_slots=2))
    core.add_request(Request("a", prompts[0], asked))
    served, lps, plps = [], [], None
    while core.has_unfinished():
        for o in core.step():
            served += o.new_token_ids
            lps += o.logprobs or []
            plps = o.prompt_logprobs or plps
    assert served == r.token_ids
    assert [x.logprob for x in lps] == pytest.approx([x.logprob for x in r.logprobs], abs=1e-5)
    assert [[t for t, _ in x.top] for x in lps] == [[t for t, _ in x.top] for x in r.logprobs]
    assert [x.logprob for x in plps[1:]] == pytest.approx([x.logprob for x in r.prompt_logprobs[1:]], abs=1e-5)


def test_import_dustin_is_cheap():
    code = ("import sys, dustin; assert 'torch' not in sys.modules, 'import dustin imported torch'; "
            "print(dustin.__version__); from dustin import LLM, SamplingParams; assert 'torch' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*\n", r.stdout)


def readme_example() -> str:
    """The first ```python block of README.md's `## Python API` section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README's Python API section has no python block"
    return m.group(1)


def test_readme_example_is_the_llm_api():
    code = readme_example()
    assert "from dustin import LLM, SamplingParams" in code and 'device="cpu"' in code


@pytest.mark.realmodels
@pytest.mark.slow
def test_readme_example_runs(capsys, real_pair_cli):
    """README's example, as written, on the fetched pair (CPU). It runs in this process: its `LLM("default",
    "default", ..., device="cpu")` gets the suite's shared pair (`real_pair_cli`: the load is answered with it)
    instead of a fresh interpreter loading a second copy (a fp32 load of ~20 s and 10 GB; 115 s in all on our
    2-core CPU). `import dustin` in a fresh interpreter: test_import_dustin_is_cheap."""
    code = readme_example()
    t0 = time.perf_counter()
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    took = time.perf_counter() - t0
    out = capsys.readouterr().out
    stats = re.findall(r"^-- (\d+) tokens, (stop|length), tau ([\d.]+)$", out, re.M)
    assert len(stats) == 2, out
    for n, reason, tau in stats:
        assert 1 <= int(n) <= 16 and (reason == "stop" or int(n) == 16)
        assert 1.0 <= float(tau) <= 5.0  # gamma 4: at most 5 tokens per target forward
    assert len(out.strip().splitlines()) > 2  # the texts were printed too
    with capsys.disabled():
        print(f"\nREADME example: {took:.1f} s\n{out}")


def test_execution_options_reach_the_engine(tiny_pair):
    """`LLM(options=...)` is the config's `ExecutionOptions` for every batch: with every draft accepted
    (acceptance-controlled, a benchmark switch) each step makes Γ + 1 tokens."""
    from dustin.engine.config import ExecutionOptions

    target, draft = tiny_pair
    llm = LLM(str(target), str(draft), method="classic", gamma=3, device="cpu", dtype="fp32",
              options=ExecutionOptions(accept_prob=1.0))
    out = llm.generate(_prompts([40], seed=2), SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert out[0].metrics.tau == 4.0
