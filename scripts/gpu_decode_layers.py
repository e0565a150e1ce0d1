"""The fused decode-layer kernels (dustin/kernels/decode_linear.py) on a GPU: exactness, speed, tiles.

1. check: each kernel against the PyTorch ops it replaces at the default pair's shapes (fp32: max abs error;
   bf16: error against the fp32 truth next to the bf16 PyTorch ops' own), and whole random-weight models in fp32:
   `decode_logits` against `forward` with the decode kernels off (max logit difference, argmax agreement).
2. forward: one decode forward of the 0.5B draft / 1.5B target shapes (rows 16, 32, 80), replayed as a CUDA graph,
   with the decode kernels on and off: us per forward, kernels per forward, and the weights' bytes / the copy
   bandwidth (the forward's weight roofline; its attention over a short cache is a few us).
3. sweep (--sweep): each projection's tiles (BN, split, BK/stages) over 24 rotating weight copies (the L2 cannot
   hold them, as in a real forward): us per launch, best against the heuristic `linear_tiles`.

    python3 scripts/gpu_decode_layers.py [--sweep] [--out DIR]
Random weights (timing does not depend on values). Prints JSON lines; writes DIR/decode_layers.json.

Programmatic Dependent Launch (dustin/kernels/launch.py) is opt-in on sm_90+; its A/B is this script run twice,
once with `DUSTIN_PDL=1` in the environment (and another --out DIR); the "env" row's "pdl" says which.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"qwen2.5-0.5b": (16, 32), "qwen2.5-1.5b": (16, 32)}  # rows: decode passes of batch 16 (1, 2 tokens)


def emit(rows: list, row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def graph_us(fn, *args, iters: int = 50) -> float:
    """Replay `fn(*args)` (captured once in a CUDA graph) `iters` times; us per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / iters


def check_kernels(rows: list) -> None:
    from dustin.kernels.decode_linear import decode_linear, gate_up_silu, qkv_rope, row_norm
    from dustin.models.args import named_config
    from dustin.models.rope import RotaryEmbedding, apply_rope
    from dustin.models.transformer import rms_norm

    for name, ms in SHAPES.items():
        a = named_config(name)
        D, hq, hkv = a.head_dim, a.n_heads, a.n_kv_heads
        for m in ms:
            B, T = 16, m // 16
            for dt in (torch.float32, torch.bfloat16):
                g = torch.Generator(device="cuda").manual_seed(m)
                rnd = partial(_rnd, g, dt)
                x, nw = rnd(B, T, a.dim, scale=2.0), 1 + rnd(a.dim, scale=0.1)
                wqkv, bqkv = rnd((hq + 2 * hkv) * D, a.dim, scale=a.dim ** -0.5), rnd((hq + 2 * hkv) * D, scale=0.3)
                wo, wgu = rnd(a.dim, hq * D, scale=(hq * D) ** -0.5), rnd(2 * a.intermediate_size, a.dim, scale=0.03)
                wd = rnd(a.dim, a.intermediate_size, scale=a.intermediate_size ** -0.5)
                pos = torch.randint(0, 900, (B, 1), device="cuda") + torch.arange(T, device="cuda")
                cos, sin = RotaryEmbedding(a).to("cuda")(pos)
                kc, vc = rnd(B, hkv, 1024, D), rnd(B, hkv, 1024, D)
                attn, res = rnd(B, hq, T, D), rnd(B, T, a.dim)
                inter = rnd(B, T, a.intermediate_size)

                def ref_qkv(x, nw, w, b, cos, sin, hq=hq, D=D):
                    q = F.linear(rms_norm(x, nw, 1e-6), w, b)[..., :hq * D]
                    return apply_rope(q.view(*x.shape[:2], hq, D).transpose(1, 2), cos, sin)

                def ref_o(at, w, r):
                    return r + F.linear(at.transpose(1, 2).reshape(*r.shape[:2], -1), w)

                def ref_gu(x, nw, w):
                    gg, uu = F.linear(rms_norm(x, nw, 1e-6), w).chunk(2, dim=-1)
                    return F.silu(gg) * uu

                def ref_down(x, w, r):
                    return r + F.linear(x, w)

                norm = row_norm(x, nw, 1e-6)
                cases = {
                    "qkv_rope": (qkv_rope(norm, wqkv, bqkv, cos, sin, pos, kc, vc, n_heads=hq, n_kv_heads=hkv),
                                 ref_qkv, (x, nw, wqkv, bqkv, cos, sin)),
                    "o_proj": (decode_linear(attn, wo, residual=res, heads=hq), ref_o, (attn, wo, res)),
                    "gate_up": (gate_up_silu(norm, wgu), ref_gu, (x, nw, wgu)),
                    "down": (decode_linear(inter, wd, residual=res), ref_down, (inter, wd, res)),
                }
                for kname, (out, ref, args) in cases.items():
                    truth = ref(*(t.float() for t in args))
                    emit(rows, {"part": "check", "model": name, "rows": m, "dtype": str(dt)[6:], "kernel": kname,
                                "max_err": float((out.float() - truth).abs().max()),
                                "torch_err": float((ref(*args).float() - truth).abs().max()),
                                "scale": float(truth.abs().max())})


def _rnd(g, dt, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dt)


def _forward(model, toks, ctx_args, at):
    from dustin.attention.context import ForwardContext
    with torch.no_grad():
        model(toks, ForwardContext(*ctx_args), logits_at=at)


def _each(run, ws, t):
    for w in ws:
        run(w, t)


def _each_linear(x, ws):
    for w in ws:
        F.linear(x, w)


def check_models(rows: list) -> None:
    """fp32 random models: decode_logits vs forward (decode kernels off), decode and verify forwards."""
    from dustin.attention.backend import AttentionBackend
    from dustin.attention.context import ForwardContext
    from dustin.cache.kv_cache import KVCache
    from dustin.models.args import named_config
    from dustin.models.loader import random_model

    for name, ms in SHAPES.items():
        a = replace(named_config(name), n_layers=6)
        model = random_model(a, "cuda", torch.float32, seed=3, backend=AttentionBackend.for_device("cuda"))
        B, P = 16, 700
        for T in (1, *(m // 16 for m in ms[1:])):  # decode passes of 1 and 2 tokens per row (and more: experiments)
            cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, 1024, torch.float32, "cuda")
            g = torch.Generator(device="cuda").manual_seed(T)
            with torch.no_grad():
                toks = torch.randint(0, a.vocab_size, (B, P), device="cuda", generator=g)
                model(toks, ForwardContext(cache, torch.arange(P, device="cuda")[None].expand(B, P),
                                           cache.lengths.clone(), P, fresh=True))
                lengths = torch.randint(P - 300, P, (B,), device="cuda", generator=g).int()
                cache.lengths.copy_(lengths)
                pos = lengths[:, None].long() + torch.arange(T, device="cuda")
                new = torch.randint(0, a.vocab_size, (B, T), device="cuda", generator=g)
                model.decode_kernels = False
                want = model(new, ForwardContext(cache, pos, lengths.clone(), P + T))
                model.decode_kernels = True
                ctx = ForwardContext(cache, pos, lengths.clone(), P + T)
                assert model._takes_decode_kernels(model.embed_tokens(new), ctx)
                got = model(new, ctx)
            emit(rows, {"part": "model_fp32", "model": name, "layers": a.n_layers, "rows": B * T,
                        "max_logit_diff": float((got - want).abs().max()),
                        "argmax_equal": float((got.argmax(-1) == want.argmax(-1)).float().mean())})
        del model
        torch.cuda.empty_cache()


def check_bf16_accuracy(rows: list) -> None:
    """bf16 random models (6 layers of each shape), decode forwards of 16 rows: the logits' error against the
    same weights in fp32, with the decode kernels and with the plain path (is either path less accurate?)."""
    import copy

    from dustin.attention.backend import AttentionBackend
    from dustin.attention.context import ForwardContext
    from dustin.cache.kv_cache import KVCache
    from dustin.models.args import named_config
    from dustin.models.loader import random_model

    for name in SHAPES:
        a = replace(named_config(name), n_layers=6)
        m32 = random_model(a, "cuda", torch.float32, seed=5, backend=AttentionBackend.for_device("cuda"))
        m16 = copy.deepcopy(m32).to(torch.bfloat16)
        B, P = 16, 700
        g = torch.Generator(device="cuda").manual_seed(1)
        toks = torch.randint(0, a.vocab_size, (B, P + 1), device="cuda", generator=g)
        out = {}
        for tag, model, dt, on in (("fp32", m32, torch.float32, False), ("bf16_plain", m16, torch.bfloat16, False),
                                   ("bf16_decode_kernels", m16, torch.bfloat16, True)):
            cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, 1024, dt, "cuda")
            with torch.no_grad():
                model.decode_kernels = False
                model(toks[:, :P], ForwardContext(cache, torch.arange(P, device="cuda")[None].expand(B, P),
                                                  cache.lengths.clone(), P, fresh=True))
                cache.lengths.fill_(P)
                model.decode_kernels = on
                pos = torch.full((B, 1), P, device="cuda")
                out[tag] = model(toks[:, P:], ForwardContext(cache, pos, cache.lengths.clone(), P + 1)).float()
        for tag in ("bf16_plain", "bf16_decode_kernels"):
            err = (out[tag] - out["fp32"]).abs()
            emit(rows, {"part": "bf16_vs_fp32", "model": name, "path": tag, "max_abs_err": float(err.max()),
                        "mean_abs_err": float(err.mean()), "logit_scale": float(out["fp32"].abs().max()),
                        "argmax_equal_fp32": float((out[tag].argmax(-1) == out["fp32"].argmax(-1)).float().mean())})
        del m32, m16
        torch.cuda.empty_cache()


def time_forwards(rows: list, bw: float) -> None:
    from torch.profiler import ProfilerActivity, profile

    from dustin.attention.backend import AttentionBackend
    from dustin.cache.kv_cache import KVCache
    from dustin.models.args import named_config
    from dustin.models.loader import random_model

    for name, ms in SHAPES.items():
        a = named_config(name)
        model = random_model(a, "cuda", torch.bfloat16, seed=0, backend=AttentionBackend.for_device("cuda"))
        wbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed" not in n)
        for m in ms:
            B, T = 16, m // 16
            cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, 2048, torch.bfloat16, "cuda")
            cache.lengths.fill_(1000)
            toks = torch.zeros(B, T, dtype=torch.long, device="cuda")
            pos = 1000 + torch.arange(T, device="cuda")[None].expand(B, T)
            at = torch.full((B,), T - 1, device="cuda")
            for on in (False, True):
                model.decode_kernels = on
                ctx_args = (cache, pos, cache.lengths, 1000 + T)
                us = graph_us(_forward, model, toks, ctx_args, at)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    _forward(model, toks, ctx_args, at)
                    torch.cuda.synchronize()
                kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
                per: dict[str, list[float]] = {}
                for e in kern:
                    per.setdefault(e.name[:60], []).append(e.time_range.end - e.time_range.start)
                top = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:8]
                emit(rows, {"part": "forward", "model": name, "rows": m, "decode_kernels": on,
                            "top_kernels_us": {k: [len(v), round(sum(v) / len(v), 2)] for k, v in top},
                            "us_per_forward": round(us, 1), "kernels": len(kern),
                            "weight_roofline_us": round(1e6 * wbytes / bw, 1),
                            "pct_of_weight_roofline": round(100 * wbytes / bw / (us * 1e-6), 1)})
        del model
        torch.cuda.empty_cache()


def _pipeline_tiles(bns, splits=(1,)):
    """Tiles that vary the load pipeline: BK x stages x warps for each BN (and split)."""
    from dustin.kernels.decode_linear import Tiles
    return [Tiles(bn, bk, sp, w, st) for bn in bns for sp in splits
            for bk, st in ((64, 6), (64, 8), (128, 4), (128, 3)) for w in (4, 8)]


def sweep(rows: list, bw: float, pipeline: bool = False) -> None:
    from dustin.kernels.decode_linear import RowNorm, _fit, linear_tiles
    from dustin.models.args import named_config

    bf, copies = torch.bfloat16, 24
    for name, ms in SHAPES.items():
        a = named_config(name)
        D, hq, hkv, dim, inter = a.head_dim, a.n_heads, a.n_kv_heads, a.dim, a.intermediate_size
        for m in ms[:1] if pipeline else ms:
            B, T = 16, m // 16
            x = torch.randn(B, T, dim, device="cuda", dtype=bf)
            attn = torch.randn(B, hq, T, D, device="cuda", dtype=bf)
            xi = torch.randn(B, T, inter, device="cuda", dtype=bf)
            pos = 1000 + torch.arange(T, device="cuda")[None].expand(B, T)
            cos = torch.randn(B, T, D, device="cuda")
            kc = torch.zeros(B, hkv, 2048, D, device="cuda", dtype=bf)
            norm = RowNorm(x, torch.ones(dim // 64, m, device="cuda"), 1e-6)
            projs = {  # name: (N, K, run(w, tiles), candidate tiles (None: the BN x split grid), GEMM input)
                "qkv_rope": ((hq + 2 * hkv) * D, dim, partial(_qkv, x, cos, pos, kc, hq, hkv, norm),
                             [None] + [_fit(2 * bn, m, dim, bf, bn) for bn in (16, 32)], x),
                "o_proj": (dim, hq * D, partial(_o, attn, x, hq), None, attn.transpose(1, 2).reshape(B, T, -1)),
                "gate_up": (2 * inter, dim, partial(_gu, x, norm),
                            [None] + [_fit(2 * bn, m, dim, bf, bn) for bn in (32, 64, 128)], x),
                "down": (dim, inter, partial(_down, xi, x), None, xi),
            }
            if pipeline:  # the load pipeline of each kernel; gate_up also without its norm prologue
                projs = {
                    "qkv_rope": projs["qkv_rope"][:3] + (_pipeline_tiles((16, 32)), x),
                    "gate_up": projs["gate_up"][:3] + (_pipeline_tiles((32, 64)), x),
                    "gate_up_no_norm": (2 * inter, dim, partial(_gu, x, None), _pipeline_tiles((32, 64)), x),
                    "down": projs["down"][:3] + (_pipeline_tiles((64,), (4,)), xi),
                }
            for pname, (n, k, run, cands, gemm_in) in projs.items():
                ws = [torch.randn(n, k, device="cuda", dtype=bf) * 0.02 for _ in range(copies)]
                if cands is None:
                    cands = [None] + [_fit(bn, m, k, bf, bn, split) for bn in (32, 64, 128) for split in (1, 2, 4, 8)
                                      if k // split >= 256]
                gu = pname.startswith("gate_up")
                heur = linear_tiles(m, inter if gu else n, k, bf, splittable=pname in ("o_proj", "down"),
                                    halves=2 if gu else 1)
                for t in cands:
                    try:
                        us = graph_us(_each, run, ws, t, iters=20) / copies
                    except Exception as e:  # a tile that does not compile or fit: report and go on
                        emit(rows, {"part": "sweep", "model": name, "rows": m, "proj": pname, "tiles": str(t),
                                    "error": str(e)[:200]})
                        continue
                    emit(rows, {"part": "sweep", "model": name, "rows": m, "proj": pname,
                                "tiles": "default" if t is None else [t.bn, t.bk, t.split, t.warps, t.stages],
                                "heuristic": [heur.bn, heur.bk, heur.split, heur.warps, heur.stages],
                                "us": round(us, 2), "weight_MB": round(n * k * 2 / 1e6, 2),
                                "pct_of_bw": round(100 * n * k * 2 / bw / (us * 1e-6), 1)})
                # the ops these kernels replace, for reference: cuBLAS GEMM alone
                us = graph_us(_each_linear, gemm_in, ws, iters=20) / copies
                emit(rows, {"part": "sweep", "model": name, "rows": m, "proj": pname, "tiles": "cublas_gemm_only",
                            "us": round(us, 2), "pct_of_bw": round(100 * n * k * 2 / bw / (us * 1e-6), 1)})
                del ws


def _qkv(x, cos, pos, kc, hq, hkv, norm, w, t):
    from dustin.kernels.decode_linear import qkv_rope
    qkv_rope(norm, w, None, cos, cos, pos, kc, kc, n_heads=hq, n_kv_heads=hkv, tiles=t)


def _o(attn, x, hq, w, t):
    from dustin.kernels.decode_linear import decode_linear
    decode_linear(attn, w, residual=x, heads=hq, tiles=t)


def _gu(x, norm, w, t):
    from dustin.kernels.decode_linear import gate_up_silu
    gate_up_silu(norm if norm is not None else x, w, tiles=t)


def _down(xi, x, w, t):
    from dustin.kernels.decode_linear import decode_linear
    decode_linear(xi, w, residual=x, tiles=t)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip part 1")
    p.add_argument("--no-forward", action="store_true", help="skip part 2")
    p.add_argument("--bf16-only", action="store_true", help="only the bf16-vs-fp32 accuracy check")
    p.add_argument("--pipeline", action="store_true", help="sweep BK x stages x warps instead (16 rows)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from dustin.bench.decode import copy_bandwidth
    from dustin.kernels.launch import use_pdl

    rows: list = []
    bw = copy_bandwidth()
    emit(rows, {"part": "env", "device": torch.cuda.get_device_name(), "copy_bw_TBps": round(bw / 1e12, 3),
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "pdl": use_pdl(torch.device("cuda", torch.cuda.current_device()))})
    checks = (check_kernels, check_models, check_bf16_accuracy)
    for part in (check_bf16_accuracy,) if a.bf16_only else () if a.no_check else checks:
        try:
            part(rows)
        except Exception as e:  # report and go on to the timing parts
            emit(rows, {"part": part.__name__, "error": repr(e)[:500]})
    if not (a.no_forward or a.bf16_only):
        time_forwards(rows, bw)
    if a.sweep or a.pipeline:
        sweep(rows, bw, a.pipeline)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "decode_layers.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
