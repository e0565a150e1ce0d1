"""Rotary position embeddings with the `rope_scaling` types default, llama3 and yarn.

The inverse frequencies follow transformers' `ROPE_INIT_FUNCTIONS` so that logits match its models;
tests compare against transformers on tiny checkpoints of each type.
"""
from __future__ import annotations

import math

import torch

from dustin.models.args import ModelArgs


def _llama3_inv_freq(inv_freq: torch.Tensor, rs: dict) -> torch.Tensor:
    factor = rs["factor"]
    low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, rs: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = rs["factor"]
    orig = rs.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            attention_factor = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the dimension keeps its original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Return (inverse frequencies [head_dim // 2], attention scaling applied to cos/sin)."""
    dim, base = args.head_dim, args.rope_theta
    rs = args.rope_scaling or {}
    kind = rs.get("rope_type", "default")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rs), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(base, dim, rs, args.max_position_embeddings)
    return inv_freq, 1.0


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for arbitrary per-sequence positions (ragged batches) on the fly, in fp32."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # on the CPU even where a model is built on the meta device (`load_model`, which computes the buffers anew
        # once loaded): meta tensors take PyTorch's Python references, whose first use imports torch._dynamo (~2 s)
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling == 1.0:  # the same bits without two launches per forward (every rope type but yarn)
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D]. Rotate-half convention (HF / NeoX layout)."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)
