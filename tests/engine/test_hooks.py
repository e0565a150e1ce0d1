"""The library internals the warm-up's dry run hooks into (dustin/engine/hooks.py): each test fails when what the
hook relies on changes in Triton or PyTorch, and checks the hook does its job and leaves nothing behind."""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from dustin.engine.hooks import intercept_launches, kernel_classes, sweep_fakes, track_fakes


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def test_triton_kernel_run_takes_grid_and_warmup_keywords():
    for cls in kernel_classes():
        params = inspect.signature(cls.run).parameters
        assert "grid" in params and "warmup" in params, cls


def test_intercepted_launches_are_seen_run_only_when_asked_and_the_hook_leaves():
    originals = {cls: cls.run for cls in kernel_classes()}
    x = torch.zeros(8)
    seen = []
    with intercept_launches(lambda kernel, args, kwargs: seen.append((args[1], dict(kwargs))), execute=False):
        _add_one[(1,)](x, 5, BLOCK=8)
    assert seen == [(5, {"BLOCK": 8})] and float(x.sum()) == 0.0  # recorded, not run
    with intercept_launches(lambda *a: seen.append(a), execute=True):
        _add_one[(1,)](x, 5, BLOCK=8)
    assert len(seen) == 2 and x.tolist() == [1.0] * 5 + [0.0] * 3
    assert all(cls.run is run for cls, run in originals.items())  # unwrapped once no block is open
    _add_one[(1,)](x, 5, BLOCK=8)
    assert len(seen) == 2 and x.tolist() == [2.0] * 5 + [0.0] * 3


class _Holder:
    cache: dict = {}


def test_fake_tensor_new_is_wrapped_and_survivors_in_dicts_are_swept():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    original = FakeTensor.__dict__["__new__"]
    assert isinstance(original, staticmethod)  # what track_fakes wraps and puts back
    with track_fakes() as refs, FakeTensorMode():
        _Holder.cache["buffer"] = torch.zeros(3)
        torch.ones(2)  # dropped at once
    assert FakeTensor.__dict__["__new__"] is original
    assert any(r() is _Holder.cache["buffer"] for r in refs)
    removed, left = sweep_fakes(refs)
    assert removed == ["_Holder.cache['buffer']"] and left == [] and _Holder.cache == {}
