"""Exactness on the real default pair (Qwen2.5-Coder 1.5B target / 0.5B draft) and real long code inputs.

Skipped unless `dustin models fetch` has run (CI fetches it). The longest prompt defaults to 1536 tokens to
keep CI on 2 cores fast; DUSTIN_REAL_TEST_TOKENS=4096 runs the long version (docs/exactness.md). The batch is
ragged (N, 2N/3 and N/2 tokens): per-sequence lengths are exercised, and the single-sequence run prefills the
shortest prompt (more than N/4 tokens: two prefill chunks of N/4) instead of a full-length one.
"""
from __future__ import annotations

import os

import pytest
import torch

from dustin.eval.inputs import long_code_prompt
from tests.conftest import REAL_PAIR
from tests.exactness import NEAR_TIE_EPS, assert_same_or_near_tie
from tests.offline import offline

pytestmark = [pytest.mark.realmodels, pytest.mark.slow]
N_TOKENS = int(os.environ.get("DUSTIN_REAL_TEST_TOKENS", "1536"))
SOURCES = ("argparse.py", "inspect.py", "tarfile.py")
LENGTHS = (N_TOKENS, 2 * N_TOKENS // 3, N_TOKENS // 2)
# per sequence; each fp32 decode step of the pair takes ~0.3-1 s on 2 cores. 16 tokens are 3-4 speculative steps
# per sequence at Γ = 4, each with a full verify (the prefill of the long prompts costs more than all decode steps)
NEW_TOKENS = 16


@pytest.fixture
def engine(real_pair_fp32):
    """The shared pair in fp32: these tests hold speculative output to vanilla's token for token, a divergence
    allowed only at an fp32 near-tie (top-2 gap < 1e-4); bf16's rounding would need a 0.1 gap and hide bugs."""
    return real_pair_fp32


@pytest.fixture(scope="module")
def prompts():
    engine = REAL_PAIR.get(torch.float32)  # the `engine` above (module fixtures are set up before it)
    return [engine.pair.encode(long_code_prompt(engine.pair.tokenizer, n, src)[0])
            for src, n in zip(SOURCES, LENGTHS, strict=True)]


@pytest.fixture(scope="module")
def shared():
    """One prefill of the prompts for every method (the CPU prefill dominates these tests)."""
    from dustin.engine.offline.prefill import PrefillCache

    return PrefillCache()


@pytest.fixture(scope="module")
def vanilla(prompts, shared):
    cfg, params = offline(method="vanilla", max_new_tokens=NEW_TOKENS)
    return REAL_PAIR.get(torch.float32).generate(prompts, cfg, params, prefill_cache=shared)


def _score_fn(engine):
    from dustin.attention.context import ForwardContext
    from dustin.cache.kv_cache import KVCache

    def score(ids):
        a = engine.pair.target.args
        T = len(ids)
        cache = KVCache(a.n_layers, 1, a.n_kv_heads, a.head_dim, T, torch.float32, "cpu")
        ctx = ForwardContext(cache, torch.arange(T)[None], torch.zeros(1, dtype=torch.int32), T, fresh=True)
        with torch.inference_mode():
            logits = engine.pair.target(torch.tensor([ids]), ctx, logits_at=torch.tensor([T - 1]))
            return logits[0, : engine.pair.vocab_limit]
    return score


def test_tokenizers_are_shared(engine):
    assert engine.pair.draft is not None and engine.pair.vocab_limit == len(engine.pair.tokenizer)


@pytest.mark.parametrize("method", ["classic", "magicdec"])
def test_speculative_equals_vanilla_on_real_code(engine, prompts, vanilla, shared, method):
    out = engine.generate(prompts, *offline(method=method, gamma=4, max_new_tokens=NEW_TOKENS),
                          prefill_cache=shared)
    # cut after the last `def` of the second half
    assert all(n // 2 < len(p) <= n for p, n in zip(prompts, LENGTHS, strict=True))
    for p, ref, got in zip(prompts, vanilla.sequences, out.sequences, strict=True):
        assert_same_or_near_tie(ref.token_ids, got.token_ids, p, _score_fn(engine), NEAR_TIE_EPS[torch.float32])
    assert out.tau > 1.5  # the real draft agrees with the real target on code


def test_batch_equals_single_on_real_code(engine, prompts, vanilla):
    """The shortest prompt decoded alone (on the serving loop, its own chunked prefill) equals its row of the
    ragged batch. Its chunks are N/4 tokens (the prompt is longer: two chunks, the second attending to the first
    one's cache), each step's forward as long as a chunk (the CPU default pads every prefill forward to 512
    tokens: 1024 computed for two chunks of a <= 768-token prompt)."""
    chunk = N_TOKENS // 4
    assert chunk < len(prompts[2]) <= 2 * chunk
    single = engine.generate([prompts[2]], *offline(method="classic", gamma=4, max_new_tokens=NEW_TOKENS,
                                                    prefill_chunk=chunk, prefill_tokens=chunk))
    assert_same_or_near_tie(vanilla.sequences[2].token_ids, single.sequences[0].token_ids, prompts[2],
                            _score_fn(engine), NEAR_TIE_EPS[torch.float32])
