"""Does Programmatic Dependent Launch overlap the draft's decode-layer kernels once two of them fit on one SM?

    PYTHONPATH=. python3 scripts/experiments/pdl_coresidency.py [--layers 24] [--budgets 0,98304,65536]
    PYTHONPATH=. python3 scripts/experiments/pdl_coresidency.py --compile-only     # no GPU: shared memory per launch

Why: `launch_floor.py` (H200, 2026-12-03) shows a stage under PDL costing its weight bytes + 0-0.6 us when its
programs load their weights before the grid-dependency wait; that needs the successor's programs to be resident
while the predecessor still runs. The engine's decode kernels ask for 144-192 KiB of shared memory a program at
the draft's shapes (o_proj and down_proj 160 KiB, gate/up 144 KiB at 16 rows, compiled for sm_90), so two never
share an SM (228 KiB): under PDL a successor waits for an SM, not for data, which fits the 3-4% PDL bought the
dustin step. This times the 0.5B draft's decode layer (qkv_rope, o_proj + residual + next norm, gate/up + SiLU,
down_proj + residual + next norm; the attention left out: o_proj reads the rotated q in its place) over `--layers`
layers of distinct random weights (the L2 cannot hold them) in one CUDA graph, for each shared-memory budget of
the tiles (0: the engine's own tiles; else the engine's tiles with pipeline stages, then BK, cut until the
pipeline's buffers fit the budget), with PDL off and on: us per layer against the layer's weight bytes at the
copy bandwidth, and the shared memory of each launch. The kernels still wait first thing (`pdl_start`); if a
capped budget turns PDL's few percent into much more, kernels that load their weights before the wait are the
next step. Writes $OUT/pdl_coresidency.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dustin.bench.decode import copy_bandwidth  # noqa: E402
from dustin.kernels import decode_linear as dl  # noqa: E402
from dustin.kernels import launch  # noqa: E402
from scripts.experiments.launch_floor import _time  # noqa: E402  (us per instance of n, in one CUDA graph)

DIM, HQ, HKV, D, INTER, EPS = 896, 14, 2, 64, 4864, 1e-6  # Qwen2.5-0.5B (the default draft)


def capped(t: dl.Tiles, weight_rows: int, bm: int, budget: int) -> dl.Tiles:
    """t with its pipeline's shared memory ((weight rows + rows) x BK x 2 bytes x stages) cut to `budget`: fewer
    stages first (down to 2), then a smaller BK (down to 32). budget 0: t as it is."""
    bk, stages = t.bk, t.stages
    while budget and (weight_rows + bm) * bk * 2 * stages > budget:
        if stages > 2:
            stages -= 1
        elif bk > 32:
            bk //= 2
        else:
            break
    return replace(t, bk=bk, stages=stages)


def layer_tiles(budget: int, rows: int) -> dict:
    """The four projections' tiles at `rows` rows, as the engine picks them, capped to `budget`."""
    bm, bf = dl._block_rows(rows), torch.bfloat16
    q = dl.qkv_tiles(rows, HQ + 2 * HKV, D // 2, DIM, bf)
    o = dl.linear_tiles(rows, DIM, HQ * D, bf, splittable=True)
    gu = dl.linear_tiles(rows, INTER, DIM, bf, splittable=False, halves=2)
    down = dl.linear_tiles(rows, DIM, INTER, bf, splittable=True)
    return {"qkv": capped(q, 2 * q.bn, bm, budget), "o": capped(o, o.bn, bm, budget),
            "gate_up": capped(gu, 2 * gu.bn, bm, budget), "down": capped(down, down.bn, bm, budget)}


class Draft:
    """`layers` decode layers of a model's shapes (the draft's by default) with random bf16 weights, their inputs
    and caches."""

    def __init__(self, layers: int, batch: int, device: torch.device, shape=(DIM, HQ, HKV, D, INTER)):
        g = torch.Generator(device=device).manual_seed(0)
        bf = torch.bfloat16
        self.dim, self.hq, self.hkv, self.d, self.inter = dim, hq, hkv, d, inter = shape

        def rnd(*shape, scale=0.02):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(bf)

        self.w = [{"qkv": rnd((hq + 2 * hkv) * d, dim), "b": rnd((hq + 2 * hkv) * d), "o": rnd(dim, hq * d),
                   "gu": rnd(2 * inter, dim), "down": rnd(dim, inter), "g1": rnd(dim, scale=1.0),
                   "g2": rnd(dim, scale=1.0)} for _ in range(layers)]
        self.x = rnd(batch, 1, dim, scale=1.0)
        self.cos = torch.ones(batch, 1, d, device=device)
        self.sin = torch.zeros(batch, 1, d, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.cache = torch.zeros(2, batch, hkv, 64, d, dtype=bf, device=device)

    def forward(self, tiles: dict | None = None) -> torch.Tensor:
        """The layers through dustin.kernels.decode_linear with `tiles` (None: the tiles it picks)."""
        t = tiles or {}
        x = self.x
        norm = dl.row_norm(x, self.w[0]["g1"], EPS)
        for i, w in enumerate(self.w):
            q = dl.qkv_rope(norm, w["qkv"], w["b"], self.cos, self.sin, self.pos, self.cache[0], self.cache[1],
                            n_heads=self.hq, n_kv_heads=self.hkv, tiles=t.get("qkv"))
            h, norm2 = dl.decode_linear(q, w["o"], residual=x, heads=self.hq, next_norm=(w["g2"], EPS),
                                        tiles=t.get("o"))
            a = dl.gate_up_silu(norm2, w["gu"], tiles=t.get("gate_up"))
            g_next = self.w[(i + 1) % len(self.w)]["g1"]
            x, norm = dl.decode_linear(a, w["down"], residual=h, next_norm=(g_next, EPS), tiles=t.get("down"))
        return x

    def weight_bytes(self) -> int:
        dim, hq, hkv, d, inter = self.dim, self.hq, self.hkv, self.d, self.inter
        return 2 * ((hq + 2 * hkv) * d * dim + dim * hq * d + 2 * inter * dim + dim * inter)


def set_pdl(on: bool) -> None:
    os.environ["DUSTIN_PDL"] = "1" if on else "0"
    launch.clear_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16, help="rows of a draft pass (one token per sequence)")
    ap.add_argument("--budgets", default="0,98304,65536", help="shared-memory budgets in bytes (0: the engine's)")
    ap.add_argument("--compile-only", action="store_true", help="compile every launch for sm_90, run nothing")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.compile_only:
        return compile_only(args, budgets)
    dev = torch.device("cuda")
    model = Draft(args.layers, args.batch, dev)
    bw = copy_bandwidth()
    floor = model.weight_bytes() / bw * 1e6
    rows = {"device": torch.cuda.get_device_name(dev), "layers": args.layers, "batch": args.batch,
            "copy_bw_TBps": round(bw / 1e12, 3), "weight_us_per_layer": round(floor, 2), "runs": []}
    ref = None
    for budget in budgets:
        tiles = layer_tiles(budget, args.batch)
        for pdl in (False, True):
            set_pdl(pdl)
            out = model.forward(tiles)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            us = _time(lambda t=tiles: model.forward(t), args.layers)  # us per layer
            run = {"budget": budget, "pdl": pdl, "us_per_layer": round(us, 2),
                   "pct_of_weight_roofline": round(100 * floor / us, 1),
                   "max_abs_diff_vs_first": float((out.float() - ref.float()).abs().max()),
                   "tiles": {k: [t.bn, t.bk, t.split, t.warps, t.stages] for k, t in tiles.items()}}
            rows["runs"].append(run)
            print(json.dumps(run), flush=True)
    set_pdl(False)
    print(json.dumps({k: v for k, v in rows.items() if k != "runs"}))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "pdl_coresidency.json").write_text(json.dumps(rows, indent=1))
    return 0


def compile_only(args, budgets: list[int]) -> int:
    """Each budget's launches compiled for sm_90 with PDL on, on CPU tensors: kernel, shared bytes, tiles."""
    from unittest import mock

    from tests.triton_compile import compile_launches

    model = Draft(1, args.batch, torch.device("cpu"))
    for budget in budgets:
        done: list = []
        with compile_launches(done), mock.patch.object(launch, "use_pdl", lambda device: True):
            model.forward(layer_tiles(budget, args.batch))
        for c in done:
            print(budget, c.name, c.shared, c.constexprs, c.pdl_order, sep="\t")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
