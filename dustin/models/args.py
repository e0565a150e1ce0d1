"""Model hyper-parameters for the Llama / Qwen2 decoder family, and a table of named public configs.

`ModelArgs.from_hf_config` reads a Hugging Face config.json (transformers 4.x `rope_scaling` or 5.x
`rope_parameters`); `NAMED_CONFIGS` holds the public shapes we benchmark with random weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from dustin.errors import CheckpointError, InputError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {"rope_type": ..., factors}
    max_position_embeddings: int = 32768
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    family: str = "llama"  # "llama" | "qwen2"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(
                f"model config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        rope_type = self.rope_scaling.get("rope_type", "default") if self.rope_scaling else "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(f"model config: rope_scaling type {rope_type!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    @property
    def gqa_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def num_params(self) -> int:
        qkv = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        o = self.n_heads * self.head_dim * self.dim
        mlp = 3 * self.dim * self.intermediate_size
        emb = self.vocab_size * self.dim * (1 if self.tie_word_embeddings else 2)
        return self.n_layers * (qkv + o + mlp + 2 * self.dim) + emb + self.dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        family = cfg.get("model_type")
        if archs and archs[0] in SUPPORTED_ARCHITECTURES:
            family = SUPPORTED_ARCHITECTURES[archs[0]]
        if family not in ("llama", "qwen2"):
            raise CheckpointError(f"unsupported architecture {archs or family!r}: dustin runs Llama and Qwen2 "
                                  f"decoder-only models ({', '.join(SUPPORTED_ARCHITECTURES)})")
        try:
            n_heads = cfg["num_attention_heads"]
            # transformers 5 moves rope_theta / rope_scaling into rope_parameters
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
            rope.pop("rope_theta", None)
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
            if rope.get("rope_type", "default") == "default":
                rope = {}
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                vocab_size=cfg["vocab_size"],
                dim=cfg["hidden_size"],
                n_layers=cfg["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                intermediate_size=cfg["intermediate_size"],
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
                norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=rope,
                max_position_embeddings=cfg.get("max_position_embeddings", 32768),
                qkv_bias=(family == "qwen2") or bool(cfg.get("attention_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                family=family,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json is missing the field {e.args[0]!r}") from None


def with_rope_scaling(args: ModelArgs, spec: str | None) -> ModelArgs:
    """`--rope-scaling yarn:F`: extend a model's context F times with YaRN (over its configured context), as
    Qwen2.5's model cards document for 128k (factor 4 over 32,768 positions; their config.json ships without it,
    so that short inputs keep the unscaled rotary frequencies). None: the config as it is.

    Refused with one line: another spec than yarn:F (F > 1), a model whose config already scales RoPE, and, for a
    Qwen2 model of 32,768 positions (the Qwen2.5 family), any factor but the documented 4."""
    if spec is None:
        return args
    kind, _, value = spec.partition(":")
    try:
        factor = float(value)
    except ValueError:
        factor = 0.0
    if kind != "yarn" or not factor > 1:
        raise InputError(f"--rope-scaling takes yarn:FACTOR with FACTOR > 1 (e.g. yarn:4), got {spec!r}")
    if args.rope_scaling and args.rope_scaling.get("rope_type", "default") != "default":
        raise InputError(f"--rope-scaling: the model config already sets rope_scaling {args.rope_scaling}; "
                         f"drop the flag")
    orig = args.max_position_embeddings
    if args.family == "qwen2" and orig == 32768 and factor != 4:
        raise InputError(f"--rope-scaling {spec}: Qwen2.5 models document YaRN with factor 4 over 32,768 positions "
                         f"(128k); use yarn:4")
    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    return replace(args, rope_scaling=rope, max_position_embeddings=int(orig * factor))


def _qwen2(dim, layers, heads, kv, inter, vocab=152064, tie=False, eps=1e-6, max_pos=32768) -> ModelArgs:
    return ModelArgs(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                     intermediate_size=inter, norm_eps=eps, rope_theta=1e6, qkv_bias=True,
                     tie_word_embeddings=tie, family="qwen2", max_position_embeddings=max_pos,
                     eos_token_ids=(151645, 151643))


def _llama3(dim, layers, heads, kv, inter, factor, tie=False, head_dim=0) -> ModelArgs:
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    return ModelArgs(vocab_size=128256, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                     intermediate_size=inter, head_dim=head_dim, norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling=rope, max_position_embeddings=131072, tie_word_embeddings=tie,
                     family="llama", bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))


# Public shapes (from each model's config.json), used with random weights for benchmarks.
NAMED_CONFIGS: dict[str, ModelArgs] = {
    "qwen2.5-0.5b": _qwen2(896, 24, 14, 2, 4864, vocab=151936, tie=True),
    "qwen2.5-1.5b": _qwen2(1536, 28, 12, 2, 8960, vocab=151936, tie=True),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944),
    "qwen2.5-14b": _qwen2(5120, 48, 40, 8, 13824, eps=1e-5),
    "qwen2.5-32b": _qwen2(5120, 64, 40, 8, 27648, eps=1e-5),
    "qwen2.5-72b": _qwen2(8192, 80, 64, 8, 29568, eps=1e-5),
    "llama-3.2-1b": _llama3(2048, 16, 32, 8, 8192, factor=32.0, tie=True, head_dim=64),
    "llama-3.1-8b": _llama3(4096, 32, 32, 8, 14336, factor=8.0),
    "llama-3.3-70b": _llama3(8192, 80, 64, 8, 28672, factor=8.0),
}


def named_config(name: str, **overrides: Any) -> ModelArgs:
    key = name.lower()
    if key not in NAMED_CONFIGS:
        raise CheckpointError(f"unknown named config {name!r}; known: {', '.join(sorted(NAMED_CONFIGS))}")
    return replace(NAMED_CONFIGS[key], **overrides)


def pair_context(target: ModelArgs, draft: ModelArgs | None = None) -> int:
    """Positions a sequence may take: the target's context, and the draft's too when it drafts (draft None when
    it does not). The one place this is computed: the loaded pair (`Engine.max_context`) and the commands that
    check prompts from config.json before loading both call it."""
    context = target.max_position_embeddings
    return context if draft is None else min(context, draft.max_position_embeddings)
