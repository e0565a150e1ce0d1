"""Where the persistent draft kernel and the per-layer kernels part: each layer's residual stream, from four bf16
implementations of the same streaming draft forward, against an fp32 reference on the same weights and inputs.

    PYTHONPATH=. python3 scripts/gpu_draft_drift.py --draft qwen2.5-0.5b --layers 4,24 --batch 16

The implementations (random weights of the draft's shape, as tests/kernels/test_draft_decoder.py draws them):
- `kernel`: the persistent kernel (dustin/kernels/csrc/draft_decoder.cu), on the first l layers for each l;
- `emulated`: `reference_plan` in bf16, the kernel's arithmetic tile by tile in PyTorch;
- `per_layer`: the per-layer Triton kernels (`DecoderLayer.decode_forward`), what the engine runs without it;
- `torch`: the plain PyTorch ops (`DecoderLayer.forward` with fused ops off; Hugging Face's rounding order);
- `fp32`: `reference_plan` on an fp32 copy of the model, caches and inputs (no rounding but fp32's);
- `nudged`: `torch` from embeddings moved one bf16 step each (`nudged~torch`: how far one rounding step at the
  input carries through the stack, the scale any two bf16 forwards drift apart on).

Per layer it prints max|a - b| / max|b| (the self-check's measure) of each against fp32 and of the kernel against the
others. If the kernel is no farther from fp32 than the others are, the difference between it and the per-layer
kernels is two roundings' drift, and a tolerance follows from it; if it is farther, or jumps at one layer, a stage
reads something before it is final. On a CPU (no kernel): the PyTorch rows, and with TRITON_INTERPRET=1 the
per-layer kernels on Triton's interpreter (slow: a few layers and rows). Writes $OUT/draft_drift.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main() -> int:
    import torch
    from torch import nn

    from dustin.attention.backend import AttentionBackend
    from dustin.attention.context import ForwardContext
    from dustin.bench.e2e import _shape
    from dustin.cache.kv_cache import KVCache
    from dustin.kernels import draft_decoder as dd
    from dustin.kernels.dispatch import interpreting
    from dustin.models.transformer import Transformer

    p = argparse.ArgumentParser()
    p.add_argument("--draft", default="qwen2.5-0.5b")
    p.add_argument("--layers", default="4,24")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", default="1,2", help="tokens a row (T), comma-separated")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = dev.type == "cuda"
    sinks, window, S, B = 4, 508, 2048, a.batch
    results = []
    for L in (int(x) for x in a.layers.split(",")):
        for T in (int(x) for x in a.tokens.split(",")):
            torch.manual_seed(a.seed)
            args = replace(_shape(a.draft), n_layers=L)
            backend = AttentionBackend("triton") if interpreting() else AttentionBackend.for_device(dev)
            model = Transformer(args, backend).to(dev, torch.bfloat16)
            with torch.no_grad():
                for name, w in model.named_parameters():
                    w.uniform_(0.8, 1.2) if "norm" in name else w.normal_(0, 0.02)
            model.fuse_projections().eval()
            M = B * T
            k0 = torch.randn(L, B, args.n_kv_heads, S, args.head_dim, device=dev).to(torch.bfloat16)
            v0 = torch.randn_like(k0, dtype=torch.float32).to(torch.bfloat16)
            lengths = torch.randint(520, S - 4, (B,), dtype=torch.int32)
            lengths[:3] = torch.tensor([0, 3, 130], dtype=torch.int32)[:B]  # empty, short and sub-window rows
            lengths = lengths.to(dev)
            tokens = torch.randint(0, args.vocab_size, (B, T), device=dev)
            positions = lengths.long()[:, None] + torch.arange(T, device=dev)
            hs: dict[str, list] = {}
            with torch.inference_mode():
                x = model.embed_tokens(tokens).reshape(M, -1)
                cos, sin = (t.reshape(M, -1).float().contiguous() for t in model.rotary(positions))
                tiles = dd.tiling(dd.Shape.of(args), max(32, M))
                # fp32: the same tiles in fp32 (reference_plan rounds to h's dtype: none)
                m32 = copy.deepcopy(model).float()
                tr: dict = {}
                dd.reference_plan(m32, x.float(), positions, cos, sin, k0.float(), v0.float(), T=T, sinks=sinks,
                                  window=window, tiles=tiles, trace=tr)
                hs["fp32"] = tr["h"]
                del m32
                tr = {}
                dd.reference_plan(model, x, positions, cos, sin, k0.clone(), v0.clone(), T=T, sinks=sinks,
                                  window=window, tiles=tiles, trace=tr)
                hs["emulated"] = tr["h"]

                def ctx_of(k, v, positions=positions, lengths=lengths, T=T):
                    cache = KVCache(k.shape[0], B, k.shape[2], k.shape[4], S, torch.bfloat16, dev)
                    cache.k.copy_(k)
                    cache.v.copy_(v)
                    return ForwardContext(cache, positions, lengths, int(lengths.max()) + T, sinks=sinks,
                                          window=window)

                # torch: DecoderLayer.forward with the plain ops; the residual stream after layer l is residual + h.
                # nudged: the same from embeddings each moved one bf16 step up or down (a random sign each): how far
                # one rounding step at the input carries through the stack (the scale of rounding drift)
                model.set_fused_ops(False)
                cos3, sin3 = model.rotary(positions)
                step = torch.randint(0, 2, x.shape, device=dev, dtype=torch.int16) * 2 - 1
                for name, x0 in (("torch", x), ("nudged", (x.view(torch.int16) + step).view(torch.bfloat16))):
                    ctx = ctx_of(k0, v0)
                    h, residual, out = x0.view(B, T, -1), None, []
                    for layer in model.layers:
                        h, residual = layer(h, residual, cos3, sin3, ctx, model.backend)
                        out.append((residual + h).reshape(M, -1))
                    hs[name] = out
                model.set_fused_ops(True)
                if gpu or interpreting():  # the per-layer Triton kernels (on a CPU: TRITON_INTERPRET=1, slow)
                    from dustin.kernels.decode_linear import row_norm
                    ctx = ctx_of(k0, v0)
                    ln = model.layers[0].input_layernorm
                    h, normed, out = x.view(B, T, -1), None, []
                    normed = row_norm(h, ln.weight, ln.eps)
                    nexts = [layer.input_layernorm for layer in model.layers[1:]] + [None]
                    for layer, nxt in zip(model.layers, nexts, strict=True):
                        h, normed = layer.decode_forward(h, normed, cos3, sin3, ctx, model.backend, nxt)
                        out.append(h.reshape(M, -1).clone())
                    hs["per_layer"] = out
                if gpu:
                    out = []
                    for n in range(1, L + 1):  # the kernel on the first n layers (a launch runs them all)
                        part = copy.copy(model)
                        part._modules = dict(model._modules)
                        part.layers = nn.ModuleList(list(model.layers)[:n])
                        part.args = replace(args, n_layers=n)
                        kern = dd.DraftDecoder(part, sinks, window, rows=(M,))
                        hk = x.clone()
                        kern(hk, positions.reshape(-1).contiguous(), cos, sin, k0.clone()[:n].contiguous(),
                             v0.clone()[:n].contiguous(), T)
                        torch.cuda.synchronize()
                        out.append(hk)
                    hs["kernel"] = out
                logits = {name: model.lm_head(model.norm(v[-1])).float() for name, v in hs.items() if name != "fp32"}
                ref_logits = dd._norm(hs["fp32"][-1], _Norm32(model.norm)) @ model.lm_head.weight.float().T
            names = [n for n in ("kernel", "per_layer", "torch", "emulated") if n in hs]
            nudged = hs.pop("nudged")
            nudged_logits = logits.pop("nudged")
            rows = []
            for layer in range(L):
                row = {"layer": layer}
                for n in names:
                    row[f"{n}~fp32"] = rel(hs[n][layer], hs["fp32"][layer])
                for n in names[1:]:
                    if "kernel" in hs:
                        row[f"kernel~{n}"] = rel(hs["kernel"][layer], hs[n][layer])
                if "per_layer" in hs:  # two trusted bf16 implementations apart: the scale of rounding drift
                    row["per_layer~torch"] = rel(hs["per_layer"][layer], hs["torch"][layer])
                row["nudged~torch"] = rel(nudged[layer], hs["torch"][layer])
                rows.append(row)
            final = {f"{n}~fp32": rel(logits[n], ref_logits) for n in names}
            if "kernel" in logits:
                final.update({f"kernel~{n}": rel(logits["kernel"], logits[n]) for n in names[1:]})
            if "per_layer" in logits:
                final["per_layer~torch"] = rel(logits["per_layer"], logits["torch"])
            final["nudged~torch"] = rel(nudged_logits, logits["torch"])
            results.append({"draft": a.draft, "layers": L, "B": B, "T": T, "per_layer": rows, "logits": final,
                            "device": torch.cuda.get_device_name() if gpu else "cpu"})
            print(f"\n== {a.draft}, {L} layers, {B} x {T} rows: max|a - b| / max|b| of each layer's residual stream")
            cols = list(rows[0])[1:]
            print("layer  " + "  ".join(f"{c:>18}" for c in cols))
            for r in rows:
                print(f"{r['layer']:>5}  " + "  ".join(f"{r[c]:>18.4g}" for c in cols))
            print("logits " + "  ".join(f"{c}={v:.4g}" for c, v in final.items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "draft_drift.json").write_text(json.dumps(results, indent=1))
    return 0


class _Norm32:
    """An RMSNorm's weight and eps in fp32 (dd._norm's argument), for the fp32 reference's logits."""

    def __init__(self, norm):
        self.weight, self.eps = norm.weight.float(), norm.eps


if __name__ == "__main__":
    sys.exit(main())
