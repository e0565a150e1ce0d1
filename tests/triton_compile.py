"""Compile Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

The CPU interpreter (TRITON_INTERPRET=1) runs kernels as NumPy code and so misses errors of the real compiler
(loop-carried type changes, unsupported ops, shared-memory overflows). `compile_launches()` patches
`JITFunction.run`: every launch made inside the block is compiled ahead of time for `GPUTarget("cuda", 90, 32)`
with the launch's own arguments (tensor dtypes, ints, constexprs, num_warps / num_stages) and not run. The
wrappers around the kernels run unchanged on CPU tensors, so each kernel is compiled with exactly the
specialization the engine asks for. Used by tests/test_kernels_compile.py in a subprocess with the interpreter
off.
"""
from __future__ import annotations

import contextlib

import torch

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
           torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r}")


@contextlib.contextmanager
def compile_launches(compiled: list[str]):
    """Within the block, kernel launches compile for sm_90 instead of running; names go to `compiled`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAUNCH_OPTIONS}
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        signature, constexprs = {}, {}
        for p in self.params:
            value = bound.get(p.name, p.default)
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constexprs[p.name] = value
            elif value is None:
                signature[p.name] = "constexpr"
                constexprs[p.name] = None
            else:
                signature[p.name] = _arg_type(value)
        src = ASTSource(fn=self, signature=signature, constexprs=constexprs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        compiled.append(self.fn.__name__)

    saved = JITFunction.run
    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = saved


def compile_all_kernels() -> list[str]:
    """Launch every kernel of dustin/kernels through its Python wrapper, at the shapes and options the engine
    uses on the GPU (bf16 caches, Qwen2.5-32B / 0.5B head layouts, Γ = 4), compiling instead of running.
    Must run with TRITON_INTERPRET unset (the kernels must be JITFunctions)."""
    import os

    from dustin.kernels import fused_ops, quest, score_estimation, selection, sparse_verify, verify_attention

    bf, i32 = torch.bfloat16, torch.int32
    compiled: list[str] = []
    B, S = 2, 700
    L = torch.full((B,), 600, dtype=i32)
    with compile_launches(compiled):
        for hq, hkv, d, t in ((40, 8, 128, 5), (14, 2, 64, 1), (14, 2, 64, 2)):  # target verify, draft steps
            q, k = torch.zeros(B, hq, t, d, dtype=bf), torch.zeros(B, hkv, S, d, dtype=bf)
            verify_attention.verify_attention(q, k, k, L, max_len=S)
            verify_attention.verify_attention(q, k, k, L, sinks=4, window=508, max_len=S)  # streaming draft
        q, k = torch.zeros(B, 40, 5, 128, dtype=bf), torch.zeros(B, 8, S, 128, dtype=bf)
        idx, cnt = torch.zeros(B, 512, dtype=i32), torch.full((B,), 512, dtype=i32)
        for merge in ("launch", "kernel"):
            for splits in (1, 2, 4):
                sparse_verify.sparse_verify_attention(q, k, k, L, idx, cnt, num_splits=splits, merge=merge)
        sparse_verify.sparse_verify_attention(q, k, k, L, torch.zeros(B, 8, 512, dtype=i32),
                                              torch.full((B, 8), 512, dtype=i32))  # per-KV-head lists (Quest)
        out = torch.zeros(B, S)
        for nl, hs, tq, dd, hkv in ((1, 1, 1, 128, 8), (3, 4, 4, 64, 2)):  # S_target, S_draft
            qs = torch.zeros(B, nl, hs, tq, dd, dtype=bf)
            kall = torch.zeros(nl, B, hkv, S, dd, dtype=bf)
            kvh = torch.zeros(nl, hs, dtype=i32)
            qpos = None if tq == 1 else torch.zeros(B, tq, dtype=torch.long)
            klen = L if tq == 1 else None
            for kw in ({}, {"fused": False}, {"single_pass": True}, {"accumulate": False}):
                score_estimation.attention_scores_multi(qs, kall, None, kvh, klen, qpos, out, ctx_lengths=L, **kw)
        fused_ops.add_rms_norm(torch.zeros(B, 5, 5120, dtype=bf), torch.ones(5120, dtype=bf), 1e-6)
        fused_ops.add_rms_norm(torch.zeros(B, 5, 896, dtype=bf), torch.ones(896, dtype=bf), 1e-6,
                               residual=torch.zeros(B, 5, 896, dtype=bf))
        for hq, hkv, d in ((40, 8, 128), (14, 2, 64)):
            fused_ops.rope_qk(torch.zeros(B, 5, hq, d, dtype=bf).transpose(1, 2),
                              torch.zeros(B, 5, hkv, d, dtype=bf).transpose(1, 2),
                              torch.zeros(B, 5, d), torch.zeros(B, 5, d))
        selection.select_streaming(L, 512)
        os.environ["TRITON_INTERPRET"] = "1"  # only the wrappers' routing reads it now: take the Triton paths
        try:
            st = torch.rand(B, 4096)
            for impl in ("radix", "topk"):
                for m in (128, 0):  # dustin, dustin-t
                    selection.select_dustin(st, st, torch.full((B,), 4000, dtype=i32), k=512, m=m, impl=impl)
            kq = torch.zeros(B, 8, 4096, 128, dtype=bf)
            pages = quest.QuestPages(1, B, 8, 128, 4096, bf, "cpu")
            pages.build(0, kq, torch.full((B,), 4000, dtype=i32))
            pages.select(0, torch.zeros(B, 40, 5, 128, dtype=bf), torch.full((B,), 4000, dtype=i32), 512)
        finally:
            del os.environ["TRITON_INTERPRET"]
    return compiled


if __name__ == "__main__":
    names = compile_all_kernels()
    print(" ".join(sorted(set(names))))
