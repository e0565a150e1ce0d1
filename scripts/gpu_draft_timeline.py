"""Where the persistent draft kernel's time goes: its profiling build (dustin/kernels/draft_decoder.py,
`DraftDecoder(timeline=True)`) records, per instruction of every program, the SM clock when it started, when its
inputs were ready (the counter wait), when its activations were staged (load + RMSNorm into shared memory), when its
weight tile had landed, after the MMAs and at its end (epilogue, split merge, the counter's release). This splits
each program's time into those phases, per stage (QKV, ATT, O, GU, DOWN, HEAD), and gives each stage's span
across the SMs per layer. Random weights of a draft's shapes (timing does not depend on the values).

    PYTHONPATH=. python3 scripts/gpu_draft_timeline.py --draft qwen2.5-0.5b --batch 16

Prints a summary per T (1, and 2 as a step's first draft forward); with OUT set, writes
$OUT/draft_timeline_<draft>.json (the summary) and $OUT/draft_timeline_<draft>_T<T>.pt (the raw record and the
instruction lists) for plotting (`--plot <.pt>` draws a PNG beside it, on any machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gpu_draft_decoder import draft_arguments  # scripts/ is the script's own folder on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS = ("QKV", "ATT", "O", "GU", "DOWN", "HEAD")
PHASES = ("inputs", "staged", "weights", "gemm", "end")  # each phase ends at that mark; it starts at the one before


def summarize(lists, marks, freq_ghz: float) -> dict:
    """Per op: instructions, mean ns of each phase; per program: share of its busy time in each phase; per stage
    (layer, op): its span over the SMs (globaltimer of the first start to the last end)."""
    import torch
    n_sms = len(lists)
    per_op = {op: {"n": 0, **{ph: 0.0 for ph in PHASES}} for op in OPS}
    totals = {ph: 0.0 for ph in PHASES}
    span_lo: dict[tuple, float] = {}
    span_hi: dict[tuple, float] = {}
    busy = []
    for s in range(n_sms):
        t = marks[s, :len(lists[s])].to(torch.float64)
        if not len(lists[s]):
            continue
        busy.append((t[-1, 5] - t[0, 0]).item() / freq_ghz)
        for i, (op, layer, _a, _b) in enumerate(lists[s]):
            row = t[i]
            name = OPS[op]
            per_op[name]["n"] += 1
            if name == "ATT":  # no staged / weights / GEMM marks: inputs, then the whole body as "end"
                d = {"inputs": row[1] - row[0], "staged": 0.0, "weights": 0.0, "gemm": 0.0, "end": row[5] - row[1]}
            else:
                d = {ph: row[k + 1] - row[k] for k, ph in enumerate(PHASES)}
            for ph in PHASES:
                ns = float(d[ph]) / freq_ghz
                per_op[name][ph] += ns
                totals[ph] += ns
            g0 = float(row[6])
            g1 = g0 + float(row[5] - row[0]) / freq_ghz
            key = (layer, name)
            span_lo[key] = min(span_lo.get(key, g0), g0)
            span_hi[key] = max(span_hi.get(key, g1), g1)
    for op in per_op.values():
        for ph in PHASES:
            op[ph] = round(op[ph] / max(op["n"], 1), 1)
    all_ns = sum(totals.values())
    t0 = min(span_lo.values())
    stages = {f"{layer}:{name}": [round(span_lo[(layer, name)] - t0), round(span_hi[(layer, name)] - t0)]
              for (layer, name) in sorted(span_lo, key=lambda k: (k[0], OPS.index(k[1])))}
    layers = sorted({k[0] for k in span_lo if k[1] != "HEAD"})
    layer_ns = [max(span_hi[k] for k in span_hi if k[0] == lay) - min(span_lo[k] for k in span_lo if k[0] == lay)
                for lay in layers]
    return {"instructions_per_op": {k: v["n"] for k, v in per_op.items() if v["n"]},
            "mean_ns_per_instruction": {k: {ph: v[ph] for ph in PHASES} for k, v in per_op.items() if v["n"]},
            "share_of_program_time": {ph: round(100 * totals[ph] / all_ns, 1) for ph in PHASES},
            "program_busy_us_mean": round(sum(busy) / len(busy) / 1e3, 2),
            "stage_span_ns": stages, "layer_span_us_mean": round(sum(layer_ns) / len(layer_ns) / 1e3, 2)}


def clock_ghz(marks, lists) -> float:
    """The SM clock against %globaltimer over each program's whole run (µs-scale timer, ms-scale run)."""
    import torch
    rates = []
    for s, ins in enumerate(lists):
        if len(ins) > 1:
            t = marks[s, :len(ins)].to(torch.float64)
            dg, dc = (t[-1, 6] - t[0, 6]).item(), (t[-1, 0] - t[0, 0]).item()
            if dg > 0:
                rates.append(dc / dg)
    rates.sort()
    return rates[len(rates) // 2]


def plot(path: Path, layers: tuple[int, int] = (1, 3)) -> Path:
    """The programs' instructions of decoder layers layers[0]..layers[1] (the whole launch is too dense to read),
    each bar cut into its phases."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    rec = torch.load(path)
    lists, marks, ghz = rec["lists"], rec["marks"].to(torch.float64), rec["ghz"]
    colors = {"inputs": "#d62728", "staged": "#ff7f0e", "weights": "#1f77b4", "gemm": "#2ca02c", "end": "#9467bd"}
    t0 = min(marks[s, 0, 6].item() for s in range(len(lists)) if lists[s])
    fig, ax = plt.subplots(figsize=(14, 7))
    for s, ins in enumerate(lists):
        t = marks[s, :len(ins)].clone()
        att = torch.tensor([op == 1 for op, *_ in ins], dtype=torch.bool)  # ATT: no staged / weights / GEMM marks
        t[att, 2:5] = t[att, 1:2]
        g0 = (t[:, 6] - t0) / 1e3
        for k, ph in enumerate(PHASES):  # one collection a program and phase (tens of thousands of bars)
            a, b = (t[:, k] - t[:, 0]) / ghz / 1e3, (t[:, k + 1] - t[:, 0]) / ghz / 1e3
            bars = [(float(g0[i] + a[i]), float(b[i] - a[i])) for i in range(len(ins))
                    if b[i] > a[i] and layers[0] <= ins[i][1] <= layers[1]]
            ax.broken_barh(bars, (s - 0.45, 0.9), color=colors[ph], linewidth=0)
    ax.set_xlabel("µs since the first program started")
    ax.set_ylabel("program (one per SM)")
    ax.legend(handles=[matplotlib.patches.Patch(color=c, label=f"until {ph}") for ph, c in colors.items()],
              loc="upper right")
    ax.set_title(f"{rec['title']}\nlayers {layers[0]}-{layers[1]}: each instruction's phases (red: waiting for "
                 f"inputs)")
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    draft_arguments(p)
    p.add_argument("--plot", type=Path, help="draw the PNG of a saved record (.pt) and exit")
    p.add_argument("--plot-layers", default="1-3", help="the decoder layers the PNG shows, first-last")
    a = p.parse_args()
    if a.plot:
        lo, hi = (int(x) for x in a.plot_layers.split("-"))
        print(plot(a.plot, (lo, hi)))
        return 0
    import torch

    from dustin.attention.backend import AttentionBackend
    from dustin.bench.e2e import _shape
    from dustin.cache.kv_cache import KVCache
    from dustin.kernels import draft_decoder as dd
    from dustin.models.loader import random_model

    dev = torch.device("cuda")
    args = _shape(a.draft)
    model = random_model(args, dev, backend=AttentionBackend.for_device(dev)).eval()  # fused projections
    B = a.batch
    cache = KVCache(args.n_layers, B, args.n_kv_heads, args.head_dim, a.context + 8, torch.bfloat16, dev)
    lengths = torch.full((B,), a.context, dtype=torch.int32, device=dev)
    kernel = dd.DraftDecoder(model, a.sinks, a.window, (B, 2 * B), args.vocab_size, timeline=True)
    title = (f"{a.draft} B={B} | {torch.cuda.get_device_name()} | {time.strftime('%Y-%m-%d')} | profiling build, "
             f"random weights")
    print(f"# {title}", flush=True)
    out = {"draft": a.draft, "batch": B, "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "rows": []}
    for T in (1, 2):
        positions = lengths.long()[:, None] + torch.arange(T, device=dev)
        x = torch.randn(B * T, args.dim, device=dev, dtype=torch.bfloat16)
        cos, sin = (t.reshape(B * T, -1).contiguous() for t in model.rotary(positions))
        pos = positions.reshape(-1).contiguous()
        with torch.inference_mode():
            for _ in range(5):
                kernel(x.clone(), pos, cos, sin, cache.k, cache.v, T)
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(20):
                kernel(x.clone(), pos, cos, sin, cache.k, cache.v, T)
            e1.record()
            torch.cuda.synchronize()
            kernel(x.clone(), pos, cos, sin, cache.k, cache.v, T)
            torch.cuda.synchronize()
        lists, marks = kernel.timeline_of(B * T)
        ghz = clock_ghz(marks, lists)
        row = {"T": T, "rows": B * T, "ms_per_launch_eager": round(e0.elapsed_time(e1) / 20, 4),
               "sm_clock_ghz": round(ghz, 3), **summarize(lists, marks, ghz)}
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "stage_span_ns"}), flush=True)
        if os.environ.get("OUT"):
            torch.save({"lists": lists, "marks": marks, "ghz": ghz, "title": f"{title} | T={T}"},
                       Path(os.environ["OUT"], f"draft_timeline_{a.draft}_T{T}.pt"))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"draft_timeline_{a.draft}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
