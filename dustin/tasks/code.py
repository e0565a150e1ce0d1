"""Long-context code completion (LCC-style): predict the next non-trivial line of a real Python file.

Our default pair is a coder pair, and code completion is where its long-context use is: the answer (a call,
a name defined 20k tokens earlier) depends on what sparse verification may drop. Sample i of (context, seed)
takes a long file of the `heldout` split of `dustin.data.corpora.python_sources` (standard library and
installed packages; the `profile` split fed the profiling traces), a target line in its second half, and as
context the code before that line; when the file is shorter than the context, the other long files of the
same folder come first, each under a `# file: <name>` header (a repository-level prompt). The prompt is
LongBench's `lcc` template without a chat template (LongBench's rule for lcc), truncated on the left to fit.
Metrics: LongBench's code edit similarity (the first code line of the prediction against the reference,
rapidfuzz ratio; both stripped of indentation) and exact match of that line.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

from dustin.data.corpora import python_sources
from dustin.errors import InputError
from dustin.tasks.base import Sample, register
from dustin.tasks.metrics import exact_match, first_code_line, fuzz_ratio

TEMPLATE_HEAD = "Please complete the code given below. \n"
TEMPLATE_TAIL = "Next line of code:\n"
MAX_NEW_TOKENS = 64  # LongBench's lcc generation length
_IDENT = re.compile(r"[A-Za-z_]\w*")
_TRIVIAL = re.compile(r"^(else:|try:|finally:|pass|return|break|continue|[)\]}]+[,:]?|\w+:)$")


def candidate_lines(lines: list[str]) -> list[int]:
    """Indices of non-trivial code lines: at least 12 characters and two identifiers, not a comment, a bare
    keyword or bracket, not a lone continued argument (`name,`), and not inside a triple-quoted string
    (tracked by counting the quotes before the line)."""
    out, in_string = [], False
    for i, line in enumerate(lines):
        s = line.strip()
        quotes = s.count('"""') + s.count("'''")
        lone_arg = s.endswith(",") and "(" not in s and "=" not in s
        if (not in_string and quotes == 0 and len(s) >= 12 and not s.startswith("#") and not _TRIVIAL.match(s)
                and not lone_arg and len(_IDENT.findall(s)) >= 2):
            out.append(i)
        if quotes % 2:
            in_string = not in_string
    return out


class CodeCompletion:
    name = "code_completion"
    family = "code"
    max_new_tokens = MAX_NEW_TOKENS

    def check_data(self) -> None:
        """Nothing to check: the sources are this Python's standard library and installed packages."""

    def samples(self, tokenizer, context: int, n: int, seed: int) -> list[Sample]:
        files = python_sources("heldout")
        if not files:
            raise InputError("no long Python files found for code completion")
        def enc(text):
            return tokenizer.encode(text, add_special_tokens=False, verbose=False)
        head, tail = enc(TEMPLATE_HEAD), enc(TEMPLATE_TAIL)
        budget = context - self.max_new_tokens - len(head) - len(tail)
        if budget < 256:
            raise InputError(f"code completion needs contexts of at least "
                             f"{256 + self.max_new_tokens + len(head) + len(tail)} tokens, got {context}")
        out = []
        for i in range(n):
            rng = random.Random(seed * 1_000_003 + i)  # sample i does not depend on n
            path = files[rng.randrange(len(files))]
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            cands = [j for j in candidate_lines(lines) if j >= len(lines) // 2] or candidate_lines(lines)
            j = cands[rng.randrange(len(cands))]
            text = _context_before(path, f"# file: {path.name}\n" + "".join(lines[:j]), 6 * budget, files)
            ids = enc(text)[-budget:]
            out.append(Sample(self.name, context, i, head + ids + tail, [lines[j].strip()], self.max_new_tokens,
                              {"file": f"{path.parent.name}/{path.name}", "line": j + 1}))
        return out

    def score(self, prediction: str, references: list[str]) -> float:
        return self.metrics(prediction, references)["edit_sim"]

    def metrics(self, prediction: str, references: list[str]) -> dict[str, float]:
        """LongBench's code similarity on the prediction's first code line (its pick), stripped like our
        references (indentation is not scored), and exact match of that line."""
        line = first_code_line(prediction).strip()
        return {"edit_sim": max(fuzz_ratio(line, r) for r in references), "exact_match": exact_match(line, references)}


def _context_before(path: Path, own: str, chars: int, pool: list[Path]) -> str:
    """The file's text before the target line, preceded, while shorter than `chars` characters, by the other
    long files of its folder and then by the pool's files that follow it (a deterministic order); cut to
    about `chars` characters from the left."""
    text = own
    same = [p for p in sorted(path.parent.glob("*.py"), reverse=True) if p != path and p.stat().st_size > 2000]
    start = pool.index(path) if path in pool else 0
    for other in same + pool[start + 1:] + pool[:start]:
        if len(text) >= chars:
            break
        if other != path:
            header = other.name if other.parent == path.parent else f"{other.parent.name}/{other.name}"
            text = f"# file: {header}\n{other.read_text(encoding='utf-8', errors='replace')}\n" + text
    return text[-chars:]


register(CodeCompletion())
