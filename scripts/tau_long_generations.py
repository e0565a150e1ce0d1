"""τ of the sparse configs on long generations: the shipped tuned config against the 3-layer S_draft config and the
hand-written fallback (`--config builtin`), beside full verification with the same streaming draft (magicdec).

Each row is one `dustin generate` process on the same held-out code prompts (`dustin bench e2e --real`'s `code`
texts cut to --context tokens), greedy, --ignore-eos, --new-tokens tokens each. Reports τ (accepted tokens per
step + 1), decode tokens/s and, per row, how many prompts' outputs equal full verification's token for token and
the mean length of the common prefix: full verification is exact, so that is how far each sparse config follows
the target's own greedy output.

    python3 scripts/tau_long_generations.py --device cpu --context 4096 --prompts 4 --new-tokens 256 --out DIR
Writes DIR/tau_long_generations.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS = [  # (label, method, --config or None for the shipped one)
    ("full verify (magicdec)", "magicdec", None),
    ("dustin, shipped config (11 draft layers)", "dustin", None),
    ("dustin, 3-layer S_draft config", "dustin", "docs/results/profile_h200/config_3_draft_layers.json"),
    ("dustin, hand-written config", "dustin", "builtin"),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--budget", default="512")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from transformers import AutoTokenizer

    from dustin.bench.serve import make_prompts
    from dustin.eval.inputs import common_prefix
    from dustin.models.fetch import resolve_model_path

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(resolve_model_path("default", "target")))
    room = a.context - a.new_tokens - 8
    ids = make_prompts(tok, "code", (room, room), a.prompts, 0, len(tok))
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": tok.decode(x)}) + "\n" for x in ids))
    res = {"date": time.strftime("%Y-%m-%d"), "device": a.device, "dtype": a.dtype, "context": a.context,
           "prompts": a.prompts, "new_tokens": a.new_tokens, "budget": a.budget, "rows": []}
    ref = None
    for label, method, config in ROWS:
        cmd = [sys.executable, "-m", "dustin", "generate", "--device", a.device, "--dtype", a.dtype,
               "--method", method, "--prompts-jsonl", str(prompts), "--max-new-tokens", str(a.new_tokens),
               "--ignore-eos", "--json"]
        if method == "dustin":
            cmd += ["--budget", a.budget] + (["--config", config] if config else [])
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(f"{label}: failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            return 1
        r = json.loads(proc.stdout)
        toks = [s["token_ids"] for s in r["sequences"]]
        ref = toks if ref is None else ref
        row = {"row": label, "method": method, "config": config or "shipped", "tau": r["tau"],
               "tokens_per_s": r["tokens_per_s"], "steps": r["steps"], "wall_s": round(time.time() - t0, 1),
               "prompt_lens": [s["prompt_len"] for s in r["sequences"]],
               "same_as_full_verify": sum(x == y for x, y in zip(toks, ref, strict=True)),
               "mean_common_prefix": sum(common_prefix(x, y) for x, y in zip(toks, ref, strict=True)) / len(ref),
               "token_ids": toks}
        res["rows"].append(row)
        print(f"{label}: tau {row['tau']:.3f}, {row['tokens_per_s']:.1f} tokens/s, same as full verify "
              f"{row['same_as_full_verify']}/{len(ref)}, mean common prefix {row['mean_common_prefix']:.1f} "
              f"of {a.new_tokens} ({row['wall_s']} s)", flush=True)
        (out / "tau_long_generations.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
