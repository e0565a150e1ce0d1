"""What the draft's LM head and its argmax cost per draft pass, by vocabulary size, on the GPU.

    python3 scripts/experiments/draft_head_cost.py [--rows 8,16,32] [--vocabs 151936,65536,48468,32768,16384]

Why: `scripts/experiments/draft_vocab.py` found that a draft proposing only from the 48,468 tokens of the
profiling texts keeps τ unchanged on held-out prompts. Whether that subset is worth building into the engine
depends on what the head costs in the step: this times `F.linear` of [rows, 896] bf16 against a [V, 896] weight
(the Qwen2.5-0.5B draft's tied embedding, or a frequency-ranked subset of its rows) plus the argmax over V, as
the step graph runs them (captured in a CUDA graph, 50 head passes a replay, each on its own weight copy so the
weight comes from HBM, not L2). Writes $OUT/draft_head_cost.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F


def time_head(rows: int, vocab: int, dim: int, passes: int, reps: int) -> dict:
    dev = torch.device("cuda")
    weights = [torch.randn(vocab, dim, device=dev, dtype=torch.bfloat16) for _ in range(4)]  # > L2 in all
    x = torch.randn(rows, dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty(rows, dtype=torch.long, device=dev)

    def body(argmax: bool):
        for i in range(passes):
            logits = F.linear(x, weights[i % len(weights)])
            if argmax:
                out.copy_(logits.argmax(-1))

    result = {"rows": rows, "vocab": vocab, "weight_mb": vocab * dim * 2 / 1e6}
    for name, argmax in (("gemm", False), ("gemm_argmax", True)):
        body(argmax)  # warm cuBLAS's choice before capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body(argmax)
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / (reps * passes)
        result[f"{name}_us"] = round(us, 2)
        result[f"{name}_tb_s"] = round(vocab * dim * 2 / (us * 1e-6) / 1e12, 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="8,16,32", help="rows of one draft pass (batch; the first pass has 2 a row)")
    ap.add_argument("--vocabs", default="151936,65536,48468,32768,16384")
    ap.add_argument("--dim", type=int, default=896)
    ap.add_argument("--passes", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("draft_head_cost.py: needs a CUDA GPU")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for vocab in (int(v) for v in args.vocabs.split(",")):
            r = time_head(rows, vocab, args.dim, args.passes, args.reps)
            results.append(r)
            print(json.dumps(r), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "draft_head_cost.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
