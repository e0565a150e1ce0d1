"""Speculative sampling is lossless: its outputs follow the target's distribution (statistical tests)."""
from __future__ import annotations

import math

import pytest
import torch

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.engine.config import GenerationConfig
from dustin.engine.engine import Engine
from dustin.engine.request import SamplingRule
from dustin.engine.sampling import accept_speculative, probabilities
from dustin.models.loader import load_model
from tests.offline import offline


def chi2_pvalue_upper(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty normal approximation)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_test(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value that `samples` were drawn from `probs`; bins with expected count < 5 are merged."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return chi2_pvalue_upper(stat, int(keep.sum()) - 1)


def test_top_k_top_p_filtering():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = probabilities(logits, SamplingRule(1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and p[0, :2].sum().item() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    p = probabilities(logits, SamplingRule(1.0, top_p=float(full[0] + full[1] / 2)))
    assert (p[0, 2:] == 0).all() and (p[0, :2] > 0).all()


def test_acceptance_rule_is_lossless():
    """For fixed p and q, the first emitted token follows p; a biased rule is detected (negative control)."""
    g = torch.Generator().manual_seed(0)
    V, N, G = 12, 60_000, 3
    target_logits = torch.randn(1, G + 1, V, generator=g).expand(N, G + 1, V)
    q = torch.randn(1, G, V, generator=g).softmax(-1).expand(N, G, V)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(N, G)
    n_acc, nxt = accept_speculative(drafts, q, target_logits, SamplingRule(1.0), g)
    first = torch.where(n_acc > 0, drafts[:, 0], nxt)
    p1 = target_logits[0, 0].softmax(-1)
    assert chi2_test(first, p1) > 1e-3
    assert chi2_test(drafts[:, 0], p1) < 1e-6  # taking the draft's tokens as they are is not lossless


@pytest.mark.slow
def test_generated_tokens_follow_target_distribution(tiny_pair):
    """End to end: the 2nd and 3rd generated tokens' marginals equal the target's exact marginals."""
    target, draft = load_model(tiny_pair[0]), load_model(tiny_pair[1])
    engine = Engine.from_models(target, draft)
    prompt = [5, 17, 42, 8, 33, 71]
    N, V = 3000, engine.pair.vocab_limit
    params = SamplingRule(temperature=1.0, top_k=20)
    cfg, params = offline(method="classic", gamma=2, max_new_tokens=3, temperature=1.0, top_k=20, seed=1,
                           stop_at_eos=False)
    out = engine.generate([prompt] * N, cfg, params)
    toks = torch.tensor([s.token_ids for s in out.sequences])

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        B, T = prefixes.shape
        a = target.args
        cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, T, torch.float32, "cpu")
        ctx = ForwardContext(cache, torch.arange(T)[None].expand(B, T), torch.zeros(B, dtype=torch.int32), T,
                             fresh=True)
        with torch.no_grad():
            return probabilities(target(prefixes, ctx)[:, -1, :V], params)

    base = torch.tensor(prompt)
    p1 = next_probs(base[None])[0]
    cand1 = torch.nonzero(p1).flatten()
    p2_given = next_probs(torch.cat([base.expand(len(cand1), -1), cand1[:, None]], 1))
    p2 = (p1[cand1, None] * p2_given).sum(0)
    assert chi2_test(toks[:, 0], p1) > 1e-3
    assert chi2_test(toks[:, 1], p2) > 1e-3
    # third token: enumerate the (t1, t2) pairs with probability mass
    pairs = [(i, j) for i in cand1.tolist()
             for j in torch.nonzero(p2_given[cand1.tolist().index(i)]).flatten().tolist()]
    pref = torch.tensor([prompt + [i, j] for i, j in pairs])
    w = torch.tensor([float(p1[i] * p2_given[cand1.tolist().index(i), j]) for i, j in pairs])
    p3 = (w[:, None] * next_probs(pref)).sum(0)
    assert chi2_test(toks[:, 2], p3) > 1e-3
    assert chi2_test(toks[:, 2], p2) < 1e-6  # negative control: a wrong reference distribution is rejected


@pytest.mark.parametrize("tau,gamma", [(2.2, 4), (1.0, 4), (3.5, 7), (1.9, 1)])
def test_accept_prob_for_tau_solves_the_geometric_sum(tau, gamma):
    from dustin.engine.sampling import accept_prob_for_tau

    p = accept_prob_for_tau(tau, gamma)
    assert 0.0 <= p < 1.0
    assert sum(p ** i for i in range(gamma + 1)) == pytest.approx(tau, abs=1e-9)


@pytest.mark.parametrize("tau,gamma", [(0.9, 4), (5.0, 4), (2.0, 1)])
def test_accept_prob_for_tau_rejects_unreachable_tau(tau, gamma):
    from dustin.engine.sampling import accept_prob_for_tau

    with pytest.raises(ValueError, match="tau must be in"):
        accept_prob_for_tau(tau, gamma)


def test_accept_controlled_hits_the_requested_tau_and_keeps_the_target_token():
    """Mean tokens per step (accepted + 1) converges to (1 - p^(Γ+1)) / (1 - p); the next token is the target's
    argmax at the first rejected slot."""
    from dustin.engine.sampling import accept_controlled

    B, G, V, p = 20000, 4, 7, 0.5737
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, G + 1, V, generator=g)
    draft = torch.randint(0, V, (B, G), generator=g)
    n_acc, nxt = accept_controlled(draft, logits, p, g)
    want = sum(p ** i for i in range(G + 1))
    se = (n_acc.float() + 1).std().item() / math.sqrt(B)
    assert abs((n_acc.float() + 1).mean().item() - want) < 5 * se
    assert torch.equal(nxt, logits.argmax(-1).gather(1, n_acc[:, None].long()).squeeze(1))
    assert torch.equal(accept_controlled(draft, logits, 0.0, g)[0], torch.zeros(B, dtype=n_acc.dtype))
    assert torch.equal(accept_controlled(draft, logits, 1.0, g)[0], torch.full((B,), G, dtype=n_acc.dtype))


def test_accept_prob_config_validation():
    from dustin.engine.config import ExecutionOptions
    from dustin.errors import InputError

    with pytest.raises(InputError, match="accept-prob"):
        GenerationConfig(method="dustin", options=ExecutionOptions(accept_prob=1.5))
    with pytest.raises(InputError, match="speculative"):
        GenerationConfig(method="vanilla", options=ExecutionOptions(accept_prob=0.5))
