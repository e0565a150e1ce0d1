"""Decoder-only transformer for the Llama / Qwen2 family (gpt-fast style, one file).

RMSNorm, RoPE (default / llama3 / yarn), grouped-query attention with an optional qkv bias (Qwen2),
SwiGLU MLP, optionally tied embeddings. Attention reads and writes a batched `KVCache`; *how* it attends
(dense, streaming, sparse) is decided by the `ForwardContext` and the attention backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dustin.attention.backend import AttentionBackend
from dustin.attention.context import ForwardContext, SparsePlan
from dustin.models.args import ModelArgs
from dustin.models.rope import RotaryEmbedding, apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Llama/Qwen2 RMSNorm: normalize in fp32, cast back, then scale in the activation dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """fused_ops: GPU tensors take the fused Triton kernel of dustin/kernels/fused_ops.py (one launch instead
    of ~7); False keeps the plain PyTorch ops (A/B timing, debugging). CPU tensors always take those."""

    def __init__(self, dim: int, eps: float, fused_ops: bool = True) -> None:
        super().__init__()
        self.eps, self.fused_ops = eps, fused_ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops and x.is_cuda:
            from dustin.kernels.fused_ops import add_rms_norm  # lazy: Triton
            return add_rms_norm(x.contiguous(), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)): the residual stream and the next sublayer's input."""
        if self.fused_ops and x.is_cuda:
            from dustin.kernels.fused_ops import add_rms_norm  # lazy: Triton
            return add_rms_norm(x.contiguous(), self.weight, self.eps, residual=residual)
        total = residual + x
        return total, rms_norm(total, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear with a faster CPU path for decode-sized inputs.

    For a few rows, MKL's `x @ W.T` streams the weight at ~2 GB/s on our 2-core CPUs while `W @ x.T` (the
    GEMV-shaped product) reaches ~8 GB/s; decode and verify steps have B * (Γ+1) rows, so this is 3-4x on CPU.
    GPUs keep the plain path (cuBLAS handles both shapes at the bandwidth limit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if x.device.type != "cpu" or rows > 256:
            return super().forward(x)
        out = (self.weight @ x.reshape(rows, -1).T).T
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().view(*x.shape[:-1], -1)


def fuse_linears(parts: list[nn.Linear]) -> Linear:
    """One Linear whose output is the concatenation of `parts`' outputs (they share their input): one GEMM instead
    of len(parts). Its weight (and bias) is a new concatenated copy; the caller drops the parts right after, so
    only one module's projections exist twice at any time (a model that barely fits still fuses)."""
    w0 = parts[0].weight
    with torch.device("meta"):  # no init of a throwaway weight
        fused = Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=w0.requires_grad)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=w0.requires_grad)
    return fused


class Attention(nn.Module):
    """fused_ops: RoPE of q and k in one Triton launch on GPU tensors (see RMSNorm).

    Built with separate q/k/v_proj (the checkpoint's names, which loading and tensor-parallel sharding address);
    `fuse()` then replaces them by one `qkv_proj` whose output rows are [q | k | v] (one GEMM, see
    `Transformer.fuse_projections`)."""

    def __init__(self, args: ModelArgs, layer: int, fused_ops: bool = True) -> None:
        super().__init__()
        self.layer, self.args, self.fused_ops = layer, args, fused_ops
        hd = args.head_dim
        self.q_proj = Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.k_proj = Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = Linear(args.n_heads * hd, args.dim, bias=False)
        self.qkv_proj: Linear | None = None

    def fuse(self) -> None:
        if self.qkv_proj is None:
            self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, T, H * D] of x; after fusion, views into the one qkv_proj output (no copies). The split
        sizes come from `self.args`, the rank's own head counts under tensor parallelism."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        a = self.args
        q_size, kv_size = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        return self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
                backend: AttentionBackend) -> torch.Tensor:
        B, T, _ = x.shape
        a = self.args
        q, k, v = self.project_qkv(x)
        q = q.view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
        k = k.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = v.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        cache = ctx.cache
        k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
        if ctx.packed is not None:
            return self.o_proj(self._packed_prefill(q, k, v, cos, sin, k_cache, v_cache, ctx, backend))
        if ctx.rows is not None:
            k_cache, v_cache = k_cache[ctx.rows], v_cache[ctx.rows]
        if self.fused_ops and q.is_cuda:  # RoPE and the cache write in one launch (k itself only for a prefill)
            from dustin.kernels.fused_ops import rope_qk  # lazy: Triton
            q, k = rope_qk(q, k, cos, sin, v=v, k_cache=k_cache, v_cache=v_cache, positions=ctx.positions,
                           k_out=ctx.fresh)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(self.layer, k, v, ctx.positions, ctx.rows)
        out = self.attend(q, k, v, k_cache, v_cache, ctx, backend)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim))

    def attend(self, q, k, v, k_cache, v_cache, ctx: ForwardContext, backend: AttentionBackend) -> torch.Tensor:
        """q [B, Hq, T, D] (rotated; k and v already in the cache) -> [B, Hq, T, D]: the query observers, this
        layer's sparse plan, then the backend's prefill (fresh: over k, v), sparse or dense verify."""
        for obs in ctx.observers:
            if self.layer in obs.layers:
                obs(self.layer, q, k_cache, ctx)
        plan = ctx.sparse
        if plan is not None:
            plan = plan.at_layer(self.layer) if isinstance(plan, SparsePlan) else plan.plan_layer(self.layer, q, ctx)
        if ctx.fresh:
            return backend.prefill(q, k, v)
        if plan is not None:
            return backend.sparse_verify(q, k_cache, v_cache, ctx.lengths, plan, max_len=ctx.max_len)
        return backend.verify(q, k_cache, v_cache, ctx.lengths, sinks=ctx.sinks, window=ctx.window,
                              max_len=ctx.max_len)

    def _packed_prefill(self, q, k, v, cos, sin, k_cache, v_cache, ctx: ForwardContext,
                        backend: AttentionBackend) -> torch.Tensor:
        """Prompt chunks of several rows in one forward (q, k, v [1, H, N, D], N >= the plan's real tokens:
        the rest is padding that keeps the GEMMs' shape fixed): RoPE, the real tokens' K/V written to their rows
        and positions, then each chunk attends over its row's cache up to itself. Returns [1, N, Hq * D]."""
        plan, a = ctx.packed, self.args
        if self.fused_ops and q.is_cuda:
            from dustin.kernels.fused_ops import rope_qk  # lazy: Triton
            q, k = rope_qk(q, k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n = plan.n_tokens
        k_cache[plan.token_rows, :, plan.token_pos] = k[0, :, :n].transpose(0, 1).to(k_cache.dtype)
        v_cache[plan.token_rows, :, plan.token_pos] = v[0, :, :n].transpose(0, 1).to(v_cache.dtype)
        for obs in ctx.observers:
            if self.layer in obs.layers:
                obs(self.layer, q, k_cache, ctx)
        out = backend.prefill_packed(q[0], k_cache, v_cache, plan)  # [Hq, N, D]
        return out.transpose(0, 1).reshape(1, -1, a.n_heads * a.head_dim)


class MLP(nn.Module):
    """SwiGLU. Built with separate gate/up_proj (checkpoint names); `fuse()` replaces them by one `gate_up_proj`
    (output rows [gate | up]: one GEMM). fused_ops: SiLU(gate) * up in one Triton launch on GPU tensors instead
    of two (see RMSNorm)."""

    def __init__(self, args: ModelArgs, fused_ops: bool = True) -> None:
        super().__init__()
        self.fused_ops = fused_ops
        self.gate_proj = Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.dim, bias=False)
        self.gate_up_proj: Linear | None = None

    def fuse(self) -> None:
        if self.gate_up_proj is None:
            self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:  # halves of the one output (views); its width is the rank's intermediate size x 2 under TP
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.fused_ops and gate.is_cuda:
            from dustin.kernels.fused_ops import silu_mul  # lazy: Triton
            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, fused_ops: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer, fused_ops)
        self.mlp = MLP(args, fused_ops)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, fused_ops)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, fused_ops)

    def forward(self, h, residual, cos, sin, ctx, backend):
        """(h, residual) -> (h', residual'): the residual stream is residual + h, kept apart so that each add is
        fused into the following norm (vLLM style); the first layer gets residual None."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = self.input_layernorm.add_forward(residual, h)
        h = self.self_attn(x, cos, sin, ctx, backend)
        residual, x = self.post_attention_layernorm.add_forward(residual, h)
        return self.mlp(x), residual

    def decode_forward(self, r: torch.Tensor, normed, cos, sin, ctx: ForwardContext, backend: AttentionBackend,
                       next_norm: RMSNorm | None):
        """(r, normed) -> the next layer's: the residual stream r [B, T, dim] (B * T <= decode_linear.MAX_ROWS)
        and `normed`, r ready for this layer's input norm (a decode_linear.RowNorm), in three fused kernels and
        the attention (dustin/kernels/decode_linear.py): q/k/v + RoPE + KV-cache write; attention; o_proj +
        residual; gate/up + SiLU·up; down_proj + residual. Each residual add also prepares the next norm's input
        (`next_norm`: the next layer's input norm; None after the last layer). The same math as `forward` (fp32: within
        rounding; see the kernels' module doc for bf16)."""
        from dustin.kernels.decode_linear import decode_linear, gate_up_silu, qkv_rope  # lazy: Triton
        attn, mlp, a = self.self_attn, self.mlp, self.self_attn.args
        k_cache, v_cache = ctx.cache.k[attn.layer], ctx.cache.v[attn.layer]
        ln2 = self.post_attention_layernorm
        q = qkv_rope(normed, attn.qkv_proj.weight, attn.qkv_proj.bias, cos, sin, ctx.positions, k_cache, v_cache,
                     n_heads=a.n_heads, n_kv_heads=a.n_kv_heads)
        out = attn.attend(q, None, None, k_cache, v_cache, ctx, backend)
        r, normed = decode_linear(out, attn.o_proj.weight, residual=r, heads=a.n_heads,
                                  next_norm=(ln2.weight, ln2.eps))
        x = gate_up_silu(normed, mlp.gate_up_proj.weight)
        if next_norm is None:
            return decode_linear(x, mlp.down_proj.weight, residual=r), None
        return decode_linear(x, mlp.down_proj.weight, residual=r, next_norm=(next_norm.weight, next_norm.eps))


class Transformer(nn.Module):
    """Parameter names follow the Hugging Face checkpoints (model.layers.N..., lm_head) until `fuse_projections`.
    On the GPU its forwards take our fused Triton kernels; `set_fused_ops(False)` keeps plain PyTorch ops (A/B,
    the engine's `ExecutionOptions.fused_ops`)."""

    def __init__(self, args: ModelArgs, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.args = args
        # GPU decode / verify forwards of <= decode_linear.MAX_ROWS rows take DecoderLayer.decode_forward (3
        # fused kernels + attention per layer) once the projections are fused; False keeps `forward` (A/B)
        self.decode_kernels = True
        # nn.Embedding's own init (normal_) on the meta device, where `load_model` builds, imports torch._dynamo
        # (~2 s of every process that loads a model: the CLI, each tensor-parallel rank); the same init elsewhere
        weight = torch.empty(args.vocab_size, args.dim)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(args)
        self.backend = backend or AttentionBackend.for_device("cpu")
        # the decoder layers of the decode forwards it takes, in one persistent kernel (a draft's
        # dustin.kernels.draft_decoder.DraftDecoder, attached by `dustin.models.draft_kernel.attach`); None: layer by
        # layer
        self.layer_kernel = None

    def set_fused_ops(self, on: bool) -> None:
        """On the GPU: our fused kernels (the decode-layer kernels, and RMSNorm / RoPE / SiLU-mul in one launch each),
        or with False the plain PyTorch ops (A/B, debugging). CPU tensors always take the plain ops."""
        self.decode_kernels = on
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused_ops = on

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext, logits_at: torch.Tensor | None = None,
                float_logits: bool = True, greedy: int | None = None, lm_head: bool = True) -> torch.Tensor:
        """tokens [B, T] -> fp32 logits [B, T, V], or [B, V] at `logits_at` ([B] indices into T).

        float_logits=False: the lm_head's output as it is, in the activation dtype. The fp32 logits are that
        tensor cast (exactly: every bf16 / fp16 value is an fp32 value), so a caller that only takes an argmax,
        or casts where it needs fp32 (dustin.engine.sampling does), gets the same tokens without the copy: in a
        speculative step, one [B, T, V] write and its re-read per forward, 5 per step at Γ = 4.
        greedy=V: each row's greedy token at its last position instead, [B] long: the first maximum of its first V
        logits in the activation dtype (a draft's greedy forward; the persistent layer kernel may choose it inside
        its launch, `DraftDecoder.greedy`).
        lm_head=False: the final hidden states (after the last norm, [B, T, dim] or [B, dim] at `logits_at`) instead
        of logits, for a caller that runs the LM head itself in pieces (prompt log-probabilities)."""
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary(ctx.positions)
        if greedy is not None:
            kernel = self.layer_kernel
            if kernel is not None and self._takes_decode_kernels(h, ctx) and kernel.takes_greedy(h, ctx, greedy):
                return kernel.greedy(h, cos, sin, ctx)
            logits = self._forward_logits(h, cos, sin, ctx, None, False)[:, -1, :greedy]
            return (logits.float() if logits.device.type == "cpu" else logits).argmax(-1)  # as engine.sampling's
        return self._forward_logits(h, cos, sin, ctx, logits_at, float_logits, lm_head)

    def _forward_logits(self, h, cos, sin, ctx: ForwardContext, logits_at: torch.Tensor | None,
                        float_logits: bool, lm_head: bool = True) -> torch.Tensor:
        residual = None
        if self._takes_decode_kernels(h, ctx):
            return self.decode_logits(h, cos, sin, ctx, logits_at, float_logits, lm_head)
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, ctx, self.backend)
        if logits_at is not None:
            rows = torch.arange(h.shape[0], device=h.device)
            h, residual = h[rows, logits_at], residual[rows, logits_at]
        h = self.norm.add_forward(residual, h)[1]
        if not lm_head:
            return h
        logits = self.lm_head(h)
        return logits.float() if float_logits else logits

    def decode_logits(self, h, cos, sin, ctx: ForwardContext, logits_at: torch.Tensor | None = None,
                      float_logits: bool = True, lm_head: bool = True) -> torch.Tensor:
        """`forward` after the embedding, through `DecoderLayer.decode_forward` (its conditions:
        `_takes_decode_kernels`)."""
        if self.layer_kernel is not None and self.layer_kernel.takes(h, ctx):
            h = self.layer_kernel.forward(h, cos, sin, ctx)
        else:
            from dustin.kernels.decode_linear import row_norm  # lazy: Triton
            ln = self.layers[0].input_layernorm
            normed = row_norm(h, ln.weight, ln.eps)
            nexts = [layer.input_layernorm for layer in self.layers[1:]] + [None]
            for layer, nxt in zip(self.layers, nexts, strict=True):
                h, normed = layer.decode_forward(h, normed, cos, sin, ctx, self.backend, nxt)
        if logits_at is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logits_at]
        h = self.norm(h)
        if not lm_head:
            return h
        logits = self.lm_head(h)
        return logits.float() if float_logits else logits

    def _takes_decode_kernels(self, h: torch.Tensor, ctx: ForwardContext) -> bool:
        """Decode and verify forwards on a GPU: new tokens appended to every row's cache (no prefill, no packed
        chunks), fused projections, no tensor parallelism (its all-reduce sits between o_proj / down_proj and the
        residual add), and either the persistent layer kernel takes them or they have few rows."""
        if not (h.is_cuda and not ctx.fresh and ctx.packed is None and ctx.rows is None and self.projections_fused
                and self.unsharded):
            return False
        from dustin.kernels.decode_linear import MAX_ROWS  # lazy: Triton
        if self.layer_kernel is not None and self.layer_kernel.takes(h, ctx):
            return True
        return self.decode_kernels and h.shape[0] * h.shape[1] <= MAX_ROWS

    @property
    def unsharded(self) -> bool:
        """No tensor-parallel layers (their all-reduce sits between o_proj / down_proj and the residual add)."""
        return type(self.layers[0].self_attn.o_proj) is Linear and type(self.layers[0].mlp.down_proj) is Linear

    def fuse_projections(self) -> Transformer:
        """Concatenate each layer's q/k/v_proj into one qkv_proj and gate/up_proj into one gate_up_proj: two GEMM
        launches per layer instead of five, the same math (each output element is the same dot product).

        Load time, after the weights are in place (dustin/models/loader.py calls it last): the checkpoints, the
        loader and tensor-parallel sharding keep the Hugging Face names. Layer by layer, each separate weight is
        freed as soon as it is copied. Idempotent. The state_dict then names qkv_proj / gate_up_proj; a fused model
        can still be sharded (`shard_transformer` slices each part of a fused projection)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    @property
    def projections_fused(self) -> bool:
        return all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
                   for layer in self.layers)
