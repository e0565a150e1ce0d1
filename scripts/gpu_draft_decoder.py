"""Time one draft forward with the persistent decoder-layer kernel (dustin/kernels/draft_decoder.py) against the
per-layer kernels, both as CUDA graphs, random weights of a draft's shapes, also as greedy forwards (the LM head
and argmax in the launch); and the layer stack alone against its weights' bytes at the read-only bandwidth. Its
exactness is tests/kernels/test_draft_decoder.py (run it first).

    PYTHONPATH=. python3 scripts/gpu_draft_decoder.py --draft qwen2.5-0.5b --batch 16

Prints one JSON row per T (tokens a row: 1, and 2 as a step's first draft forward); writes
$OUT/draft_decoder_<draft>.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def draft_arguments(p: argparse.ArgumentParser) -> None:
    """The draft's shape and the rows it runs, shared by the draft-kernel scripts."""
    p.add_argument("--draft", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=508)


def graph_ms(fn, reps: int = 200) -> float:
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> int:
    import torch

    from dustin.attention.backend import AttentionBackend
    from dustin.attention.context import ForwardContext
    from dustin.bench.decode import read_bandwidth
    from dustin.bench.e2e import _shape
    from dustin.cache.kv_cache import KVCache
    from dustin.kernels import draft_decoder as dd
    from dustin.models import draft_kernel
    from dustin.models.transformer import Transformer

    p = argparse.ArgumentParser()
    draft_arguments(p)
    p.add_argument("--unchecked", action="store_true",
                   help="time (or profile) the kernel without its self-check at attach: for timing a build whose "
                        "numbers are still being worked on, never for figures of a checked build")
    p.add_argument("--only", choices=["all", "stack"], default="all",
                   help="stack: only the layer stack's graph replays (a short run to profile with ncu)")
    a = p.parse_args()
    dev = torch.device("cuda")
    args = _shape(a.draft)
    model = Transformer(args, AttentionBackend.for_device(dev)).to(dev, torch.bfloat16)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.uniform_(0.8, 1.2) if "norm" in name else prm.normal_(0, 0.02)
    model.fuse_projections().eval()
    B = a.batch
    cache = KVCache(args.n_layers, B, args.n_kv_heads, args.head_dim, a.context + 8, torch.bfloat16, dev)
    lengths = torch.full((B,), a.context, dtype=torch.int32, device=dev)
    bw = read_bandwidth()
    if a.unchecked:
        model.layer_kernel, reason = dd.DraftDecoder(model, a.sinks, a.window, (B, 2 * B), args.vocab_size), None
    else:
        reason = draft_kernel.attach(model, a.sinks, a.window, rows=(B, 2 * B), vocab=args.vocab_size)
    print(f"# {a.draft} B={B} ctx={a.context} | {torch.cuda.get_device_name()} | read {bw / 1e12:.2f} TB/s | "
          f"{time.strftime('%Y-%m-%d')} | random weights{' | UNCHECKED' if a.unchecked else ''}", flush=True)
    if reason:
        print(f"not attached: {reason}")
        return 1
    kernel = model.layer_kernel
    layer_bytes = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if "layers." in n)
    out = {"draft": a.draft, "batch": B, "context": a.context, "device": torch.cuda.get_device_name(), "read_bw": bw,
           "layer_bytes": layer_bytes, "date": time.strftime("%Y-%m-%d"), "unchecked": a.unchecked, "rows": []}
    for T in (1, 2):
        tokens = torch.randint(0, args.vocab_size, (B, T), device=dev)
        positions = lengths.long()[:, None] + torch.arange(T, device=dev)
        ctx = ForwardContext(cache, positions, lengths, a.context + T, sinks=a.sinks, window=a.window)

        def fwd(kern, tokens=tokens, ctx=ctx, **kw):  # greedy=V: the tokens (with the kernel: head in the launch)
            model.layer_kernel = kern
            return model(tokens, ctx, float_logits=False, **kw)

        with torch.inference_mode():
            if a.only == "stack":
                x = torch.randn(B * T, args.dim, device=dev, dtype=torch.bfloat16)
                cos, sin = (t.reshape(B * T, -1).contiguous() for t in model.rotary(positions))
                pos = positions.reshape(-1).contiguous()
                ms = graph_ms(lambda x=x, pos=pos, cos=cos, sin=sin, T=T:
                              kernel(x, pos, cos, sin, cache.k, cache.v, T), reps=20)
                print(json.dumps({"T": T, "rows": B * T, "ms_layer_stack_persistent": round(ms, 4)}), flush=True)
                continue
            ms_ref, ms_kernel = graph_ms(lambda: fwd(None)), graph_ms(lambda: fwd(kernel))
            greedy_ms = [graph_ms(lambda k=k: fwd(k, greedy=args.vocab_size)) for k in (None, kernel)]
            x = torch.randn(B * T, args.dim, device=dev, dtype=torch.bfloat16)
            cos, sin = (t.reshape(B * T, -1).contiguous() for t in model.rotary(positions))
            pos = positions.reshape(-1).contiguous()
            ms_stack = graph_ms(lambda x=x, pos=pos, cos=cos, sin=sin, T=T:
                                kernel(x, pos, cos, sin, cache.k, cache.v, T))
        row = {"T": T, "rows": B * T, "ms_forward_per_layer_kernels": round(ms_ref, 4),
               "ms_forward_persistent": round(ms_kernel, 4), "ms_layer_stack_persistent": round(ms_stack, 4),
               "ms_greedy_per_layer_kernels": round(greedy_ms[0], 4), "ms_greedy_persistent": round(greedy_ms[1], 4),
               "layer_bytes_ms": round(1e3 * layer_bytes / bw, 4)}
        row["layer_stack_pct_of_bytes"] = round(100 * row["layer_bytes_ms"] / ms_stack, 1)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if os.environ.get("OUT") and a.only == "all":  # (a profiling run leaves the timing run's file alone)
        Path(os.environ["OUT"], f"draft_decoder_{a.draft}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
