"""The draft-vocabulary experiment's mask (scripts/experiments/draft_vocab.py): it keeps exactly the N most frequent
ids and the special ids, and an argmax over masked logits is the argmax over that subset."""
from __future__ import annotations

import torch

from scripts.experiments.draft_vocab import subset_mask


def test_mask_keeps_the_top_ids_and_the_specials_only():
    order = [7, 3, 9, 1, 4]  # by descending frequency
    mask = subset_mask(order, 3, vocab=12, special=[11, 40])  # 40 lies past the vocabulary: ignored
    kept = torch.nonzero(mask == 0).flatten().tolist()
    assert kept == [3, 7, 9, 11]
    assert torch.isneginf(mask[[0, 1, 2, 4, 5, 6, 8, 10]]).all()
    logits = torch.arange(12, dtype=torch.float32)  # the full argmax (10) lies outside the subset
    assert int(torch.argmax(logits + mask)) == 11
