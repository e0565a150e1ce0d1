"""The generated parts of the documentation are what their generator writes (dustin/cli/docs.py): docs/cli.md
from the command line's parsers, and README.md's results table from the result files under docs/results/.
After changing a flag, its help, or a result file the table reads: `python3 -m dustin.cli.docs`."""
from __future__ import annotations

import functools

import pytest

from dustin.cli import docs


@pytest.fixture(scope="module", autouse=True)
def _generated_once():
    """README's results table and accuracy.md's RULER runs read the result files and bootstrap each RULER run's
    interval in Python (seconds a context); three tests here read them: each is computed once for the module (the
    same files, the same generator)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(docs, "ruler_runs", functools.cache(docs.ruler_runs))
        mp.setattr(docs, "results", functools.cache(docs.results))
        yield


def test_cli_reference_is_generated():
    assert docs.CLI_MD.read_text(encoding="utf-8") == docs.cli_markdown(), \
        "docs/cli.md is not what the parsers give: run `python3 -m dustin.cli.docs`"


def test_readme_results_table_is_generated():
    text = docs.README.read_text(encoding="utf-8")
    assert text.count(docs.START) == 1 and text.count(docs.END) == 1
    assert docs.readme_with_table(text, docs.results_table()) == text, \
        "README's results table is not what docs/results/ gives: run `python3 -m dustin.cli.docs`"
    assert "docs/results/readme_results.png" in text.split(docs.START)[0] + text.split(docs.END)[1]


def test_generated_parts_of_every_page_are_what_their_generators_write():
    """serving.md's flag table, choosing.md's methods, coming_from_vllm.md's memory table, accuracy.md's RULER runs
    (and cli.md, README's table): each page as `python3 -m dustin.cli.docs` writes it."""
    pages = docs.generated()
    assert {docs.CLI_MD, docs.README, docs.SERVING_MD, docs.CHOOSING_MD, docs.VLLM_MD, docs.ACCURACY_MD} <= set(pages)
    for path, text in pages.items():
        assert path.read_text(encoding="utf-8") == text, \
            f"{path.relative_to(docs.ROOT)} is not what `python3 -m dustin.cli.docs` writes: run it"
    serve = docs.serve_flags_markdown()
    for flag in ("`--max-slots`", "`--max-context`", "`--gamma`", "`--budget-p`", "`--budget-dense`",
                 "`--rope-scaling`", "`--draft-window`", "`--served-model-name`"):
        assert flag in serve, flag


def test_the_methods_table_marks_every_lossy_method():
    from dustin.engine.config import FULL_METHODS, LOSSY_METHODS, METHODS

    table = docs.methods_markdown()
    assert table.count("\n") == len(METHODS) + 1  # a header, its rule and one row per method
    for m in LOSSY_METHODS:
        assert f"| `{m}` | **lossy**" in table, m
    for m in FULL_METHODS:
        assert f"| `{m}` | **lossless**" in table, m


def test_memory_table_is_the_formula():
    """The KV bytes per position of the default pair give what 8 x 64k held on the H200 (docs/benchmarks.md: 15 GB
    for the target, 6.4 GB for the draft); each row's slots are the most that fit beside its weights."""
    from dustin.models.args import named_config

    target, draft = named_config("qwen2.5-1.5b"), named_config("qwen2.5-0.5b")
    assert round(8 * 65536 * target.kv_bytes_per_token(2) / 1e9, 1) == 15.0
    assert round(8 * 65536 * draft.kv_bytes_per_token(2) / 1e9, 1) == 6.4
    rows = docs.memory_rows()
    assert rows[0]["per_position"] == target.kv_bytes_per_token(2) + draft.kv_bytes_per_token(2)
    for r in rows:
        for (card, ctx), (slots, _) in r["fits"].items():
            size = dict(docs.MEMORY_CARDS)[card] * docs.MEMORY_SHARE
            per_slot = r["per_position"] * (ctx + 3 * 4 + 4)
            assert r["weights"] + slots * per_slot <= size or slots == 0
            assert r["weights"] + (slots + 1) * per_slot > size


def test_cli_reference_lists_every_command():
    from dustin.cli.main import build_parser

    text = docs.cli_markdown()
    for path in ("dustin generate", "dustin serve", "dustin models fetch", "dustin bench e2e", "dustin eval tasks",
                 "dustin profile", "dustin warmup"):
        assert f"## `{path}`" in text
    assert "`--budget-p`" in text and "`--max-slots`" in text
    build_parser()  # the reference reads the same parser the command line runs


def test_results_rows_name_existing_files():
    for row in docs.results():
        for rel in row["source"] if isinstance(row["source"], list) else [row["source"]]:
            assert (docs.RESULTS / rel).is_file(), rel


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    heading numbered (-1, -2, ...)."""
    import re

    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_link_of_the_docs_resolves():
    """Each relative link of README.md, docs/**/*.md and every folder's README.md names a file that exists and,
    with a #fragment, a heading of that page."""
    import re

    readmes = [p for p in docs.ROOT.rglob("README.md") if not any(part.startswith(".") for part in p.parts)]
    pages = sorted({docs.README, *(docs.ROOT / "docs").rglob("*.md"), *readmes})
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http(s):, mailto: ...
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(docs.ROOT)}: {target}")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{page.relative_to(docs.ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
