"""`dustin warmup`: compile the Triton kernels of the prefill and the decode step for given batch sizes and a context
ahead of time.

Triton keeps every compiled kernel in its on-disk cache (~/.triton/cache, or $TRITON_CACHE_DIR), keyed by the
kernel's source, the GPU and the specialization (dtypes, constexprs, which ints are 1 or multiples of 16 and which
pointers are 16-byte aligned). A later `dustin generate` or `dustin serve` whose decode step asks for the same
specializations loads them from there instead of compiling. The specializations depend on the models, the method
and its sparse config, Γ, the batch size (grid sizes of the estimation and attention kernels) and, for short
contexts, the KV capacity; this command plans them as `dustin generate` would for `--batch-sizes` prompts of
`--context` positions (prompt + new tokens) with `dustin/engine/warmup.py`'s dry run and compiles each one (with
its launcher), on a GPU (nothing runs on it but the model load). With a draft it also builds the draft's
persistent layer kernel (`ExecutionOptions(draft_kernel=True)`) with nvcc into $DUSTIN_HOME/kernels.
"""
from __future__ import annotations

from dustin.engine.config import METHODS, GenerationConfig
from dustin.errors import InputError
from dustin.flags import (
    add_model_args,
    add_sparse_args,
    add_speculation_args,
    budget_settings,
    int_list,
    method_list,
)
from dustin.selection.config import DUSTIN_POLICIES


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--methods", default="vanilla,dustin", help="decoding methods (those dustin serve runs)")
    p.add_argument("--batch-sizes", default="16", help="sequences per batch, comma separated")
    p.add_argument("--context", type=int, default=32768,
                   help="positions per sequence (prompt + new tokens) the KV cache is planned for")
    add_speculation_args(p)
    add_sparse_args(p)


def run(args) -> int:
    import json
    import time

    import torch

    from dustin.engine.core import DEFAULT_PREFILL_TOKENS_GPU
    from dustin.engine.engine import Engine
    from dustin.engine.kv_manager import cache_capacity
    from dustin.engine.offline.batch import KEPT_ROUNDING
    from dustin.engine.pair import parse_device
    from dustin.engine.warmup import KernelWarmup, compiles_here, plan_first_step
    from dustin.selection.registry import policy_class

    methods = method_list(args.methods)
    chunked = [m for m in METHODS if policy_class(METHODS[m].policy).row_local]
    off = [m for m in methods if m not in chunked]
    if off:
        raise InputError(f"--methods: {', '.join(off)} run as gangs (whole-batch prefill), whose kernels compile "
                         f"at their first step; choose from {', '.join(chunked)}")
    batches = int_list("--batch-sizes", args.batch_sizes)
    if args.context < 16:
        raise InputError(f"--context must be >= 16, got {args.context}")
    if not compiles_here(parse_device(args.device)):
        raise InputError(f"dustin warmup compiles Triton kernels for a GPU, not for --device {args.device}: run it "
                         f"with --device cuda on the machine that will decode (Triton's interpreter and the CPU path "
                         f"compile nothing)")
    speculative = any(METHODS[m].speculative for m in methods)
    engine = Engine.from_pretrained(args.target, args.draft if speculative else None, device=args.device,
                                    dtype=args.dtype, attention=args.attention, rope_scaling=args.rope_scaling)
    from triton import knobs

    print(f"Triton's kernel cache: {knobs.cache.dir}")
    for method in methods:
        policy = METHODS[method].policy
        cfg = GenerationConfig(method=method, gamma=args.gamma, draft_window=args.draft_window,
                               **budget_settings(args, policy != "full", policy in DUSTIN_POLICIES),
                               sparse_config=args.config if policy != "full" else None)
        gamma = cfg.gamma if cfg.spec.speculative else 0
        # the capacity `Engine.generate` gives prompts of this many positions (rounded up as it keeps engines)
        need = cache_capacity([args.context], [0], gamma)
        cap = -(-need // KEPT_ROUNDING) * KEPT_ROUNDING
        for batch in batches:
            t0 = time.perf_counter()
            plan = plan_first_step(engine.pair, cfg, batch, cap, DEFAULT_PREFILL_TOKENS_GPU, cfg.prefill_chunk)
            stats = KernelWarmup(plan, engine.pair.device, plan_s=time.perf_counter() - t0).start().wait()
            print(json.dumps({"method": method, "batch": batch, "capacity": cap, **stats}))
            if stats["errors"]:
                print(f"dustin: warning: {stats['errors']} kernel(s) failed to compile: {stats['first_error']}")
    if engine.pair.draft is not None:  # the draft's persistent layer kernel (opt-in), built with nvcc into its cache
        from dustin.kernels import draft_decoder
        print(json.dumps({"draft_kernel": draft_decoder.build_all(draft_decoder.Shape.of(engine.pair.draft.args))}))
    torch.cuda.synchronize()
    return 0
