"""Imports of dustin modules inside functions (docs/architecture.md, "Imports inside functions"), read with `ast`.

A dustin module imports what it uses at module level. An import of a dustin module inside a function is allowed
only
- in a module of LAZY_CLI: the command line's entry point, the shared flag groups and the command modules whose
  flags its parser loads. `dustin --help`, a command's --help and a mistyped flag answer without importing torch
  (tests/cli/test_cli.py), so these modules import torch, Triton and the engine inside the functions that run the
  command;
- on a line marked `# lazy: Triton`: the imported module loads Triton, and the importing one must load on a machine
  without it (Triton is a Linux-only dependency); test_triton_guards_import_without_triton holds each such module to
  that;
- on a line marked `# lazy: optional <package>`: the imported module needs an optional dependency.
Anything else fails with file:line: move the import to module level, or, where that makes a cycle, move what both
modules need into the lower one (tests/test_layers.py gives the order)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dustin"

# the modules the parser loads (dustin/cli/main.py: the entry point, `dustin.flags` for every command's flag
# groups, and each module of a `_command(...)` call, whose add_arguments builds that command's flags)
LAZY_CLI = frozenset({
    "dustin/cli/main.py", "dustin/flags.py", "dustin/cli/warmup.py",
    "dustin/bench/e2e.py", "dustin/bench/serve.py", "dustin/bench/attention.py", "dustin/bench/sampling.py",
    "dustin/eval/fidelity.py", "dustin/eval/retrieval.py", "dustin/eval/tasks.py", "dustin/eval/arr_kl.py",
    "dustin/serve/cli.py", "dustin/profiling/cli.py",
})

# (file, imported module) pairs allowed for now, each to move once its file is free (none left); the test fails on
# a listed pair that no longer occurs, so the list does not go stale
PENDING: frozenset[tuple[str, str]] = frozenset()

MARK = re.compile(r"#\s*lazy:\s*(Triton|optional [\w.-]+)\b")


def local_imports(source: str) -> list[tuple[int, str, str | None]]:
    """(line, imported dustin module, the `# lazy:` reason on its lines or None) of each import of a dustin module
    inside a function (a method and a nested function too) of one module's source."""
    lines = source.splitlines()
    seen: set[int] = set()
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if id(node) in seen:  # a nested function's import is seen from each function around it
                continue
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.split(".")[0] == "dustin"]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module] if (node.module or "").split(".")[0] == "dustin" else []
            else:
                continue
            seen.add(id(node))
            marks = (MARK.search(line) for line in lines[node.lineno - 1:node.end_lineno])
            reason = next((m.group(1) for m in marks if m), None)
            out += [(node.lineno, module, reason) for module in modules]
    return sorted(out)


def _files() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def violations(files: dict[str, str], lazy_cli=LAZY_CLI, pending=PENDING) -> list[str]:
    return [f"{name}:{line}: imports {module} inside a function"
            for name, source in files.items() if name not in lazy_cli
            for line, module, reason in local_imports(source)
            if reason is None and (name, module) not in pending]


def test_imports_inside_functions_are_lazy_cli_loads_or_marked():
    bad = violations(_files())
    assert not bad, ("move these imports to module level, or mark a Triton guard `# lazy: Triton` and an optional "
                     "dependency `# lazy: optional <package>` (docs/architecture.md):\n" + "\n".join(bad))


def test_the_lists_name_only_what_is_there():
    """LAZY_CLI holds modules that the parser loads and that import inside functions; PENDING what is pending."""
    files = _files()
    main = ast.parse(files["dustin/cli/main.py"])
    loaded = {"dustin/cli/main.py", "dustin/flags.py"} | {
        node.args[3].value.replace(".", "/") + ".py" for node in ast.walk(main)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_command"}
    assert LAZY_CLI <= loaded, f"not loaded by the parser: {sorted(LAZY_CLI - loaded)}"
    idle = sorted(name for name in LAZY_CLI if not local_imports(files[name]))
    assert not idle, f"no import inside a function any more: remove them from LAZY_CLI: {idle}"
    found = {(name, module) for name, source in files.items() for _, module, _ in local_imports(source)}
    assert PENDING <= found, f"moved: remove them from PENDING: {sorted(PENDING - found)}"


def test_a_local_import_is_caught_with_its_line():
    """The check itself, on a planted module: unmarked imports fail with file:line, wherever the function stands;
    marked ones, imports of other packages and a module of LAZY_CLI pass."""
    source = ('"""A module."""\nimport json\n\n\ndef f():\n    from dustin.engine import config\n\n\n'
              "class C:\n    def g(self):\n        def h():\n            import dustin.kernels.quest\n"
              "        from dustin.kernels.fused_ops import (  # lazy: Triton\n            silu_mul)\n"
              "        from dustin.serve.app import create_app  # lazy: optional fastapi\n"
              "        from torch import nn\n        from dustin.models import args  # lazy: not a reason\n")
    files = {"dustin/x.py": source, "dustin/cli/main.py": "def f():\n    from dustin.engine import engine\n"}
    assert local_imports(source) == [(6, "dustin.engine", None), (12, "dustin.kernels.quest", None),
                                     (13, "dustin.kernels.fused_ops", "Triton"),
                                     (15, "dustin.serve.app", "optional fastapi"), (17, "dustin.models", None)]
    assert violations(files) == ["dustin/x.py:6: imports dustin.engine inside a function",
                                 "dustin/x.py:12: imports dustin.kernels.quest inside a function",
                                 "dustin/x.py:17: imports dustin.models inside a function"]
    assert violations(files, pending={("dustin/x.py", "dustin.engine")})[0].startswith("dustin/x.py:12:")


def test_triton_guards_import_without_triton():
    """Each module with a `# lazy: Triton` import loads where Triton cannot be imported (as on a machine without
    it), and leaves Triton unloaded."""
    guarded = sorted(name.removesuffix(".py").replace("/", ".") for name, source in _files().items()
                     if any(reason == "Triton" for _, _, reason in local_imports(source)))
    assert "dustin.models.transformer" in guarded
    code = ("import importlib, sys\nsys.modules['triton'] = None  # `import triton` raises ImportError\n"
            f"for name in {guarded!r}:\n    try:\n        importlib.import_module(name)\n"
            "    except ImportError as e:\n        print(f'{name}: {e}')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and not proc.stdout, ("these load Triton at module level, so their `# lazy: Triton` "
                                                      "imports guard nothing:\n" + proc.stdout + proc.stderr[-3000:])
