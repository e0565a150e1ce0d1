"""Log-probabilities and n sequences of one prompt in the serving engine core (EngineCore, its runner's slots):
generated tokens' log-probabilities are the target's raw distribution at each accepted position (of the verify
forward that accepted it; for a row's first token, its prefill's), prompt tokens' those of the dense prefill, with
the top-N; asking for them changes no token; n sequences of one prompt prefill it once and each equals the request
alone with its own seed. Checked against the Hugging Face model of the same files (fp32, CPU)."""
from __future__ import annotations

import random

import pytest
import torch

from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.engine import Engine
from dustin.engine.request import Request, SamplingParams
from tests.tiny_models import hf_model

SPARSE = dict(budget=24, draft_window=32)
pytestmark = pytest.mark.usefixtures("cpu_paths")  # selection on the CPU's PyTorch code (tests/conftest.py)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return Engine.from_pretrained(str(target), str(draft))


@pytest.fixture(scope="module")
def hf(tiny_pair):
    return hf_model(tiny_pair[0])


def _llm(engine, method="classic", **kw) -> EngineCore:
    kw = {**(SPARSE if method.startswith("dustin") else {}), "max_slots": 4, "max_context": 256,
          "prefill_chunk": 16, "prefill_tokens": 32, **kw}
    return EngineCore(engine.pair, GenerationConfig(method=method, **kw))


def _run(llm: EngineCore, groups: list[list[Request]], steps_before: int = 0) -> dict:
    """Add each group (one request, or n sequences of one prompt) and step to the end: per request id its
    tokens, log-probabilities and prompt log-probabilities."""
    got: dict[str, dict] = {}

    def book(outs):
        for o in outs:
            g = got.setdefault(o.request_id, {"ids": [], "lp": [], "plp": None})
            g["ids"] += o.new_token_ids
            if o.logprobs is not None:
                g["lp"] += o.logprobs
            if o.prompt_logprobs is not None:
                assert g["plp"] is None, "prompt log-probabilities come with the first output only"
                g["plp"] = o.prompt_logprobs
    for group in groups:
        llm.add_requests(group)
        for _ in range(steps_before):
            book(llm.step())
    while llm.has_unfinished():
        book(llm.step())
    return got


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 90) for _ in range(n)] for n in lengths]


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check(lps, ref: torch.Tensor, tokens: list[int], k: int, tol: float = 2e-4) -> None:
    """Each Logprob against the reference rows (row j predicts tokens[j]): the token's value and the top-k."""
    assert len(lps) == len(tokens)
    for lp, row, tok in zip(lps, ref, tokens, strict=True):
        assert abs(lp.logprob - row[tok].item()) < tol
        top = row.topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(abs(v - w) < tol for (_, v), w in zip(lp.top, top.values.tolist(), strict=True))


@pytest.mark.parametrize("method", ["vanilla", "classic"])
def test_logprobs_are_the_targets_raw_distribution(engine, hf, method):
    """A greedy row, a sampled row (temperature 0.5, top-k 5: the log-probabilities are still the raw
    distribution's) and a row that asks for nothing, prompts of 1-70 tokens prefilled in chunks over several
    steps: every generated and prompt token's log-probability and top-N equal the HF model's log-softmax."""
    prompts = _prompts([70, 23, 1, 40], seed=1)
    asks = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0.5, top_k=5, seed=4, max_tokens=9, logprobs=0, prompt_logprobs=5,
                           ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=6, logprobs=20, prompt_logprobs=1, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    got = _run(_llm(engine, method), [[Request(str(i), p, sp)] for i, (p, sp) in
                                      enumerate(zip(prompts, asks, strict=True))])
    for i, (prompt, sp) in enumerate(zip(prompts, asks, strict=True)):
        g = got[str(i)]
        assert len(g["ids"]) == sp.max_tokens
        if sp.logprobs is None:
            assert g["lp"] == [] and g["plp"] is None
            continue
        ref = _reference(hf, prompt + g["ids"])
        P = len(prompt)
        _check(g["lp"], ref[P - 1:P - 1 + len(g["ids"])], g["ids"], sp.logprobs)
        assert g["plp"][0] is None and len(g["plp"]) == P
        _check(g["plp"][1:], ref[:P - 1], prompt[1:], sp.prompt_logprobs)


def test_sparse_verification_reports_the_verified_distribution(engine):
    """Under sparse verification (k = 24 of up to 110 positions) the log-probabilities are those of the
    sparse-verified target, whose argmax greedy decoding accepted: each token is its position's most likely."""
    prompts = _prompts([90, 60], seed=2)
    sp = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)
    got = _run(_llm(engine, "dustin"), [[Request(str(i), p, sp)] for i, p in enumerate(prompts)])
    for g in got.values():
        assert len(g["lp"]) == len(g["ids"]) == 20
        for tok, lp in zip(g["ids"], g["lp"], strict=True):
            assert lp.top[0] == (tok, lp.logprob) and lp.top[1][1] <= lp.logprob <= 0


def test_asking_for_logprobs_changes_no_token(engine):
    """The same requests with and without log-probabilities (the step then runs its other code path, the
    prefill its chunked LM head): the same tokens, sampled ones included, and the first token's log-probability
    does not depend on the prompt's being asked for."""
    prompts = _prompts([50, 9, 33], seed=3)

    def params(lp, plp, i):
        return SamplingParams(temperature=0.8 if i else 0, seed=i, max_tokens=10, logprobs=lp, prompt_logprobs=plp,
                              ignore_eos=True)
    runs = [_run(_llm(engine), [[Request(str(i), p, params(lp, plp, i))] for i, p in enumerate(prompts)])
            for lp, plp in ((None, None), (4, None), (4, 3))]
    for i in range(len(prompts)):
        assert runs[0][str(i)]["ids"] == runs[1][str(i)]["ids"] == runs[2][str(i)]["ids"]
        assert runs[1][str(i)]["lp"][0] == runs[2][str(i)]["lp"][0]


def test_n_sequences_share_one_prefill(engine, hf):
    """n = 3 sequences of one 45-token prompt (seeds 7, 8, 9) beside another request: the prompt is prefilled
    once (plus each copy's last token), each sequence equals the request alone with its seed, and each gets the
    prompt's log-probabilities."""
    prompt, other = _prompts([45, 12], seed=4)

    def sp(seed):
        return SamplingParams(temperature=1.5, seed=seed, max_tokens=12, logprobs=1, prompt_logprobs=1,
                              ignore_eos=True)
    llm = _llm(engine)
    got = _run(llm, [[Request(f"n{i}", prompt, sp(7 + i)) for i in range(3)], [Request("o", other, sp(1))]])
    assert llm.stats()["prompt_tokens_total"] == 45 + 2 + 12
    outs = [got[f"n{i}"]["ids"] for i in range(3)]
    for i in range(3):
        alone = _run(_llm(engine), [[Request("x", prompt, sp(7 + i))]])["x"]
        assert outs[i] == alone["ids"]
        assert got[f"n{i}"]["plp"] == alone["plp"]
    assert len({tuple(o) for o in outs}) > 1  # different seeds, different samples
    ref = _reference(hf, prompt)
    _check(got["n2"]["plp"][1:], ref[:-1], prompt[1:], 1)
    greedy = _run(_llm(engine), [[Request(f"g{i}", prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                            ignore_eos=True)) for i in range(2)]])
    assert greedy["g0"]["ids"] == greedy["g1"]["ids"] == _run(_llm(engine), [[Request(
        "x", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]])["x"]["ids"]


def test_a_group_waits_for_a_row_per_sequence_and_survives_its_first_being_aborted(engine):
    """A group of 3 with 2 free rows waits (nothing behind it goes first); when its first sequence is aborted
    mid-prefill, the others prefill the prompt themselves and still give the tokens of the request alone."""
    prompt, busy = _prompts([80, 10], seed=5)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = _llm(engine, max_slots=3)
    llm.add_request(Request("busy", busy, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    llm.step()
    llm.add_requests([Request(f"g{i}", prompt, sp) for i in range(3)])
    llm.add_request(Request("late", busy, sp))
    llm.step()
    assert len(llm.scheduler.waiting) == 4  # the group waits for the busy row; "late" waits behind it
    got = {}
    while "g0" not in {s.request.request_id for s in llm.scheduler.running.values()}:
        for o in llm.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    llm.abort_request("g0")  # 80 tokens at 32 per step: still prefilling
    while llm.has_unfinished():
        for o in llm.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    alone = _run(_llm(engine), [[Request("x", prompt, sp)]])["x"]["ids"]
    assert got["g1"] == got["g2"] == alone and got.get("g0", []) == []


def test_a_seeded_rows_draws_start_at_its_first_token(engine):
    """A seeded request whose prompt is prefilled over several steps while another request decodes gives the
    tokens it gives alone (the decode steps during its prefill do not use up its random numbers)."""
    prompt, other = _prompts([120, 8], seed=6)
    sp = SamplingParams(temperature=2.0, seed=11, max_tokens=16, ignore_eos=True)
    alone = _run(_llm(engine), [[Request("x", prompt, sp)]])["x"]["ids"]
    llm = _llm(engine)
    llm.add_request(Request("o", other, SamplingParams(temperature=1.0, seed=2, max_tokens=40, ignore_eos=True)))
    for _ in range(2):
        llm.step()
    assert _run(llm, [[Request("x", prompt, sp)]])["x"]["ids"] == alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_graphs_with_logprobs_on_the_gpu():
    """GPU, Triton backend, one CUDA graph per step: steps that compute log-probabilities replay graphs of their
    own and give the tokens of the steps without (bf16; classic and dustin), and in fp32 the graphed engine's
    log-probabilities equal the eager engine's."""
    from tests.tiny_models import gpu_check_pair

    def run(eng, prompts, method, graphs, lp):
        kw = {"budget": 64, "draft_window": 64} if method == "dustin" else {}
        llm = EngineCore(eng.pair, GenerationConfig(method=method, max_slots=4, max_context=1024, **kw))
        llm.runner.device_step.use_graphs = graphs
        sps = [SamplingParams(temperature=0.7 if i % 2 else 0, seed=i, max_tokens=24, logprobs=lp,
                              prompt_logprobs=lp, ignore_eos=True) for i in range(len(prompts))]
        got = _run(llm, [[Request(str(i), p, sp)] for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))])
        if graphs:
            assert any(k[0].endswith("+logprobs") for k in llm.runner.graph_keys()) == (lp is not None)
        return [got[str(i)] for i in range(len(prompts))]

    for dtype in (torch.bfloat16, torch.float32):
        eng, prompts, _ = gpu_check_pair(dtype)
        prompts = [p[:500] for p in prompts]
        for method in ("classic", "dustin") if dtype == torch.bfloat16 else ("classic",):
            with_lp, without = run(eng, prompts, method, True, 5), run(eng, prompts, method, True, None)
            assert [g["ids"] for g in with_lp] == [g["ids"] for g in without]
            assert all(len(g["lp"]) == 24 and len(g["plp"]) == len(p) for g, p in zip(with_lp, prompts, strict=True))
        if dtype == torch.float32:
            eager = run(eng, prompts, "classic", False, 5)
            for a, b in zip(with_lp, eager, strict=True):
                assert a["ids"] == b["ids"]
                assert max(abs(x.logprob - y.logprob) for x, y in zip(a["lp"], b["lp"], strict=True)) < 1e-3
                assert max(abs(x.logprob - y.logprob) for x, y in zip(a["plp"][1:], b["plp"][1:], strict=True)) < 1e-3
