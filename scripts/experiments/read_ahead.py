"""Decode layers whose kernels read their weights before the PDL wait: what it buys per layer.

    PYTHONPATH=. python3 scripts/experiments/read_ahead.py [--layers 24] [--before FILE]

Why: under Programmatic Dependent Launch a kernel's programs may be resident while its predecessor still runs,
but until now they waited first thing, so each decode kernel still paid its weight stream's latency after the
predecessor completed (`launch_floor.py`: a stage that loads its weights before the wait costs its bytes + 0-0.6
us, against ~2x that launched plainly). `dustin/kernels/decode_linear.py` now reads each program's first weight
tile into registers before the wait (`_weights_ahead`), with `L2_AHEAD` also asks L2 for the rest of the
program's weights there, and loads the epilogue's inputs (residual, bias, rstd, cos / sin, positions) before its
K loop instead of after it.

This times `--layers` decode layers (qkv_rope, o_proj + residual + next norm, gate/up + SiLU, down_proj +
residual + next norm; no attention: o_proj reads the rotated q) of the 0.5B draft's and of the 1.5B target's
shapes at 16 rows, distinct random weights per layer (L2 cannot hold them), in one CUDA graph: the previous
kernels (`--before`, a copy of the module before this change) against the current ones with L2_AHEAD off and on,
PDL off and on; us per layer against the layer's weight bytes at the copy bandwidth, and the largest difference
of the output from the previous kernels' (same sums in the same order: expected 0). Writes
$OUT/read_ahead.json when OUT is set.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dustin.bench.decode import copy_bandwidth  # noqa: E402
from dustin.kernels import decode_linear as dl  # noqa: E402
from scripts.experiments.launch_floor import _time  # noqa: E402
from scripts.experiments.pdl_coresidency import Draft, set_pdl  # noqa: E402

SHAPES = {"qwen2.5-0.5b": (896, 14, 2, 64, 4864), "qwen2.5-1.5b": (1536, 12, 2, 128, 8960)}


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("decode_linear_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def layer_tiles(mod, shape, rows: int, warps: int) -> dict:
    """The tiles `mod` picks for a layer of `shape` at `rows` rows, with `warps` warps."""
    dim, hq, hkv, d, inter = shape
    bf = torch.bfloat16
    t = {"qkv": mod.qkv_tiles(rows, hq + 2 * hkv, d // 2, dim, bf),
         "o": mod.linear_tiles(rows, dim, hq * d, bf, splittable=True),
         "gate_up": mod.linear_tiles(rows, inter, dim, bf, splittable=False, halves=2),
         "down": mod.linear_tiles(rows, dim, inter, bf, splittable=True)}
    return {k: replace(v, warps=warps) for k, v in t.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--before", default=str(Path(__file__).with_name("_decode_linear_before.py")),
                    help="the decode_linear module to compare with (a copy of an earlier version)")
    args = ap.parse_args()
    before = load_module(args.before) if Path(args.before).exists() else None
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    out = {"device": torch.cuda.get_device_name(dev), "layers": args.layers, "batch": args.batch,
           "copy_bw_TBps": round(bw / 1e12, 3), "runs": []}
    # (name, module, READ_AHEAD, L2_AHEAD, warps): the module's own tiles, with `warps` warps where given
    variants = ([("before", before, None, None, None)] if before else []) + [
        ("epilogue inputs early", dl, False, False, None), ("epilogue inputs early, 8 warps", dl, False, False, 8),
        ("first tile ahead", dl, True, False, None), ("first tile ahead + L2", dl, True, True, None)]
    for shape_name, shape in SHAPES.items():
        model = Draft(args.layers, args.batch, dev, shape)
        floor = model.weight_bytes() / bw * 1e6
        ref = None
        for name, mod, ahead, l2, warps in variants:
            if ahead is not None:
                dl.READ_AHEAD, dl.L2_AHEAD = ahead, l2
            tiles = layer_tiles(mod, shape, args.batch, warps) if warps else None
            for pdl in (False, True):
                set_pdl(pdl)
                y = model.forward(tiles, mod=mod)
                torch.cuda.synchronize()
                ref = y.clone() if ref is None else ref
                us = _time(lambda md=model, m=mod, t=tiles: md.forward(t, mod=m), args.layers)
                run = {"shape": shape_name, "variant": name, "pdl": pdl, "us_per_layer": round(us, 2),
                       "weight_us_per_layer": round(floor, 2), "pct_of_weight_roofline": round(100 * floor / us, 1),
                       "max_abs_diff_vs_first": float((y.float() - ref.float()).abs().max())}
                out["runs"].append(run)
                print(json.dumps(run), flush=True)
        del model
    set_pdl(False)
    dl.READ_AHEAD = dl.L2_AHEAD = True
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "read_ahead.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
