"""Exactness of the speculative methods, batching, stopping, and bad input."""
from __future__ import annotations

import pytest
import torch

from dustin.engine.config import GenerationConfig
from dustin.engine.engine import Engine
from dustin.engine.offline.prefill import PrefillCache
from dustin.errors import InputError, OutOfMemoryError, TokenizerMismatchError
from dustin.models.loader import load_model
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return Engine.from_models(load_model(target), load_model(draft))


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def _run(engine, prompts, **kw):
    kw.setdefault("stop_at_eos", False)
    return engine.generate(prompts, GenerationConfig(**kw))


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_vanilla(engine, gamma):
    prompts = _prompts([5, 23, 61, 12, 40])
    vanilla = _run(engine, prompts, method="vanilla", max_new_tokens=40)
    for method, extra in [("classic", {}), ("magicdec", {"draft_window": 16}), ("classic", {"draft_kv": "streaming",
                                                                                         "draft_window": 9})]:
        out = _run(engine, prompts, method=method, gamma=gamma, max_new_tokens=40, **extra)
        assert [s.token_ids for s in out.sequences] == [s.token_ids for s in vanilla.sequences], (method, extra)
        assert all(len(s.token_ids) == 40 for s in out.sequences)
        assert out.steps < 40  # speculation really accepted draft tokens
        assert 1.0 < out.tau <= gamma + 1


def test_steps_on_bf16_logits_choose_what_fp32_logits_choose(tiny_pair, monkeypatch):
    """A step's forwards return bf16 logits (no fp32 copy); greedy acceptance and sampling must choose exactly
    the tokens they choose on the fp32 logits (the same values cast): greedy speculative = vanilla, and a seeded
    sampled run equals one whose forwards return fp32."""
    from dustin.engine.worker.step import DeviceStep
    target, draft = tiny_pair
    eng = Engine.from_models(load_model(target, dtype=torch.bfloat16), load_model(draft, dtype=torch.bfloat16))
    prompts = _prompts([5, 23, 61])
    vanilla = _run(eng, prompts, method="vanilla", max_new_tokens=24)
    spec = _run(eng, prompts, method="classic", gamma=3, max_new_tokens=24)
    assert [s.token_ids for s in spec.sequences] == [s.token_ids for s in vanilla.sequences]
    sampled = dict(method="classic", gamma=3, max_new_tokens=24, temperature=0.8, top_k=20, seed=5)
    bf16 = _run(eng, prompts, **sampled)

    def fp32_forward(self, which, tokens, positions, lengths, max_len, **kw):
        return self.models[which].forward(tokens, positions, lengths, max_len, float_logits=True, **kw)

    monkeypatch.setattr(DeviceStep, "forward", fp32_forward)
    fp32 = _run(eng, prompts, **sampled)
    assert [s.token_ids for s in bf16.sequences] == [s.token_ids for s in fp32.sequences]
    assert len({tuple(s.token_ids) for s in bf16.sequences}) == 3


def test_outputs_are_not_degenerate(engine):
    """The equality above is meaningful only if the outputs vary with the prompt."""
    out = _run(engine, _prompts([8, 8, 8], seed=3), method="vanilla", max_new_tokens=20)
    seqs = [tuple(s.token_ids) for s in out.sequences]
    assert len(set(seqs)) == 3 and all(len(set(s)) > 5 for s in seqs)


def test_batch_equals_one_by_one(engine):
    prompts = _prompts([3, 50, 17, 33])
    batch = _run(engine, prompts, method="classic", gamma=4, max_new_tokens=30)
    for p, s in zip(prompts, batch.sequences, strict=False):
        single = _run(engine, [p], method="classic", gamma=4, max_new_tokens=30)
        assert single.sequences[0].token_ids == s.token_ids
        assert s.prompt_len == len(p)


def test_streaming_draft_changes_drafts_not_output(engine):
    """MagicDec's draft reads only sinks + window: its acceptance differs from the full draft at long prompts."""
    prompts = _prompts([200, 150])
    full = _run(engine, prompts, method="classic", gamma=4, max_new_tokens=30)
    stream = _run(engine, prompts, method="magicdec", gamma=4, max_new_tokens=30, draft_window=8)
    assert [s.token_ids for s in full.sequences] == [s.token_ids for s in stream.sequences]
    assert full.steps != stream.steps or full.tau != stream.tau


def test_each_sequence_stops_on_its_own_eos(engine):
    prompts = _prompts([10, 20, 30])
    ref = _run(engine, prompts, method="vanilla", max_new_tokens=25)
    eos = ref.sequences[1].token_ids[6]  # make a token the second sequence emits early its stop token
    engine.pair.eos_ids, saved = {eos}, engine.pair.eos_ids
    try:
        out = engine.generate(prompts, GenerationConfig(method="classic", gamma=3, max_new_tokens=25))
    finally:
        engine.pair.eos_ids = saved
    for r, s in zip(ref.sequences, out.sequences, strict=False):
        expected = r.token_ids[: r.token_ids.index(eos) + 1] if eos in r.token_ids else r.token_ids
        assert s.token_ids == expected


@pytest.mark.parametrize("kwargs,match", [({"gamma": 0}, "gamma"), ({"top_p": 0.0}, "top-p"),
                                          ({"method": "nope"}, "unknown method"), ({"temperature": -1}, "temperature"),
                                          ({"max_new_tokens": 0}, "max-new-tokens")])
def test_bad_generation_config(kwargs, match):
    with pytest.raises(InputError, match=match):
        GenerationConfig(**kwargs)


def test_prompt_longer_than_context(engine):
    too_long = [5] * (engine.pair.target.args.max_position_embeddings - 10)
    with pytest.raises(InputError, match="more than the model context"):
        _run(engine, [too_long], method="classic", max_new_tokens=20)
    with pytest.raises(InputError, match="empty"):
        _run(engine, [[]], method="vanilla")
    with pytest.raises(InputError, match="outside the vocabulary"):
        _run(engine, [[1, 2, 10_000]], method="vanilla")


def test_mismatched_vocabularies(tmp_path, tiny_pair):
    other = make_tiny_checkpoint(tmp_path / "other", "qwen2", vocab=80)
    with pytest.raises(TokenizerMismatchError):
        Engine.from_models(load_model(tiny_pair[0]), load_model(other))


def test_batch_too_large_for_memory(engine, monkeypatch):
    from dustin.engine import pair as pair_mod
    from dustin.errors import OutOfMemoryError

    monkeypatch.setattr(pair_mod, "_free_memory", lambda device: 1024)
    with pytest.raises(OutOfMemoryError, match="lower the batch size"):
        _run(engine, _prompts([10, 10]), method="classic")


def test_kv_cache_bytes_match_the_allocated_caches(engine):
    """The memory check (and `bench e2e`'s fit test) count exactly what a session allocates."""
    cfg = GenerationConfig(method="classic", gamma=3, max_new_tokens=5)
    prompts = _prompts([10, 7])
    s = engine.start(prompts, cfg).runner.batch
    allocated = sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size()
                    for c in (s.target_cache, s.draft_cache))
    assert engine.pair.kv_cache_bytes(2, s.target_cache.k.shape[3]) == allocated
    assert engine.pair.kv_cache_bytes(2, 100, speculative=False) < engine.pair.kv_cache_bytes(2, 100)


def test_triton_backend_matches_sdpa_end_to_end(tmp_path):
    """The engine on the Triton kernels (CPU interpreter here) gives the SDPA backend's tokens."""
    from dustin.attention.backend import AttentionBackend
    from tests.tiny_models import make_tiny_draft

    target = make_tiny_checkpoint(tmp_path / "t", "qwen2", heads=4, kv_heads=2, seed=3)  # head_dim 16
    draft = make_tiny_draft(target, tmp_path / "d", noise=0.1)
    tri = AttentionBackend("triton")
    eng_tri = Engine.from_models(load_model(target, backend=tri), load_model(draft, backend=tri))
    eng_sdpa = Engine.from_models(load_model(target), load_model(draft))
    prompts = _prompts([6, 29])
    for method, extra in [("vanilla", {}), ("magicdec", {"draft_window": 10})]:
        a = _run(eng_tri, prompts, method=method, gamma=3, max_new_tokens=8, **extra)
        b = _run(eng_sdpa, prompts, method=method, gamma=3, max_new_tokens=8, **extra)
        assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
        assert a.steps == b.steps


def test_reused_prefill_gives_the_same_tokens(tiny_pair):
    target, draft = tiny_pair
    eng = Engine.from_models(load_model(target), load_model(draft))
    prompts = _prompts([30, 7, 52])
    fresh = {m: _run(eng, prompts, method=m, gamma=3, max_new_tokens=20) for m in ("classic", "vanilla", "magicdec")}
    kw = dict(stop_at_eos=False, gamma=3, max_new_tokens=20)
    shared = PrefillCache()
    reused = {m: eng.generate(prompts, GenerationConfig(method=m, **kw), prefill_cache=shared)
              for m in ("classic", "vanilla", "magicdec")}
    for m in fresh:
        assert [s.token_ids for s in reused[m].sequences] == [s.token_ids for s in fresh[m].sequences], m
    assert shared.state is not None and shared.state.draft_kv is not None
    other = eng.generate(_prompts([30, 7, 51]), GenerationConfig(method="vanilla", **kw), prefill_cache=shared)
    assert other.sequences[2].prompt_len == 51  # different prompts never reuse the saved caches


def test_speculative_session_after_vanilla_adds_only_the_draft_caches(tiny_pair):
    """Vanilla first, then speculative methods over the same PrefillCache: the second session prefills only the
    draft and the saved state keeps the very target tensors of the first (no second copy of the target's caches,
    37 GB at 20 x 64k), with the tokens of fresh runs."""
    target, draft = tiny_pair
    eng = Engine.from_models(load_model(target), load_model(draft))
    prompts = _prompts([30, 7, 52])
    kw = dict(stop_at_eos=False, gamma=3, max_new_tokens=20)
    shared = PrefillCache()
    eng.generate(prompts, GenerationConfig(method="vanilla", **kw), prefill_cache=shared)
    target_kv = shared.state.target_kv
    assert shared.state.draft_kv is None
    for m in ("classic", "magicdec"):
        reused = eng.generate(prompts, GenerationConfig(method=m, **kw), prefill_cache=shared)
        fresh = _run(eng, prompts, method=m, gamma=3, max_new_tokens=20)
        assert [s.token_ids for s in reused.sequences] == [s.token_ids for s in fresh.sequences], m
        assert shared.state.target_kv is target_kv and shared.state.draft_kv is not None
    eng.generate(_prompts([30, 7, 51]), GenerationConfig(method="vanilla", **kw), prefill_cache=shared)
    assert shared.state.target_kv is not target_kv and shared.state.draft_kv is None


def test_kv_memory_refusal_says_what_fits(tiny_pair):
    target, draft = tiny_pair
    eng = Engine.from_models(load_model(target), load_model(draft))
    per_seq = eng.pair.kv_cache_bytes(1, 1 << 20, speculative=True)
    eng.pair.require_kv_memory(1, 1 << 10, True, copies=2)  # a few MB: fits
    with pytest.raises(OutOfMemoryError, match=r"held 2 times.*sequences would fit\): lower --batch-size") as e:
        eng.pair.require_kv_memory(int(1e13 // per_seq) + 1, 1 << 20, True, copies=2, advice="lower --batch-size")
    assert "\n" not in str(e.value)
