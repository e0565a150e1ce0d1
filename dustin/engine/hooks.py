"""The two places where the engine hooks into library internals, both for the warm-up's dry run
(dustin/engine/warmup.py), kept here so that nothing else does and one test watches what they rely on
(tests/engine/test_hooks.py fails when an internal changes):

- `intercept_launches`: Triton has no public way to see the kernel launches a piece of code makes without running
  them, and the warm-up plans its compiles from exactly those launches. While a block is open, the `run` method
  of Triton's `JITFunction` (and of the interpreter's `InterpretedFunction`) is wrapped; it relies on `run`
  taking the keyword arguments `grid` and `warmup` (Triton 3.x).
- `track_fakes` / `sweep_fakes`: PyTorch's FakeTensorMode has no public registry of the fake tensors it made, and
  a fake tensor that code run under it stored in a global cache would later be read as a real one (address 0).
  `FakeTensor.__new__` (a staticmethod in the class's `__dict__`) is wrapped while a block is open; afterwards
  the survivors are found through `gc.get_referrers` and deleted from the dicts that hold them.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import types
import weakref
from typing import Any

_local = threading.local()
_patch_lock = threading.Lock()
_patched: dict[type, Any] = {}
_patch_users = 0


def kernel_classes() -> list[type]:
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - every Triton we support has the interpreter
        pass
    return classes


def _recording_run(original):
    def run(self, *args, grid, warmup, **kwargs):
        tap = getattr(_local, "tap", None)
        if tap is None or warmup:  # other threads, and compiles, pass straight through
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        on_launch, execute = tap
        on_launch(self, args, kwargs)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs) if execute else None

    run.__wrapped__ = original
    return run


@contextlib.contextmanager
def intercept_launches(on_launch, execute: bool):
    """Within the block, each Triton kernel launch of this thread calls `on_launch(kernel, args, kwargs)` and runs
    only if `execute`. Other threads' launches, and `warmup=True` compiles, are not affected (the hook is installed
    while any block is open and looks at the calling thread)."""
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            for cls in kernel_classes():
                _patched[cls] = cls.run
                cls.run = _recording_run(cls.run)
        _patch_users += 1
    outer, _local.tap = getattr(_local, "tap", None), (on_launch, execute)
    try:
        yield
    finally:
        _local.tap = outer
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                for cls, original in _patched.items():
                    cls.run = original
                _patched.clear()


@contextlib.contextmanager
def track_fakes():
    """Within the block, a weak reference to every fake tensor created (yields the list)."""
    from torch._subclasses.fake_tensor import FakeTensor

    refs: list[weakref.ref] = []
    original = FakeTensor.__dict__["__new__"]

    def new(cls, *args, **kwargs):
        t = original.__func__(cls, *args, **kwargs)
        refs.append(weakref.ref(t))
        return t

    FakeTensor.__new__ = staticmethod(new)
    try:
        yield refs
    finally:
        FakeTensor.__new__ = original


def sweep_fakes(refs: list[weakref.ref]) -> tuple[list[str], list[str]]:
    """Fake tensors of a finished dry run that are still referenced were stored by the code it ran somewhere that
    outlives it: a global cache (e.g. a per-device buffer made on first use). A real launch would later read that
    fake tensor's address (0). Dict entries holding one are deleted (the code makes a real one on its next use);
    returns (where entries were deleted, where fake tensors are still held)."""
    gc.collect()
    removed: list[str] = []
    for ref in refs:
        if ref() is not None:
            _drop_from_dicts(ref(), removed)
    if not removed and all(ref() is None for ref in refs):
        return removed, []
    gc.collect()
    left = [_holders(ref()) for ref in refs if ref() is not None]
    return removed, left


def _drop_from_dicts(t, removed: list[str]) -> None:
    for holder in gc.get_referrers(t):
        if isinstance(holder, dict):
            for key in [k for k, v in holder.items() if v is t]:
                del holder[key]
                removed.append(f"{_owner(holder)}[{key!r}]")


def _holders(t) -> str:
    return ", ".join(sorted({type(h).__name__ for h in gc.get_referrers(t) if not isinstance(h, types.FrameType)}))


def _owner(d: dict) -> str:
    """What holds dict d, for messages: "Class.attr" or "module.attr" (else "a dict")."""
    for o in gc.get_referrers(d):
        if isinstance(o, dict):
            key = next((k for k, v in o.items() if v is d), None)
            for oo in gc.get_referrers(o):
                if isinstance(oo, (type, types.ModuleType)) and oo.__dict__.get(key) is d:
                    return f"{getattr(oo, '__qualname__', oo.__name__)}.{key}"
    return "a dict"
