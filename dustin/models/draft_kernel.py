"""The draft's persistent layer kernel (dustin/kernels/draft_decoder.py) attached to a model, once it has shown on
the model's own weights that it computes what the per-layer kernels compute.

Attaching runs the model's forward three ways (per-layer kernels, the persistent kernel, its CUDA-graph replay) and
compares them, so it needs the model, its forward context and a cache: it lives here, above the kernels, which know
nothing of models or forward contexts."""
from __future__ import annotations

import torch

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.errors import OutOfMemoryError
from dustin.kernels import draft_decoder


def attach(model, sinks: int, window: int, rows=(), vocab: int | None = None) -> str | None:
    """Run `model`'s decode forwards of this streaming window through the persistent kernel where it can
    (`model.layer_kernel`), with the instruction lists of `rows` (numbers of token rows) made now, and its greedy
    forwards' argmax over the first `vocab` logits in the same launch (None: never); returns why not (None:
    attached). The reason is logged once per reason."""
    reason = draft_decoder.why_not(model, sinks, window)
    if reason is None:
        try:
            kernel = draft_decoder.DraftDecoder(model, sinks, window, rows, vocab)
            reason = self_check(model, kernel)
            if reason is None:
                model.layer_kernel = kernel
        except (draft_decoder.BuildError, OSError) as e:
            reason = f"build failed: {e}"
    if reason is not None:
        draft_decoder.log_once(f"draft decoder layers run layer by layer: {reason}")
    return reason


@torch.inference_mode()
def self_check(model, kernel: draft_decoder.DraftDecoder, tol: float = 0.02) -> str | None:
    """For each build, one forward of its most token rows (2 tokens a row: a step's first draft forward) over a small
    random cache, on the model's own weights, three ways: through the per-layer kernels, through the kernel, and
    through the kernel captured in a CUDA graph and replayed. None when the kernel's logits agree with the per-layer
    kernels' (to `tol` of their largest, or to twice the distance between the per-layer kernels and the plain PyTorch
    ops on the same inputs where that is larger: two correct bf16 forwards drift that far apart) and the replay's
    equal the launch's, else why not. A kernel that computes
    wrong numbers on this GPU, driver or build, or cannot be captured, is never used (it would be silently wrong, or
    break the step graph). A fault that kills the CUDA context cannot be caught here. Where the kernel also takes
    greedy forwards (`head_for`), their tokens, launched and replayed, must be the per-layer logits' argmax (or
    within that bound of its logit: a near-tie); if not, greedy forwards keep the LM head outside (`vocab` None) and the
    reason is logged once, the layers staying in the kernel."""
    stream = torch.cuda.current_stream(kernel.device)
    try:
        for size in kernel.builds:
            reason = _check_rows(model, kernel, size // 2, 2, tol)
            if reason:
                return reason
        return None
    except (RuntimeError, OutOfMemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        return f"self-check failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    finally:
        torch.cuda.set_stream(stream)  # a capture that failed leaves its side stream current


def _check_rows(model, kernel: draft_decoder.DraftDecoder, B: int, T: int, tol: float) -> str | None:
    a, dev = model.args, kernel.device
    n = kernel.sinks + kernel.window + 100  # a window that is full, past the sinks
    gen = torch.Generator(device=dev)

    def run(layer_kernel, graphed: bool, plain: bool = False, **kw) -> torch.Tensor:
        """One forward over fresh copies of the same random inputs (graphed: captured, then replayed: the step
        graphs capture the launch, which must be capturable and replay the same numbers; plain: the plain PyTorch
        ops instead of our fused kernels)."""
        cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, n + T, kernel.dtype, dev)
        gen.manual_seed(0)
        cache.k.normal_(generator=gen)
        cache.v.normal_(generator=gen)
        lengths = torch.full((B,), n, dtype=torch.int32, device=dev)
        tokens = torch.randint(0, a.vocab_size, (B, T), device=dev, generator=gen)
        positions = lengths.long()[:, None] + torch.arange(T, device=dev)
        ctx = ForwardContext(cache, positions, lengths, n + T, sinks=kernel.sinks, window=kernel.window)
        before, fused, model.layer_kernel = model.layer_kernel, model.decode_kernels, layer_kernel
        try:
            if plain:
                model.set_fused_ops(False)
            if not graphed:
                return model(tokens, ctx, **kw)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(tokens, ctx, **kw)
            graph.replay()
            return out
        finally:
            model.layer_kernel = before
            if plain:
                model.set_fused_ops(fused)

    def apart(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    ref, got, graphed = run(None, False), run(kernel, False), run(kernel, True)
    # How far two bf16 implementations of the same forward land apart on these inputs: the per-layer kernels and
    # the plain PyTorch ops round at other points, and a deep stack amplifies each rounding step (on random weights
    # by ~2% of the largest logit over 4 layers, ~6% over 24: scripts/gpu_draft_drift.py). The kernel rounds at its
    # own points too; a wrong stage or a race lands far outside twice that spread.
    bound = max(tol, 2 * apart(run(None, False, plain=True), ref))
    err = apart(got, ref)
    if not err <= bound:  # NaN fails too
        return (f"self-check failed: {B} x {T} rows' logits differ from the per-layer kernels' by {err:.3g} of "
                f"their largest (two bf16 implementations: up to {bound:.3g})")
    if not torch.equal(graphed, got):
        return "self-check failed: a CUDA graph's replay of the kernel gives other logits than its launch"
    if kernel.head_for(B * T):
        last = ref[:, -1, :kernel.vocab]
        tok, tok_graphed = run(kernel, False, greedy=kernel.vocab), run(kernel, True, greedy=kernel.vocab)
        at = last.gather(1, tok[:, None].clamp(0, kernel.vocab - 1))[:, 0]
        near = at >= last.max(-1).values - bound * ref.abs().max()
        if not (bool(near.all()) and bool((tok < kernel.vocab).all()) and torch.equal(tok, tok_graphed)):
            kernel.vocab = None
            draft_decoder.log_once(f"the draft's greedy tokens are chosen outside its persistent kernel: {B} x {T} "
                                   f"rows' in-kernel argmax differs from the per-layer logits' (or its graph replay "
                                   f"from its launch)")
    return None
