"""The package layers of docs/architecture.md, held against every import in the code.

Each import of a dustin module, at module level or inside a function (`ast`, so an import hidden in a function to
dodge a cycle counts too), must point to its own package or to one below it in `LAYERS`. A cycle between packages
needs an import that points up, so a new cycle fails here, as does a package missing from the list."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dustin"

# top to bottom; a package imports only its own modules and those of packages below it (docs/architecture.md)
LAYERS = [
    "__main__", "cli", "bench", "profiling", "serve", "__init__", "llm", "eval", "tasks", "data", "flags", "engine",
    "parallel", "selection", "models", "attention", "kernels", "cache", "scoring", "runtime", "rng", "defaults",
    "errors",
]


def _package(path: Path) -> str:
    """A module's package ("engine" for dustin/engine/worker/step.py), or a top-level module's own name."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported(module: str) -> str:
    """The package of an imported dustin module ("__init__" for `import dustin`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def dustin_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a dustin module in one file, wherever it stands."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "dustin"]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (the tree uses absolute ones)"
            if node.module and node.module.split(".")[0] == "dustin":
                if node.module == "dustin":  # `from dustin import engine` names packages, not only symbols
                    out += [(node.lineno, f"dustin.{a.name}") if (ROOT / a.name).exists()
                            or (ROOT / f"{a.name}.py").exists() else (node.lineno, "dustin") for a in node.names]
                else:
                    out.append((node.lineno, node.module))
    return out


def violations(layers: list[str]) -> list[str]:
    rank = {name: i for i, name in enumerate(layers)}
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        own = _package(path)
        if own not in rank:
            bad.append(f"{path.relative_to(ROOT.parent)}: package {own!r} has no place in LAYERS")
            continue
        for line, module in dustin_imports(path):
            target = _imported(module)
            if target != own and rank.get(target, -1) <= rank[own]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {own} imports {module}, "
                           f"which is not below it")
    return bad


def test_every_import_points_down_the_layers():
    assert violations(LAYERS) == []


def test_an_upward_import_is_caught():
    """The check itself: with kernels placed above models, the models' imports of kernels point up, inside
    functions too (dustin/models/transformer.py imports them there)."""
    swapped = [p for p in LAYERS if p != "kernels"]
    swapped.insert(swapped.index("models"), "kernels")
    found = violations(swapped)
    assert any("dustin/models/transformer.py" in v and "imports dustin.kernels" in v for v in found), found


@pytest.mark.parametrize("source, module", [
    ("import dustin.engine.core\n", "dustin.engine.core"),
    ("def f():\n    from dustin.kernels import fused_ops\n", "dustin.kernels"),
    ("from dustin import __version__\n", "dustin"),
])
def test_imports_are_found_wherever_they_stand(tmp_path, source, module):
    f = tmp_path / "m.py"
    f.write_text(source)
    assert dustin_imports(f) == [(1 if "def" not in source else 2, module)]


def test_the_documented_order_is_this_one():
    """docs/architecture.md states the order this test holds the code to."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    assert " → ".join(p for p in LAYERS if p not in ("__main__", "__init__")) in doc
