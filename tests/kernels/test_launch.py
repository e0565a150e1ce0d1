"""dustin's launch seam (dustin/kernels/launch.py): every Triton kernel launched under dustin/ passes through it,
a launch outside a watch is Triton's own, and a watch sees this thread's launches and runs them only if asked."""
from __future__ import annotations

import ast
import threading
from pathlib import Path

import torch
import triton
import triton.language as tl

from dustin.kernels.launch import Watched, watch_launches, watched

ROOT = Path(__file__).resolve().parents[2] / "dustin"


@watched
@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def _is_triton_jit(decorator: ast.expr) -> bool:
    d = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(d, ast.Attribute) and d.attr == "jit" and isinstance(d.value, ast.Name) and d.value.id == "triton"


def unwatched_launches(source: str) -> list[str]:
    """Module-level `@triton.jit` functions of `source` that it launches (`name[grid](...)`) without `@watched`."""
    tree = ast.parse(source)
    jits = {n.name: n for n in tree.body
            if isinstance(n, ast.FunctionDef) and any(_is_triton_jit(d) for d in n.decorator_list)}
    launched = {c.func.value.id for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)
                and isinstance(c.func.value, ast.Name) and c.func.value.id in jits}
    return sorted(name for name in launched
                  if not any(isinstance(d, ast.Name) and d.id == "watched" for d in jits[name].decorator_list))


def test_every_kernel_dustin_launches_is_watched():
    """The warm-up plans from the launches it sees; a kernel launched around the seam would compile on the first
    real step instead."""
    bad = [f"{path.relative_to(ROOT.parent)}: {name}" for path in sorted(ROOT.rglob("*.py"))
           for name in unwatched_launches(path.read_text())]
    assert not bad, f"Triton kernels launched without @watched (dustin/kernels/launch.py): {bad}"
    assert len([p for p in ROOT.rglob("*.py") if "@watched" in p.read_text()]) >= 8  # the scan finds our kernels


def test_the_scan_finds_an_unwatched_launch():
    source = ("import triton\n@triton.jit\ndef _k(x):\n    pass\n@watched\n@triton.jit\ndef _w(x):\n    pass\n"
              "def run(x):\n    _k[(1,)](x)\n    _w[(1,)](x)\n")
    assert unwatched_launches(source) == ["_k"]


def test_outside_a_watch_the_launch_is_tritons_own():
    assert isinstance(_add_one, Watched) and _add_one.__name__ == "_add_one"
    x = torch.zeros(8)
    _add_one[(1,)](x, 5, BLOCK=8)
    assert x.tolist() == [1.0] * 5 + [0.0] * 3


def test_a_watch_sees_launches_and_runs_them_only_if_asked():
    x = torch.zeros(8)
    seen = []
    with watch_launches(lambda jit, args, kwargs: seen.append((jit, args[1], dict(kwargs))), execute=False):
        assert _add_one[(1,)](x, 5, BLOCK=8) is None
    assert seen == [(_add_one.jit, 5, {"BLOCK": 8})] and float(x.sum()) == 0.0  # seen, not run
    with watch_launches(lambda *a: seen.append(a), execute=True):
        _add_one[(1,)](x, 3, BLOCK=8)
    assert len(seen) == 2 and x.tolist() == [1.0] * 3 + [0.0] * 5
    _add_one[(1,)](x, 3, BLOCK=8)  # the watch is closed: not seen, run
    assert len(seen) == 2 and x.tolist() == [2.0] * 3 + [0.0] * 5


def test_watches_are_per_thread_and_nest():
    x, y = torch.zeros(8), torch.zeros(8)
    outer, inner = [], []
    with watch_launches(lambda *a: outer.append(a), execute=False):
        t = threading.Thread(target=lambda: _add_one[(1,)](y, 8, BLOCK=8))  # another thread: not watched
        t.start()
        t.join()
        with watch_launches(lambda *a: inner.append(a), execute=True):
            _add_one[(1,)](x, 2, BLOCK=8)
        _add_one[(1,)](x, 4, BLOCK=8)
    assert y.tolist() == [1.0] * 8
    assert len(inner) == 1 and len(outer) == 1 and x.tolist() == [1.0] * 2 + [0.0] * 6
