"""The KV-cache manager (engine/kv_manager.py): the caches it allocates and the whole-region operations the runner
leaves to it, against plain tensor indexing."""
from __future__ import annotations

import torch

from dustin.engine.kv_manager import KVManager, kv_bytes
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
