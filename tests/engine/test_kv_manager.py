"""The KV-cache manager (engine/kv_manager.py): the caches it allocates and the whole-region operations the runner
leaves to it, against plain tensor indexing; the capacity rule, the memory fit and the slot table it owns."""
from __future__ import annotations

import pytest
import torch

from dustin.engine.kv_manager import (
    KVManager,
    MemoryFit,
    SlotTable,
    bytes_per_token,
    cache_capacity,
    kv_bytes,
    max_tokens_room,
    positions_needed,
)
from dustin.models.loader import load_model


def _manager(tiny_pair, slots=3, capacity=37):
    target, draft = (load_model(p) for p in tiny_pair)
    return KVManager({"target": target, "draft": draft}, slots, capacity), target, draft


def _fill(kv: KVManager, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in kv.caches.values():
        c.k.copy_(torch.randn(c.k.shape, generator=g))
        c.v.copy_(torch.randn(c.v.shape, generator=g))


def test_allocation_and_its_byte_count(tiny_pair):
    kv, target, draft = _manager(tiny_pair)
    for name, model in (("target", target), ("draft", draft)):
        c, a = kv.caches[name], model.args
        assert c.k.shape == c.v.shape == (a.n_layers, 3, a.n_kv_heads, 37, a.head_dim)
    held = sum(c.k.numel() * c.k.element_size() * 2 for c in kv.caches.values())
    assert kv_bytes([target.args, draft.args], 4, 3, 37) == held


def test_copy_prefix_copies_only_the_prefix_of_one_row(tiny_pair):
    kv, _, _ = _manager(tiny_pair)
    _fill(kv, 0)
    before = {n: (c.k.clone(), c.v.clone()) for n, c in kv.caches.items()}
    kv.copy_prefix(src=2, dst=0, n=11)
    for name, c in kv.caches.items():
        k0, v0 = before[name]
        assert torch.equal(c.k[:, 0, :, :11], k0[:, 2, :, :11]) and torch.equal(c.v[:, 0, :, :11], v0[:, 2, :, :11])
        assert torch.equal(c.k[:, 0, :, 11:], k0[:, 0, :, 11:]) and torch.equal(c.k[:, 1:], k0[:, 1:])
        assert torch.equal(c.v[:, 0, :, 11:], v0[:, 0, :, 11:]) and torch.equal(c.v[:, 1:], v0[:, 1:])


def test_snapshot_restores_the_prefix_into_another_batch(tiny_pair):
    kv, _, _ = _manager(tiny_pair)
    other, _, _ = _manager(tiny_pair)
    _fill(kv, 1)
    _fill(other, 2)
    snap = kv.snapshot("target", 20)
    kv.caches["target"].k.zero_()  # a snapshot is a copy
    tail = other.caches["target"].k[..., 20:, :].clone()
    other.restore("target", snap)
    assert torch.equal(other.caches["target"].k[..., :20, :], snap[0])
    assert torch.equal(other.caches["target"].v[..., :20, :], snap[1])
    assert torch.equal(other.caches["target"].k[..., 20:, :], tail) and bool(snap[0].abs().sum() > 0)


def test_fill_noise_writes_the_prefix_of_every_cache(tiny_pair):
    kv, _, _ = _manager(tiny_pair)
    kv.fill_noise(9, torch.Generator().manual_seed(3))
    for c in kv.caches.values():
        head, rest = c.k[..., :9, :], c.k[..., 9:, :]
        assert bool((head != 0).all()) and bool((rest == 0).all()) and bool((c.v[..., 9:, :] == 0).all())
        assert abs(float(head.std()) - 1.0) < 0.2


# ------------------------------------------------------------------ the capacity rule, memory fit, slots
@pytest.mark.parametrize("n, m, gamma", [(1, 1, 0), (37, 5, 4), (4000, 128, 6), (9, 300, 15)])
def test_one_capacity_rule(n, m, gamma):
    """The positions a sequence takes (held against the model context), the positions its slot allocates (those
    and the junk rows of a stopped row: n + m + 3Γ + 4) and the room a prompt has are one rule."""
    assert positions_needed(n, m, gamma) == n + m + gamma + 1
    assert cache_capacity([n], [m], gamma) == n + m + 3 * gamma + 4
    assert cache_capacity([n, 1], [m, 1], gamma) == cache_capacity([n], [m], gamma)  # the longest sequence's
    context = positions_needed(n, m, gamma)
    assert max_tokens_room(context, n, gamma) == m  # the most a prompt may ask of exactly that context


def test_room_is_what_the_engine_admits(tiny_pair):
    """The server's headroom (`EngineCore.max_tokens_room`) is exactly the largest max_tokens `check_request`
    admits, at every prompt length: one more is refused with the context message."""
    from dustin.engine.config import GenerationConfig
    from dustin.engine.core import EngineCore
    from dustin.engine.pair import ModelPair
    from dustin.engine.request import SamplingParams
    from dustin.errors import InputError

    pair = ModelPair(*(load_model(p) for p in tiny_pair))
    core = EngineCore(pair, GenerationConfig(method="classic", gamma=3, max_slots=2, max_context=96))
    assert core.kv.capacity == cache_capacity([0], [96], 3)
    for n in (1, 7, 50, 91):
        room = core.max_tokens_room(n)
        assert room == 96 - n - 3 - 1
        core.check_request([5] * n, SamplingParams(max_tokens=room))
        assert cache_capacity([n], [room], 3) <= core.kv.capacity  # what fits the context fits the slot
        with pytest.raises(InputError, match="more than the model context"):
            core.check_request([5] * n, SamplingParams(max_tokens=room + 1))
    assert core.max_tokens_room(93) == -1  # a prompt this long has no room left
    with pytest.raises(InputError, match="more than the model context"):
        core.check_request([5] * 93, SamplingParams(max_tokens=1))


def test_memory_fit_refuses_what_does_not_fit(tiny_pair, monkeypatch):
    from dustin.engine import kv_manager
    from dustin.errors import OutOfMemoryError

    target, draft = (load_model(p) for p in tiny_pair)
    fit = MemoryFit([target.args, draft.args], 4, torch.device("cpu"))
    per_token = bytes_per_token([target.args, draft.args], 4)
    assert fit.bytes(3, 37) == kv_bytes([target.args, draft.args], 4, 3, 37) == 3 * 37 * per_token
    monkeypatch.setattr(kv_manager, "free_memory", lambda device: 100 * per_token)
    assert fit.fits(2, 45) and not fit.fits(2, 46)  # 90% of the free memory
    assert fit.fits(1, 45, copies=2) and not fit.fits(1, 46, copies=2)
    fit.require(2, 45)
    with pytest.raises(OutOfMemoryError, match=r"2 sequences x 46 positions need .* \(1 sequences would fit\): "
                                               r"lower --depths"):
        fit.require(2, 46, advice="lower --depths")
    with pytest.raises(ValueError, match="a batch needs >= 1"):
        fit.require(0, 46)
    monkeypatch.setattr(kv_manager, "free_memory", lambda device: None)  # unknown: fits
    assert fit.fits(10**6, 10**6)


def test_slot_table_takes_the_lowest_free_slot_and_one_block_per_row():
    table = SlotTable(4)
    assert [table.allocate() for _ in range(3)] == [0, 1, 2] and table.n_free == 1
    table.release(1)
    table.release(0)
    assert table.free_rows() == [0, 1, 3]
    assert table.allocate() == 0 and table.block_table(0) == [0] and table.block_table(2) == [2]
    assert [table.allocate(), table.allocate()] == [1, 3] and table.n_free == 0
    with pytest.raises(RuntimeError, match="no free KV-cache slot"):
        table.allocate()
    table.release(3)
    with pytest.raises(RuntimeError, match="slot 3 is not held"):
        table.release(3)
    with pytest.raises(ValueError, match=">= 1 slot"):
        SlotTable(0)


def test_the_manager_holds_the_slots_of_its_rows(tiny_pair):
    kv, _, _ = _manager(tiny_pair, slots=3)
    assert kv.slots == kv.table.slots == 3 and kv.table.free_rows() == [0, 1, 2]
