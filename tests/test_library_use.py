"""dustin uses its libraries through their public surface: no module assigns to an attribute of a torch or
Triton object (Triton's documented `knobs` apart), imports a private Triton name, or searches the heap
(`gc.get_referrers`). Such surgery breaks silently on a library upgrade; the kernel warm-up once relied on three
kinds of it (dustin/engine/warmup.py says how it does without)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "dustin"
LIBRARIES = {"torch", "triton", "transformers", "safetensors", "numpy", "fastapi", "uvicorn", "gguf"}
PUBLIC_SETTINGS = ("knobs.",)  # Triton's configuration object, documented for assignment
FORBIDDEN_NAMES = {"get_referrers", "_init_handles", "device_caches", "_pack_args", "_do_compile"}


def surgery(source: str) -> list[str]:
    """What in `source` touches a library's internals: (line, what) as text."""
    tree = ast.parse(source)
    library_names: dict[str, str] = {}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    library_names[(a.asname or a.name).split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            private = [p for p in node.module.split(".") if p.startswith("_")] + [
                a.name for a in node.names if a.name.startswith("_")]
            if node.module.startswith("triton") and private:
                out.append(f"{node.lineno}: private Triton name {private[0]} imported")
            for a in node.names:
                library_names[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = [node.args[0]] if node.args else []
            if targets and isinstance(targets[0], ast.Name) and targets[0].id in library_names:
                out.append(f"{node.lineno}: {node.func.id} on {targets[0].id}")
            continue
        for t in targets:
            root = t
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            text = ast.unparse(t)
            if t is not root and isinstance(root, ast.Name) and root.id in library_names \
                    and not any(s in text for s in PUBLIC_SETTINGS):
                out.append(f"{node.lineno}: assigns {text}")
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            out.append(f"{node.lineno}: uses .{node.attr}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and library_names.get(root.id, "").startswith("triton"):
                out.append(f"{node.lineno}: private Triton name {ast.unparse(node)}")
    return out


def test_no_library_surgery_in_dustin():
    bad = [f"{path.relative_to(ROOT.parent)}:{finding}" for path in sorted(ROOT.rglob("*.py"))
           for finding in surgery(path.read_text())]
    assert not bad, bad


def test_the_check_finds_surgery():
    source = ("import gc\nimport triton\nfrom triton.runtime.jit import JITFunction\n"
              "from torch._subclasses.fake_tensor import FakeTensor\nfrom triton._C import libtriton\n"
              "JITFunction.run = None\nFakeTensor.__new__ = staticmethod(None)\ntriton.knobs.compilation.listener = 1\n"
              "gc.get_referrers(1)\nk.device_caches[0]\nx = triton.runtime._cache\n")
    found = surgery(source)
    assert sorted(int(f.split(":")[0]) for f in found) == [5, 6, 7, 9, 10, 11], found
