"""`broadcast_plan` (dustin/parallel/tp_selection.py) hands every rank the whole plan: indices, counts, dense rows and
the sampled tail's log-weights (a plan that lost its weights would verify an unweighted tail: another model)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dustin.attention.context import SparsePlan
from dustin.parallel.tp_selection import broadcast_plan


def test_every_field_of_the_plan_is_broadcast(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        indices = torch.tensor([[3, 5, 9, 0], [1, 2, 4, 8]], dtype=torch.int32)
        counts = torch.tensor([3, 4], dtype=torch.int32)
        dense = torch.tensor([False, True])
        bias = torch.tensor([[0.0, 0.0, 1.5, 0.0], [0.0, 2.0, 2.0, 2.0]])
        got = broadcast_plan(SparsePlan(indices, counts, dense, bias))
        assert torch.equal(got.indices, indices) and torch.equal(got.counts, counts)
        assert torch.equal(got.dense, dense) and got.bias is not None and torch.equal(got.bias, bias)
        plain = broadcast_plan(SparsePlan(indices, counts))
        assert plain.dense is None and plain.bias is None
    finally:
        dist.destroy_process_group()
