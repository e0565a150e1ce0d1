"""GPU kernels per decoder layer of one decode forward, before and after fusing the projections and the SwiGLU
epilogue (`Transformer.fuse_projections`, `fused_ops.silu_mul`). Random weights of named shapes, eager (no CUDA
graph), the default attention backend; batch 16, 1 and 5 new tokens over a KV cache of --context positions.

    python3 scripts/gpu_kernels_per_layer.py --models qwen2.5-1.5b,qwen2.5-0.5b
    python3 scripts/gpu_kernels_per_layer.py --device cpu --layers 3 --vocab 512 --context 256   # smoke test

Variants, all of one model build (same weights): "before" = separate q/k/v and gate/up GEMMs, SiLU and the multiply
as two ops (the forward before the fusion); "epilogue" = the same GEMMs with the one-launch silu_mul; "fused" =
after fuse_projections(), as load_model / random_model now return models. Per layer = (count of the whole forward -
count with layer 0 alone) / (n_layers - 1): exactly what layers 1.. launch, nothing of the embedding / final norm
/ LM head. On --device cpu there are no kernels: the counts are the model's top-level aten ops (CPU profiler),
which only shows the script runs (the CPU path has no silu_mul, so "epilogue" equals "before" there).

Prints a table per model and token count (with the per-layer kernel names of "before" and "fused"); writes
$OUT/kernels_per_layer.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

VARIANTS = ("before", "epilogue", "fused")


def _set_variant(model, variant: str) -> None:
    """The model (unfused when built) in `variant`; variants are taken in VARIANTS order (fusing is one-way)."""
    for layer in model.layers:
        layer.mlp.fused_ops = variant != "before"
    if variant == "fused":
        model.fuse_projections()


def _launches(model, tokens, ctx, device: torch.device) -> Counter:
    """Names of the GPU kernels (CPU: top-level aten ops) one forward launches, with their counts."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with torch.no_grad():
        model(tokens, ctx)  # warm: Triton compiles, cuBLAS heuristics
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            model(tokens, ctx)
            if cuda:
                torch.cuda.synchronize()
    if cuda:
        return Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def count(model, batch: int, tokens_per_seq: int, context: int, device: torch.device, dtype) -> dict:
    """Kernels of one decode forward of `tokens_per_seq` new tokens per sequence: whole, per layer (by name too)."""
    from dustin.attention.context import ForwardContext
    from dustin.cache.kv_cache import KVCache

    a, T = model.args, tokens_per_seq
    cache = KVCache(a.n_layers, batch, a.n_kv_heads, a.head_dim, context + T, dtype, device)
    cache.lengths.fill_(context)  # zeros as cached keys/values: the kernels launched do not depend on them
    positions = context + torch.arange(T, device=device)[None].expand(batch, T)
    ctx = ForwardContext(cache, positions, cache.lengths.clone(), context + T)
    tokens = torch.randint(0, a.vocab_size, (batch, T), device=device)
    layers = model.layers
    whole = _launches(model, tokens, ctx, device)
    try:
        model.layers = layers[:1]
        first = _launches(model, tokens, ctx, device)
    finally:
        model.layers = layers
    n = len(layers) - 1
    by_name = {k: round((whole[k] - first[k]) / n, 2) for k in whole if whole[k] != first[k]}
    return {"forward": sum(whole.values()), "per_layer": round(sum(by_name.values()), 2),
            "per_layer_by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]))}


def main(argv=None) -> int:
    from dataclasses import replace

    from dustin.attention.backend import AttentionBackend
    from dustin.models.args import named_config
    from dustin.models.loader import random_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-0.5b", help="named configs, comma separated")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", default="1,5", help="new tokens per sequence (decode, verify of Γ=4)")
    p.add_argument("--context", type=int, default=4096, help="cached positions per sequence")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention", default="auto", help="attention backend (auto: triton on CUDA)")
    p.add_argument("--layers", type=int, default=None, help="override n_layers (>= 2; CPU smoke tests)")
    p.add_argument("--vocab", type=int, default=None, help="override vocab_size (CPU smoke tests)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = AttentionBackend.for_device(device, a.attention)
    overrides = {k: v for k, v in (("n_layers", a.layers), ("vocab_size", a.vocab)) if v is not None}
    what = "GPU kernels" if device.type == "cuda" else "top-level aten ops (CPU profiler, not kernels)"
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {what} of one eager decode forward, batch {a.batch}, context {a.context}, {backend.name} attention, "
          f"{label}, random weights", flush=True)
    results = []
    for name in a.models.split(","):
        args = named_config(name, **overrides)
        args = replace(args, max_position_embeddings=max(args.max_position_embeddings, a.context + 64))
        if args.n_layers < 2:
            raise SystemExit("--layers must be at least 2 (per layer = whole - layer 0 alone)")
        model = random_model(args, device, dtype, backend=backend, fuse=False)
        rows = {int(t): {} for t in a.tokens.split(",")}
        for variant in VARIANTS:
            _set_variant(model, variant)
            for T, row in rows.items():
                row[variant] = count(model, a.batch, T, a.context, device, dtype)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for T, r in rows.items():
            before, fused = r["before"]["per_layer"], r["fused"]["per_layer"]
            print(f"\n## {name} ({args.n_layers} layers), {T} token(s)/seq: per layer "
                  f"{before:g} before -> {r['epilogue']['per_layer']:g} with silu_mul -> {fused:g} fused "
                  f"({fused - before:+g}); whole forward "
                  f"{r['before']['forward']} -> {r['fused']['forward']}")
            for variant in ("before", "fused"):
                print(f"   {variant}:")
                for k, c in r[variant]["per_layer_by_name"].items():
                    print(f"     {c:5g}  {k[:110]}")
            results.append({"model": name, "n_layers": args.n_layers, "tokens": T, **r})
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"], "kernels_per_layer.json")
        out.write_text(json.dumps({"device": label, "what": what, "batch": a.batch, "context": a.context,
                                   "attention": backend.name, "results": results}, indent=1))
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
