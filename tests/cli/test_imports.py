"""The import graph of the dustin package: cycles and the command line's place, read from the source (nothing is
imported). The package layers and their order are tests/test_layers.py's.

Two rules:
- Only the command line (dustin/cli/, dustin/__main__.py) imports `dustin.cli`. Command modules take their shared
  flag groups from `dustin.flags`, which sits below them; a module importing the command line that imports it
  back only works as long as nobody changes the order in which the two start up.
- No cycles among module-level imports. A cycle makes a module's contents depend on which module of the circle
  was imported first (one of them sees the other half-initialized). Imports inside functions run after every
  module is loaded and do not count; neither do `if TYPE_CHECKING:` blocks, which never run.
An import names its module and, through Python's import system, the packages above it; a package's
`__init__.py` runs first, so `from a.b import c` is an edge to `a.b` (and to `a.b.c` when that is a module).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dustin"

KNOWN_CLI_IMPORTERS: frozenset[str] = frozenset()  # none: only dustin/cli and dustin/__main__ import it

# Module-level import cycles known today, each as the sorted tuple of its modules. Empty: none is tolerated.
KNOWN_CYCLES: frozenset[tuple[str, ...]] = frozenset()
# Cycles once the imports inside functions (and under TYPE_CHECKING) count too: a module that imports another
# only when called still depends on it. Empty: none is tolerated.
KNOWN_CYCLES_ALL_IMPORTS: frozenset[tuple[str, ...]] = frozenset()

# The package layers and their order are tests/test_layers.py's (the order docs/architecture.md states).


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, module_level: bool) -> list[tuple[str, int]]:
    """(imported name, line) of every import, absolute; module_level: skip function bodies and TYPE_CHECKING."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if module_level and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the else branch does run
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            found.extend((f"{target}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(module_level: bool) -> dict[str, dict[str, int]]:
    """module -> {dustin module it imports (the named module and the packages above it): first line}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: dict[str, int] = {}
        for target, line in _imports(tree, name, path.name == "__init__.py", module_level):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != name and not name.startswith(dep + "."):
                    edges.setdefault(dep, line)  # a module's own parent packages are already running
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[tuple[str, ...]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def _describe(cycle: tuple[str, ...], graph: dict[str, dict[str, int]]) -> str:
    members = set(cycle)
    return "; ".join(f"{m} -> {d} (line {line})" for m in cycle for d, line in sorted(graph[m].items())
                     if d in members)


def test_the_walk_sees_the_whole_package():
    graph = _graph(module_level=True)
    assert {"dustin", "dustin.cli.main", "dustin.flags", "dustin.runtime", "dustin.scoring"} <= set(graph)
    assert "dustin.flags" in graph["dustin.cli.main"]
    assert "dustin.engine.engine" in _graph(module_level=False)["dustin.cli.main"]  # imported inside main()


def test_only_the_command_line_imports_dustin_cli():
    graph = _graph(module_level=False)  # an import inside a function still points up into the command line
    importers = {m for m, deps in graph.items()
                 if any(d == "dustin.cli" or d.startswith("dustin.cli.") for d in deps)
                 and not (m == "dustin.cli" or m.startswith("dustin.cli.") or m == "dustin.__main__")}
    unexpected = sorted(importers - KNOWN_CLI_IMPORTERS)
    assert not unexpected, (f"these modules import dustin.cli; take shared flag groups from dustin.flags instead: "
                            f"{unexpected}")
    stale = sorted(KNOWN_CLI_IMPORTERS - importers)
    assert not stale, f"no longer import dustin.cli: remove them from KNOWN_CLI_IMPORTERS: {stale}"


def test_no_module_level_import_cycles():
    graph = _graph(module_level=True)
    cycles = set(_cycles(graph))
    unexpected = sorted(cycles - KNOWN_CYCLES)
    assert not unexpected, "module-level import cycles:\n" + "\n".join(_describe(c, graph) for c in unexpected)
    stale = sorted(KNOWN_CYCLES - cycles)
    assert not stale, f"these cycles are gone: remove them from KNOWN_CYCLES: {stale}"


def test_no_import_cycles_counting_imports_inside_functions():
    graph = _graph(module_level=False)
    cycles = set(_cycles(graph))
    unexpected = sorted(cycles - KNOWN_CYCLES_ALL_IMPORTS)
    assert not unexpected, "import cycles (imports inside functions included):\n" + "\n".join(
        _describe(c, graph) for c in unexpected)
    stale = sorted(KNOWN_CYCLES_ALL_IMPORTS - cycles)
    assert not stale, f"these cycles are gone: remove them from KNOWN_CYCLES_ALL_IMPORTS: {stale}"


def test_the_cycle_finder_finds_a_cycle_and_skips_what_does_not_run():
    src = ("from typing import TYPE_CHECKING\nimport dustin.b\nif TYPE_CHECKING:\n    import dustin.c\n"
           "else:\n    import dustin.d\ndef f():\n    import dustin.e\n")
    found = {name for name, _ in _imports(ast.parse(src), "dustin.a", False, module_level=True)}
    assert {"dustin.b", "dustin.d"} <= found and not {"dustin.c", "dustin.e"} & found
    found = {name for name, _ in _imports(ast.parse(src), "dustin.a", False, module_level=False)}
    assert {"dustin.c", "dustin.e"} <= found
    rel = {name for name, _ in _imports(ast.parse("from .x import y\nfrom .. import z\n"), "dustin.p.q", False,
                                          module_level=True)}
    assert {"dustin.p.x", "dustin.p.x.y", "dustin", "dustin.z"} <= rel
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {}}
    assert _cycles(graph) == [("a", "b", "c")]


# ------------------------------------------------------------------------------------------------ scripts/
# scripts/ holds what maintainers run again on a GPU (scripts/README.md); neither the package nor a test depends on
# it: a test that imports a script keeps that script in the tree, and the package must not need files it does not
# ship. Loading a script by its path (importlib, runpy, a subprocess) counts too, so any string naming scripts/ in
# code (docstrings and comments aside) is one; this file, the check itself, is exempt.
SCRIPTS = ROOT / "scripts"


def _names_scripts(value: object) -> bool:
    return isinstance(value, str) and (value == "scripts" or value.startswith(("scripts.", "scripts/")))


def _script_imports(tree: ast.Module) -> list[int]:
    """Lines that reach into scripts/: `import scripts...`, `from scripts... import`, and a string naming it
    ("scripts", "scripts/gpu_x.py", "scripts.gpu_x": a path or module name to load) outside docstrings."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            lines.update(node.lineno for alias in node.names if _names_scripts(alias.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and _names_scripts(node.module or ""):
            lines.add(node.lineno)
        elif isinstance(node, ast.Constant) and id(node) not in docstrings and _names_scripts(node.value):
            lines.add(node.lineno)
    return sorted(lines)


def test_no_test_and_no_dustin_module_imports_scripts():
    found = []
    for folder in (ROOT / "tests", PACKAGE):
        for path in sorted(folder.rglob("*.py")):
            if path.resolve() == Path(__file__).resolve():
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            found += [f"{path.relative_to(ROOT)}:{line}" for line in _script_imports(tree)]
    assert not found, ("these reach into scripts/; move what they need into dustin/, or remove the test with the "
                       f"script: {found}")


def test_the_scripts_check_finds_each_form():
    src = '''"""Tests of scripts/gpu_x.py."""
import scripts.gpu_x
from scripts import y
from scripts.experiments.z import w
import importlib.util, runpy, scriptsy
def f():
    """scripts/gpu_x.py, loaded by path."""
    path = ROOT / "scripts" / "gpu_x.py"
    spec = importlib.util.spec_from_file_location("gpu_x", path)
    runpy.run_path("scripts/gpu_x.py")  # scripts/gpu_x.py
    importlib.import_module("scripts.gpu_x")
    from .scripts import v
    return "my_scripts/", "descripts"
'''
    assert _script_imports(ast.parse(src)) == [2, 3, 4, 8, 10, 11]


def test_scripts_readme_lists_exactly_the_scripts():
    """Each script is one "- `name`: ..." line of scripts/README.md, and each such line is a script."""
    import re

    listed = re.findall(r"^- `([^`\s]+)`", (SCRIPTS / "README.md").read_text(encoding="utf-8"), flags=re.M)
    present = sorted(p.relative_to(SCRIPTS).as_posix() for p in SCRIPTS.rglob("*")
                     if p.is_file() and p.name != "README.md" and "__pycache__" not in p.parts)
    assert sorted(listed) == present and len(listed) == len(set(listed)), (listed, present)
