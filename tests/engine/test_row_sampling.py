"""Per-row sampling of a mixed batch (dustin/engine/sampling.py `RowSampling`): the tensorized rules equal the
reference `probabilities` row by row, the counter-based noise is uniform and private to each row, and a row's
draws do not depend on the other rows of the batch."""
from __future__ import annotations

import pytest
import torch

from dustin.engine.request import SamplingRule
from dustin.engine.sampling import RowSampling, probabilities
from dustin.rng import counter_uniform
from tests.engine.test_sampling import chi2_test

RULES = [SamplingRule(0.7, 0, 0.9), SamplingRule(0.0), SamplingRule(1.3, 5, 1.0), SamplingRule(1.0, 50, 0.5),
         SamplingRule(2.0, 0, 1.0)]


def _sampler(rules, seeds=None, batch_seed=0):
    s = RowSampling(len(rules), SamplingRule(), torch.Generator().manual_seed(batch_seed), seed=batch_seed)
    for row, (rule, seed) in enumerate(zip(rules, seeds or [None] * len(rules), strict=True)):
        s.set_row(row, rule, seed)
    return s


def test_per_row_rules_equal_the_reference():
    """Temperature, top-k and top-p per row (in one sort) give `probabilities` of each row's own rule; a greedy
    row is its argmax as a one-hot; the positions axis (the verify window) is handled too."""
    logits = torch.randn(len(RULES), 3, 97, generator=torch.Generator().manual_seed(1)) * 3
    got = _sampler(RULES).probabilities(logits)
    for row, rule in enumerate(RULES):
        want = (torch.nn.functional.one_hot(logits[row].argmax(-1), 97).float() if rule.greedy
                else probabilities(logits[row], rule))
        torch.testing.assert_close(got[row], want, atol=1e-6, rtol=1e-5)
    assert torch.all((got[3] > 0).sum(-1) <= 50)  # top-k 50 and top-p 0.5 both cut


def test_bf16_logits_give_the_probabilities_and_tokens_of_their_fp32_cast():
    """A speculative step's forwards return logits in the model's dtype (no fp32 copy): every rule must compute
    on their exact fp32 values, so bf16 logits and the same values as fp32 give bit-equal probabilities and the
    same draws (batch rule, per-row rules, acceptance)."""
    from dustin.engine.sampling import accept_speculative, choose
    gen = torch.Generator().manual_seed(4)
    low = (torch.randn(len(RULES), 3, 97, generator=gen) * 3).to(torch.bfloat16)
    high = low.float()
    for rule in RULES:
        assert torch.equal(probabilities(low, rule), probabilities(high, rule))
    assert torch.equal(_sampler(RULES).probabilities(low), _sampler(RULES).probabilities(high))
    for logits in (low, high):  # the same fresh state each time: the same draws
        s = _sampler(RULES, seeds=[1, 2, 3, 4, 5])
        tok, probs = s.choose(logits[:, 0])
        drafts = torch.randint(0, 97, (len(RULES), 2), generator=torch.Generator().manual_seed(0))
        n, nxt = s.accept(drafts, torch.stack([probs, probs], 1), logits)
        if logits is low:
            first = (tok, probs, n, nxt)
    assert all(torch.equal(a, b) for a, b in zip(first, (tok, probs, n, nxt), strict=True))
    rule = SamplingRule(0.9, 10, 0.95)
    draws = [choose(x[:, 0], rule, torch.Generator().manual_seed(2))[0] for x in (low, high)]
    assert torch.equal(*draws)
    d_probs = probabilities(high[:, :2], rule)
    accepted = [accept_speculative(drafts, d_probs, x, rule, torch.Generator().manual_seed(3)) for x in (low, high)]
    assert all(torch.equal(a, b) for a, b in zip(*accepted, strict=True))


def test_counter_noise_is_uniform_and_reproducible():
    seeds = torch.tensor([3, -7, 1 << 40])
    u = counter_uniform(seeds, torch.zeros(3, dtype=torch.long), 20000)
    assert u.min() >= 0 and u.max() < 1
    assert torch.allclose(u.mean(1), torch.full((3,), 0.5), atol=0.01)
    assert torch.allclose(u.var(1), torch.full((3,), 1 / 12), atol=0.003)
    hist = torch.histc(u[0], bins=10, min=0, max=1)
    assert hist.min() > 1800 and hist.max() < 2200  # each decile within ~4.5 sigma of 2000
    # draws 100.. of a row started at offset 100 are its draws 100.. from offset 0
    assert torch.equal(counter_uniform(seeds, torch.full((3,), 100), 50), u[:, 100:150])
    assert not torch.equal(u[0], u[1])


def test_a_seeded_rows_draws_do_not_depend_on_the_batch():
    """Row 2 (seed 11, rule 1.3/top-k 5) samples the same tokens step after step whether its neighbours are greedy,
    sampled with other rules, or seeded otherwise, and at whichever row it sits."""
    logits = torch.randn(8, 5, 64, generator=torch.Generator().manual_seed(2))

    def run(rules, seeds, row):
        s = _sampler(rules, seeds)
        out = []
        for step in range(8):
            batch = logits[step][None].expand(len(rules), -1, -1).clone()
            toks, _ = s.choose(batch[:, 0])
            out.append(int(toks[row]))
            n, nxt = s.accept(batch[:, 1:].argmax(-1)[:, :3], s.probabilities(batch[:, 1:4]), batch[:, :4])
            out += [int(n[row]), int(nxt[row])]
        return out

    want = run([SamplingRule(0.0), SamplingRule(0.5), SamplingRule(1.3, 5)], [None, 4, 11], 2)
    assert run([SamplingRule(2.0, 3, 0.8), SamplingRule(1.3, 5), SamplingRule(0.0)], [5, 11, None], 1) == want
    assert run([SamplingRule(1.3, 5)], [11], 0) == want
    assert run([SamplingRule(0.0), SamplingRule(0.5), SamplingRule(1.3, 5)], [None, 4, 12], 2) != want


def test_modes():
    s = RowSampling(3, SamplingRule(), torch.Generator(), seed=0)
    assert s.mode == "uniform"
    s.set_row(1, SamplingRule(), 5)  # greedy, but with its own seed
    assert s.mode == "greedy"
    s.set_row(2, SamplingRule(0.8), None)
    assert s.mode == "mixed"
    s.set_row(0, SamplingRule(0.0, 5, 0.5), None)  # a greedy row's top-k / top-p are never applied
    assert s.mode == "mixed"
    s.set_row(0, SamplingRule(0.8, 0, 0.9), None)
    assert s.mode == "mixed-cut"  # top-k / top-p take their own code path (and step graph)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_token_of_a_mixed_batch_follows_the_rule(seed):
    """`choose_row` in a mixed batch draws from the row's counter: over many rows its empirical distribution is
    the rule's (total variation < 0.06 over 4000 draws of a 6-token vocabulary)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    rule = SamplingRule(0.9, 4, 0.95)
    s = RowSampling(4000, SamplingRule(), torch.Generator().manual_seed(seed), seed=seed)
    for row in range(4000):
        s.set_row(row, rule if row % 2 else SamplingRule(1.0), None)
    counts = torch.zeros(6)
    for row in range(1, 4000, 2):
        counts[int(s.choose_row(row, logits))] += 1
    tv = 0.5 * (counts / counts.sum() - probabilities(logits[0], rule)).abs().sum()
    assert tv < 0.06


def _sorted_reference(logits: torch.Tensor, rule: SamplingRule) -> torch.Tensor:
    """The rules by a sort of the whole row: top-k keeps the logits >= the k-th largest, top-p the logits >= that of
    the last token whose preceding mass (in descending order) is below top_p."""
    x = logits.double() / rule.temperature
    if rule.top_k:
        x = x.masked_fill(x < x.topk(rule.top_k, -1).values[..., -1:], float("-inf"))
    if rule.top_p < 1:
        s = x.sort(-1, descending=True).values
        p = s.softmax(-1)
        keep = ((p.cumsum(-1) - p) < rule.top_p).sum(-1, keepdim=True)
        x = x.masked_fill(x < s.gather(-1, keep - 1), float("-inf"))
    return x.softmax(-1).float()


@pytest.mark.parametrize("first_k", [2, 256])
def test_cuts_without_a_sort_equal_the_sorted_rules(monkeypatch, first_k):
    """On the CPU the cuts come from the largest logits only (`torch.topk`, widened while the nucleus may reach
    past them: first_k 2 forces that every time): the kept tokens are those of a sort of the whole row, for the batch
    rule and per row; flat rows (temperature 3, top-p 0.95) need thousands of tokens."""
    from dustin.engine import sampling

    monkeypatch.setattr(sampling, "_FIRST_K", first_k)
    logits = torch.randn(4, 3, 5000, generator=torch.Generator().manual_seed(3)) * 4
    rules = [SamplingRule(3.0, 0, 0.95), SamplingRule(0.7, 0, 0.9), SamplingRule(1.0, 40, 1.0),
             SamplingRule(1.2, 300, 0.8)]
    per_row = _sampler(rules).probabilities(logits)
    for row, rule in enumerate(rules):
        want = _sorted_reference(logits[row], rule)
        got = probabilities(logits[row], rule)
        assert torch.equal(got > 0, want > 0) and torch.equal(per_row[row] > 0, want > 0), rule
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(per_row[row], want, atol=1e-6, rtol=1e-4)
    assert (per_row[0] > 0).sum(-1).min() > 1000  # the flat rows' nucleus is far past the first look


def test_tokens_tied_at_a_cut_are_all_kept():
    """The cuts are values: every token tied with the k-th largest logit, or with the last token the nucleus needs,
    is kept, in the batch rule and per row alike, whatever order a sort would give the ties."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    for rule in (SamplingRule(1.0, 2, 1.0), SamplingRule(1.0, 0, 0.7)):  # 0.7: the nucleus needs a token of 2.0
        want = torch.tensor([[True, False, True, True, False, True]])
        assert torch.equal(probabilities(logits, rule) > 0, want)
        assert torch.equal(_sampler([rule, SamplingRule(0.5)]).probabilities(logits.expand(2, -1))[:1] > 0, want)


def test_inverse_cdf_never_draws_a_token_of_zero_weight():
    """u = 0 draws the first token of nonzero weight and the largest u below 1 the last one (the weights need not
    sum to 1), on totals of every binade."""
    from dustin.engine.sampling import inverse_cdf

    w = torch.tensor([[0.0, 0.3, 0.0, 0.2, 0.0, 0.0], [0.0, 0.0, 7.0, 0.0, 1e-3, 0.0]])
    assert inverse_cdf(w, torch.zeros(2)).tolist() == [1, 2]
    top = torch.full((2,), 1 - 2 ** -24)
    assert inverse_cdf(w, top).tolist() == [3, 4]
    tails = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 2.0 ** torch.arange(-20, 30).repeat(20)
    w = torch.stack([torch.ones(1000), tails, torch.zeros(1000)], 1)
    drawn = inverse_cdf(w, torch.full((1000,), 1 - 2 ** -24))
    assert torch.all(w.gather(1, drawn[:, None]) > 0) and (drawn == 1).sum() > 900


def test_per_row_speculative_sampling_is_lossless():
    """The per-row path (RowSampling.accept with counter noise, in a batch mixing greedy rows and rules with top-k /
    top-p): each sampled row's first emitted token follows its own rule's distribution of the target's logits; a
    greedy row takes the target's argmax; taking the drafts as they are is detected (negative control)."""
    g = torch.Generator().manual_seed(0)
    V, N, G = 12, 24_000, 3
    target_logits = torch.randn(1, G + 1, V, generator=g).expand(N, G + 1, V)
    draft_logits = torch.randn(1, G, V, generator=g).expand(N, G, V)
    rules = [SamplingRule(1.0), SamplingRule(0.8, 6, 0.9), SamplingRule(0.0), SamplingRule(1.5, 0, 0.8)]
    s = _sampler([rules[i % 4] for i in range(N)])
    assert s.mode == "mixed-cut"
    q = s.probabilities(draft_logits)
    drafts = torch.stack([s.sample(q[:, i]) for i in range(G)], 1)
    n_acc, nxt = s.accept(drafts, q, target_logits)
    first = torch.where(n_acc > 0, drafts[:, 0], nxt)
    for i, rule in enumerate(rules):
        rows = slice(i, None, 4)
        if rule.greedy:
            assert torch.all(first[rows] == target_logits[0, 0].argmax())
            continue
        p1 = probabilities(target_logits[0, 0], rule)
        assert chi2_test(first[rows], p1) > 1e-3, rule
        assert chi2_test(drafts[rows, 0], p1) < 1e-6, rule


def test_two_level_inverse_cdf_draws_what_one_cumulative_sum_draws():
    """Over a long row (a vocabulary) `inverse_cdf` searches block sums first, then one block: the same token as the
    flat search but for rounding at a boundary, never one of zero weight, for lengths with and without a partial
    last block (and a zero-weight one)."""
    from dustin.engine.sampling import _BLOCK, inverse_cdf

    g = torch.Generator().manual_seed(0)
    for V in (3 * _BLOCK, 5 * _BLOCK + 77, 40_000):
        w = torch.rand(2000, V, generator=g) ** 6
        w[:, ::5] = 0
        w[:, -100:] = 0
        u = torch.rand(2000, generator=g)
        cdf = w.double().cumsum(-1)
        flat = torch.searchsorted(cdf, u[:, None].double() * cdf[:, -1:], right=True).squeeze(-1)
        got = inverse_cdf(w, u)
        assert (got != flat).sum() <= 2 and torch.all(w.gather(1, got[:, None]) > 0), V
