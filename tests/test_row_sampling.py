"""Per-row sampling of a mixed batch (dustin/engine/sampling.py `RowSampling`): the tensorized rules equal the
reference `probabilities` row by row, the counter-based noise is uniform and private to each row, and a row's
draws do not depend on the other rows of the batch."""
from __future__ import annotations

import pytest
import torch

from dustin.engine.sampling import RowSampling, SamplingRule, counter_uniform, probabilities

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
    got = _sampler(RULES)._probabilities(logits)
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
    assert torch.equal(_sampler(RULES)._probabilities(low), _sampler(RULES)._probabilities(high))
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
            n, nxt = s.accept(batch[:, 1:].argmax(-1)[:, :3], s._probabilities(batch[:, 1:4]), batch[:, :4])
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
