"""The generated parts of the documentation are what their generator writes (dustin/cli/docs.py): docs/cli.md
from the command line's parsers, and README.md's results table from the result files under docs/results/.
After changing a flag, its help, or a result file the table reads: `python3 -m dustin.cli.docs`."""
from __future__ import annotations

from dustin.cli import docs


def test_cli_reference_is_generated():
    assert docs.CLI_MD.read_text(encoding="utf-8") == docs.cli_markdown(), \
        "docs/cli.md is not what the parsers give: run `python3 -m dustin.cli.docs`"


def test_readme_results_table_is_generated():
    text = docs.README.read_text(encoding="utf-8")
    assert text.count(docs.START) == 1 and text.count(docs.END) == 1
    assert docs.readme_with_table(text, docs.results_table()) == text, \
        "README's results table is not what docs/results/ gives: run `python3 -m dustin.cli.docs`"
    assert "docs/results/readme_results.png" in text.split(docs.START)[0] + text.split(docs.END)[1]


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
