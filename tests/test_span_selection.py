"""The span-selection experiment (scripts/experiments/span_selection.py): at radius 0 its policy is the shipped
dustin policy token for token; a radius spreads each score peak over +-r positions, so the selected set holds
whole spans around the peaks."""
from __future__ import annotations

import pytest
import torch

from dustin.engine.config import GenerationConfig
from scripts.experiments.span_selection import SpanSelection


@pytest.fixture(scope="module")
def engine(tiny_pair):
    from dustin.engine.engine import Engine

    return Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32")


def _cfg():
    return GenerationConfig(method="dustin", gamma=3, max_new_tokens=10, stop_at_eos=False, draft_window=32,
                            budget=40, sparse_config="builtin")


def test_radius_zero_is_the_shipped_policy(engine):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (150, 90, 233)]
    shipped = engine.generate(prompts, _cfg())
    span = engine.generate(prompts, _cfg(), policy=SpanSelection(engine.make_policy(_cfg()).cfg, 0))
    assert [s.token_ids for s in span.sequences] == [s.token_ids for s in shipped.sequences]
    wide = engine.generate(prompts, _cfg(), policy=SpanSelection(engine.make_policy(_cfg()).cfg, 6))
    assert [s.token_ids for s in wide.sequences] != [s.token_ids for s in shipped.sequences]  # another set


def test_pooling_spreads_each_peak_over_the_radius(engine):
    policy = SpanSelection(engine.make_policy(_cfg()).cfg, 2)
    s = torch.zeros(2, 12)
    s[0, 5], s[1, 0], s[1, 11] = 3.0, 1.0, 2.0
    pooled = policy._pool(s)
    assert pooled[0].tolist() == [0, 0, 0, 3, 3, 3, 3, 3, 0, 0, 0, 0]
    assert pooled[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0, 2, 2, 2]
