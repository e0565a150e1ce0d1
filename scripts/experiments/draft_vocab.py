"""How much acceptance a draft loses when it proposes only from a frequency-ranked subset of the vocabulary.

    python3 scripts/experiments/draft_vocab.py [--sizes 16384,32768,65536] [--prompts 8] [--context 1024]

Why: the draft's LM head is the largest single read of a draft pass (Qwen2.5-0.5B, tied embeddings: 151,936 x 896
bf16 = 272 MB, ~65 µs at the H200's bandwidth, four times a step, plus an argmax over 152k logits each time: ~0.3
ms of a ~6.3 ms step at 16 x 32k). A draft that scores only the N most frequent tokens (FR-Spec, Zhao et al.
2025) reads N / 151,936 of it. Verification stays exact whatever the draft proposes; what a subset costs is
acceptance: a token outside it can never be proposed. This measures that cost on the real pair before any kernel
is written: the draft's logits outside the subset are masked (a forward hook on its lm_head, so the argmax is
the subset's), and τ under full verification (`classic`, greedy) is compared with the unmasked draft on the same
held-out code and prose prompts. Token frequencies come from the profiling split of the same corpora (never the
held-out texts), plus every special token. CPU is enough (τ does not depend on speed). Writes
$OUT/draft_vocab.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dustin.bench.e2e import real_prompts  # noqa: E402
from dustin.data.corpora import essays, python_sources  # noqa: E402
from dustin.engine.config import GenerationConfig  # noqa: E402
from dustin.engine.engine import Engine  # noqa: E402


def frequency_order(tokenizer, max_files: int = 2000) -> list[int]:
    """Token ids by descending count over the profiling split's Python sources and essays."""
    counts: Counter = Counter()
    for path in python_sources("profile")[:max_files]:
        counts.update(tokenizer.encode(path.read_text(errors="ignore")))
    for text in essays("profile"):
        counts.update(tokenizer.encode(text))
    return [t for t, _ in counts.most_common()]


def subset_mask(order: list[int], size: int, vocab: int, special: list[int]) -> torch.Tensor:
    """0 on the `size` most frequent ids and the special ids, -inf elsewhere: [vocab] fp32."""
    mask = torch.full((vocab,), float("-inf"))
    keep = torch.tensor(order[:size] + special, dtype=torch.long)
    mask[keep[keep < vocab]] = 0.0
    return mask


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16384,32768,65536")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per kind (code, prose)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    engine = Engine.from_pretrained("default", "default", device=args.device)
    tok = engine.tokenizer
    t0 = time.perf_counter()
    order = frequency_order(tok)
    special = sorted(set(tok.all_special_ids) | set(engine.eos_ids))
    vocab = engine.draft.args.vocab_size
    report = {"context": args.context, "new_tokens": args.new_tokens, "prompts_per_kind": args.prompts,
              "ranked_tokens": len(order), "vocab": vocab, "rows": []}
    print(f"{len(order)} distinct tokens in the profiling split ({time.perf_counter() - t0:.0f} s)", flush=True)
    cfg = GenerationConfig(method="classic", max_new_tokens=args.new_tokens, stop_at_eos=False)
    for kind in ("code", "prose"):
        prompts = real_prompts(tok, kind, args.context, args.prompts, seed=0)
        for size in [0] + [int(s) for s in args.sizes.split(",")]:
            hook = None
            if size:
                mask = subset_mask(order, size, vocab, special).to(engine.device)
                hook = engine.draft.lm_head.register_forward_hook(lambda m, i, out, mask=mask: out + mask.to(out.dtype))
            try:
                t1 = time.perf_counter()
                res = engine.generate(prompts, cfg)
            finally:
                if hook is not None:
                    hook.remove()
            out_ids = [t for s in res.sequences for t in s.token_ids]
            covered = sum(1 for t in out_ids if t in set(order[:size]) or t in special) / len(out_ids) if size else 1.0
            row = {"kind": kind, "subset": size or "full", "tau": round(res.tau, 4),
                   "share_of_output_tokens_in_subset": round(covered, 4), "s": round(time.perf_counter() - t1, 1)}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "draft_vocab.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
