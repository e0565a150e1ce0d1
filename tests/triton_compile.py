"""Compile Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

The CPU interpreter (TRITON_INTERPRET=1) runs kernels as NumPy code and so misses errors of the real compiler
(loop-carried type changes, unsupported ops, shared-memory overflows). `compile_launches()` patches
`JITFunction.run`: every launch made inside the block is compiled ahead of time for `GPUTarget("cuda", 90, 32)`
and not run. The launch is specialized by the JIT's own binder, exactly as on the GPU: argument types, ints
equal to 1 made constant, and the 16-byte divisibility of pointers and ints. The divisibility hints matter:
without them the loads are not pipelined through shared memory, and 12 score heads compiled to 57344 B of
shared memory here while the H200 asked for 450560 B (and crashed). Each launch records the kernel's name,
its shared memory (`metadata.shared`, what the driver checks against the device's limit at launch) and
its constexprs. The wrappers around the kernels run unchanged on CPU tensors, so each kernel is compiled with
exactly the specialization the engine asks for. Used by tests/kernels/test_kernels_compile.py in a subprocess with
the interpreter off.

`compile_all_kernels` compiles with Programmatic Dependent Launch on, as an H100/H200 launches the step's kernels
(dustin/kernels/launch.py; `use_pdl` is False for the CPU tensors here, so it is forced on): each launch also
records the compiled kernel's `launch_pdl` and `pdl_order` of its PTX (griddepcontrol.wait before any memory
access, then griddepcontrol.launch_dependents).
"""
from __future__ import annotations

import contextlib
import re
from typing import NamedTuple
from unittest import mock

import torch


class Compiled(NamedTuple):
    name: str
    shared: int  # bytes of shared memory per program
    constexprs: str
    launch_pdl: bool  # the compiled kernel's launch option (metadata.launch_pdl)
    pdl_order: str  # pdl_order() of its PTX


# the first instruction of a PTX line (after an optional predicate), and the memory accesses among them: loads,
# stores, atomics and reductions, async copies (cp.async*), prefetches; ld.param reads the kernel's arguments
_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)")
_MEMORY = ("ld.", "ldu.", "st.", "atom.", "red.", "cp.", "prefetch.", "multimem.")


def pdl_order(ptx: str) -> str:
    """'wait first' when the PTX has griddepcontrol.wait before every memory access and
    griddepcontrol.launch_dependents after it; else what is wrong ('no wait', 'no launch_dependents', or the first
    instruction found before the wait)."""
    ops = [m.group(1) for m in (_INSTRUCTION.match(line.split("//")[0]) for line in ptx.splitlines()) if m]
    wait = next((i for i, op in enumerate(ops) if op.startswith("griddepcontrol.wait")), None)
    trigger = next((i for i, op in enumerate(ops) if op.startswith("griddepcontrol.launch_dependents")), None)
    if wait is None:
        return "no wait"
    if trigger is None:
        return "no launch_dependents"
    early = [op for op in ops[:wait] if op.startswith(_MEMORY) and not op.startswith("ld.param")]
    early += ["griddepcontrol.launch_dependents"] if trigger < wait else []
    return f"{early[0]} before griddepcontrol.wait" if early else "wait first"


@contextlib.contextmanager
def compile_launches(compiled: list[Compiled]):
    """Within the block, kernel launches compile for sm_90 instead of running; each is appended to `compiled`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)

    def run(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)  # what JITFunction.run does
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
        consts = " ".join(f"{p.name}={bound[p.name]}" for p in self.params
                          if p.is_constexpr and isinstance(bound[p.name], (bool, int)))
        compiled.append(Compiled(self.fn.__name__, kernel.metadata.shared, consts, bool(kernel.metadata.launch_pdl),
                                 pdl_order(kernel.asm["ptx"])))

    saved = JITFunction.run
    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = saved


def compile_decode_layers(decode_linear) -> None:
    """The fused decode-layer kernels at the default pair's shapes: the 0.5B draft (dim 896, 14/2 heads, D 64,
    SwiGLU 4864) and the 1.5B target (1536, 12/2, D 128, 8960), at 16 and 32 rows (decode passes of batch 16 and
    32, a draft pass of 2 tokens), with the tiles the engine picks."""
    bf = torch.bfloat16
    for dim, hq, hkv, d, inter in ((896, 14, 2, 64, 4864), (1536, 12, 2, 128, 8960)):
        for b, t in ((16, 1), (16, 2)):
            x = torch.zeros(b, t, dim, dtype=bf)
            norm = decode_linear.RowNorm(x, torch.zeros(dim // 64, b * t), 1e-6)
            cos = torch.zeros(b, t, d)
            cache = torch.zeros(2, b, hkv, 64, d, dtype=bf)
            decode_linear.qkv_rope(norm, torch.zeros((hq + 2 * hkv) * d, dim, dtype=bf),
                                   torch.zeros((hq + 2 * hkv) * d, dtype=bf), cos, cos,
                                   torch.zeros(b, t, dtype=torch.long), cache[0], cache[1], n_heads=hq,
                                   n_kv_heads=hkv)
            attn = torch.zeros(b, hq, t, d, dtype=bf)
            decode_linear.decode_linear(attn, torch.zeros(dim, hq * d, dtype=bf), residual=x, heads=hq,
                                        next_norm=(torch.ones(dim, dtype=bf), 1e-6))
            decode_linear.gate_up_silu(norm, torch.zeros(2 * inter, dim, dtype=bf))
            decode_linear.qkv_rope(norm, torch.zeros((hq + 2 * hkv) * d, dim, dtype=bf), None, cos, cos,
                                   torch.zeros(b, t, dtype=torch.long), cache[0], cache[1], n_heads=hq,
                                   n_kv_heads=hkv, tiles=decode_linear.Tiles(16, 64, 1, 4, 6))  # unsplit
            decode_linear.decode_linear(torch.zeros(b, t, inter, dtype=bf), torch.zeros(dim, inter, dtype=bf),
                                        residual=x, next_norm=(torch.ones(dim, dtype=bf), 1e-6))
            decode_linear.decode_linear(torch.zeros(b, t, inter, dtype=bf), torch.zeros(dim, inter, dtype=bf),
                                        residual=x)


def compile_all_kernels() -> list[Compiled]:
    """Launch every kernel of dustin/kernels through its Python wrapper, at the shapes and options the engine
    uses on the GPU (bf16 caches, Qwen2.5-32B / 1.5B / 0.5B head layouts, Γ = 4), compiling instead of
    running. Must run with TRITON_INTERPRET unset (the kernels must be JITFunctions)."""
    import os

    from dustin.kernels import (
        decode_linear,
        fused_ops,
        launch,
        prefill_attention,
        quest,
        score_estimation,
        selection,
        sparse_verify,
        verify_attention,
    )

    bf, i32 = torch.bfloat16, torch.int32
    compiled: list[Compiled] = []
    B, S = 2, 700
    L = torch.full((B,), 600, dtype=i32)
    with compile_launches(compiled), mock.patch.object(launch, "use_pdl", lambda device: True):  # as on an H200
        for hq, hkv, d, t in ((40, 8, 128, 5), (14, 2, 64, 1), (14, 2, 64, 2)):  # target verify, draft steps
            q, k = torch.zeros(B, hq, t, d, dtype=bf), torch.zeros(B, hkv, S, d, dtype=bf)
            verify_attention.verify_attention(q, k, k, L, max_len=S)
            verify_attention.verify_attention(q, k, k, L, sinks=4, window=508, max_len=S)  # streaming draft
            verify_attention.verify_attention(q, k, k, L, max_len=S, num_splits=4)  # merged in the launch
            if hkv == 8:  # more programs than SMs: launched without PDL (verify_attention.use_pdl_for)
                verify_attention.verify_attention(q, k, k, L, max_len=S, num_splits=11)
            verify_attention.verify_attention(q, k, k, L, max_len=S, num_splits=4, merge=False)  # combine launch
        q, k = torch.zeros(B, 40, 5, 128, dtype=bf), torch.zeros(B, 8, S, 128, dtype=bf)
        idx, cnt = torch.zeros(B, 512, dtype=i32), torch.full((B,), 512, dtype=i32)
        for splits in (1, 2, 4):
            sparse_verify.sparse_verify_attention(q, k, k, L, idx, cnt, num_splits=splits)
        sparse_verify.sparse_verify_attention(q, k, k, L, idx, cnt, num_splits=4, merge=False)  # combine launch
        sparse_verify.sparse_verify_attention(q, k, k, L, torch.zeros(B, 8, 512, dtype=i32),
                                              torch.full((B, 8), 512, dtype=i32))  # per-KV-head lists (Quest)
        for splits in (1, 4):  # a plan with log-weights (the sampled tail's)
            sparse_verify.sparse_verify_attention(q, k, k, L, idx, cnt, log_weights=torch.zeros(B, 512),
                                                  num_splits=splits)
        out = torch.zeros(B, S)
        # S_target, S_draft as measured (1 head; 4 heads on 2 KV heads x Γ), then every head of a layer of the
        # Qwen2.5-Coder pair (1.5B target: 12 heads on 2 KV heads, D 128; 0.5B draft: 14 on 2, D 64, Γ = 4)
        for nl, hs, tq, dd, hkv in ((1, 1, 1, 128, 8), (3, 4, 4, 64, 2), (28, 12, 1, 128, 2), (3, 14, 4, 64, 2)):
            qs = torch.zeros(B, nl, hs, tq, dd, dtype=bf)
            kall = torch.zeros(nl, B, hkv, S, dd, dtype=bf)
            kvh = (torch.arange(hs) * hkv // hs).to(i32).expand(nl, hs)  # GQA: consecutive heads share
            qpos = None if tq == 1 else torch.zeros(B, tq, dtype=torch.long)
            klen = L if tq == 1 else None
            for kw in ({}, {"accumulate": False}):
                score_estimation.attention_scores_multi(qs, kall, None, kvh, klen, qpos, out, ctx_lengths=L, **kw)
        # SpecAttn: all draft heads of one layer, one estimate per layer (DraftLookaheadScores.compute(
        # per_layer=True) -> accumulate_scores -> attention_scores)
        qs, kd = torch.zeros(B, 14, 4, 64, dtype=bf), torch.zeros(B, 2, S, 64, dtype=bf)
        kvh = torch.arange(14, dtype=i32) // 7
        score_estimation.attention_scores(qs, kd, kvh, L, torch.zeros(B, 4, dtype=torch.long), out, ctx_lengths=L,
                                          accumulate=False)
        fused_ops.add_rms_norm(torch.zeros(B, 5, 5120, dtype=bf), torch.ones(5120, dtype=bf), 1e-6)
        fused_ops.add_rms_norm(torch.zeros(B, 5, 896, dtype=bf), torch.ones(896, dtype=bf), 1e-6,
                               residual=torch.zeros(B, 5, 896, dtype=bf))
        for hq, hkv, d in ((40, 8, 128), (14, 2, 64)):
            q5 = torch.zeros(B, 5, hq, d, dtype=bf).transpose(1, 2)
            k5 = torch.zeros(B, 5, hkv, d, dtype=bf).transpose(1, 2)
            cs = torch.zeros(B, 5, d), torch.zeros(B, 5, d)
            fused_ops.rope_qk(q5, k5, *cs)
            cache = torch.zeros(2, B, hkv, 64, d, dtype=bf)  # the fused cache write (decode/verify: no k copy)
            fused_ops.rope_qk(q5, k5, *cs, v=k5, k_cache=cache[0], v_cache=cache[1], k_out=False,
                              positions=torch.zeros(B, 5, dtype=torch.long))
        for n in (4864, 8960, 27648 // 2):  # SwiGLU epilogue: 0.5B, 1.5B, 32B over 2 ranks; halves of gate_up
            fused_ops.silu_mul(*torch.zeros(B, 5, 2 * n, dtype=bf).chunk(2, dim=-1))
        lng = torch.long  # the draft's lookahead query capture: 4 of 14 heads, D 64, Γ 4, a view of a layer's slots
        fused_ops.capture_query(torch.zeros(B, 14, 2, 64, dtype=bf), torch.arange(4), torch.zeros(B, 2, dtype=lng),
                                torch.zeros(B, dtype=lng), torch.zeros(B, 3, 4, 4, 64, dtype=bf)[:, 1],
                                torch.zeros(B, 4, dtype=lng))
        selection.select_streaming(L, 512)
        compile_decode_layers(decode_linear)
        # packed chunked prefill: the 1.5B target (12 heads on 2, D 128), the 0.5B draft (14 on 2, D 64)
        plan = prefill_attention.PrefillPlan.build([(0, 0, 100), (1, 300, 64)], "cpu")
        for hq, hkv, d in ((12, 2, 128), (14, 2, 64)):
            kc = torch.zeros(B, hkv, S, d, dtype=bf)
            prefill_attention.prefill_attention(torch.zeros(hq, 200, d, dtype=bf), kc, kc, plan)
        os.environ["TRITON_INTERPRET"] = "1"  # only the wrappers' routing reads it now: take the Triton paths
        try:
            st = torch.rand(B, 4096)
            for m in (128, 0):  # dustin, dustin-t
                selection.select_dustin(st, st, torch.full((B,), 4000, dtype=i32), k=512, m=m)
            kq = torch.zeros(B, 8, 4096, 128, dtype=bf)
            pages = quest.QuestPages(1, B, 8, 128, 4096, bf, "cpu")
            pages.build(0, kq, torch.full((B,), 4000, dtype=i32))
            pages.update(0, kq, torch.full((B,), 3990, dtype=i32), torch.full((B,), 4000, dtype=i32), max_new=10)
            pages.select(0, torch.zeros(B, 40, 5, 128, dtype=bf), torch.full((B,), 4000, dtype=i32), 512)
        finally:
            del os.environ["TRITON_INTERPRET"]
    return compiled


if __name__ == "__main__":
    for c in compile_all_kernels():  # one line per launch: name, shared bytes, constexprs, launch_pdl, PTX order
        print(*c, sep="\t")
