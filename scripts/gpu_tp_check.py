"""Tensor parallelism on real GPUs (NCCL): greedy output of the TP target equals the single-GPU output.

    python3 scripts/gpu_tp_check.py make /tmp/tpc                          # tiny random checkpoints
    torchrun --nproc-per-node 2 scripts/gpu_tp_check.py tp /tmp/tpc        # TP run, rank 0 saves its tokens
    python3 scripts/gpu_tp_check.py single /tmp/tpc [--json-out FILE]      # single GPU, compare

fp32 weights (so all_reduce's different summation order cannot flip a bf16 near-tie), Triton attention, for
vanilla / classic / magicdec / dustin / dustin-t / streaming, each with CUDA graphs (which then capture NCCL
all_reduces) and eager. The CPU tests (tests/parallel/test_tensor_parallel.py) check the same with gloo; this adds NCCL
and graph capture.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUNS = {
    "vanilla": {"method": "vanilla"},
    "classic": {"method": "classic"},
    "magicdec": {"method": "magicdec", "draft_window": 256},
    "dustin": {"method": "dustin", "draft_window": 256, "budget": 128},
    "dustin-t": {"method": "dustin-t", "draft_window": 256, "budget": 128},
    "streaming": {"method": "streaming", "draft_window": 256, "budget": 128},
}


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in (300, 1200, 2501)]  # the tokenizer's 96 ids


def _generate(folder: Path) -> dict:
    from dustin.engine.config import ExecutionOptions, GenerationConfig
    from dustin.engine.engine import Engine
    from dustin.engine.request import SamplingParams

    eng = Engine.from_pretrained(folder / "t", folder / "d", device="cuda", dtype="fp32", attention="triton")
    out = {}
    for name, kw in RUNS.items():
        for graphs in (True, False):
            cfg = GenerationConfig(options=ExecutionOptions(cuda_graphs=graphs), **kw)
            params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
            key = f"{name}{'' if graphs else ' (eager)'}"
            out[key] = [s.token_ids for s in eng.generate(_prompts(), cfg, params).sequences]
    return out


def main() -> int:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    if mode == "make":
        from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

        target = make_tiny_checkpoint(folder / "t", "qwen2", layers=4, dim=512, heads=8, kv_heads=4, seed=5,
                                      vocab=512)
        make_tiny_draft(target, folder / "d", noise=0.1)
        return 0
    out = _generate(folder)
    from dustin.parallel.tp import is_main_process, tp_rank_world

    if mode == "tp":
        if is_main_process():
            (folder / "tp_tokens.json").write_text(json.dumps({"world": tp_rank_world()[1], "tokens": out}))
        return 0
    tp = json.loads((folder / "tp_tokens.json").read_text())
    report = {"world": tp["world"], "runs": {}}
    for name, toks in out.items():
        same = toks == tp["tokens"][name]
        report["runs"][name] = {"tp_equals_single": same, "equals_vanilla": toks == out["vanilla"]}
        print(f"{name:22s} TP {tp['world']} == single GPU: {same}   == vanilla: {toks == out['vanilla']}", flush=True)
    if "--json-out" in sys.argv:
        Path(sys.argv[sys.argv.index("--json-out") + 1]).write_text(json.dumps(report, indent=1))
    return 0 if all(r["tp_equals_single"] for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
