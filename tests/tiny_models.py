"""Tiny random Llama / Qwen2 checkpoints (config.json + safetensors + a word-level tokenizer),
written with transformers' own classes."""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def make_tiny_checkpoint(folder: Path, family: str, *, rope: str = "default", layers: int = 2, dim: int = 64,
                         heads: int = 8, kv_heads: int = 2, seed: int = 0, vocab: int = VOCAB,
                         tie: bool | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim + 16, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2)
    if rope == "llama3":
        common["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        common["rope_theta"] = 500000.0
    elif rope == "yarn":
        common["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
        common["rope_theta"] = 10000.0
    torch.manual_seed(seed)
    if family == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=True if tie is None else tie, rms_norm_eps=1e-6, **common)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(tie_word_embeddings=False if tie is None else tie, rms_norm_eps=1e-5, **common)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF init is tiny (std 0.02): widen it so logits are not near-uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 if "embed" in name else 0.25)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return folder


def with_char_tokenizer(folders, root: Path) -> tuple[Path, ...]:
    """Copies of model folders with a character-level tokenizer (96 ids: newline and ASCII 32..123), so that real
    code and prose tokenize to real token ids (the tiny models' word-level tokenizer maps text to almost
    nothing)."""
    import shutil

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "\n"] + [chr(c) for c in range(32, 124)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    out = []
    for src, name in zip(folders, ("target", "draft"), strict=True):
        folder = Path(root) / name
        shutil.copytree(src, folder)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / f).unlink(missing_ok=True)
        fast.save_pretrained(folder)
        out.append(folder)
    return tuple(out)


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def config_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def make_tiny_draft(target: Path, folder: Path, *, layers: int | None = None, noise: float = 0.05,
                    seed: int = 7) -> Path:
    """A draft that shares the target's tokenizer: the target's first `layers` layers plus weight noise,
    so it agrees with the target often but not always (acceptance strictly between 0 and 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    cfg = AutoConfig.from_pretrained(target)
    if layers is not None:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    src = hf_model(target)
    draft = AutoModelForCausalLM.from_config(cfg)
    draft.load_state_dict(src.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    draft.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return folder


def gpu_check_pair(dtype: torch.dtype):
    """The GPU check scripts' pair (scripts/gpu_*_check.py): a 4-layer Qwen2 target (head_dim 64) and its noisy
    draft on CUDA with the Triton backend, plus four random prompts of 37 to 3001 tokens. Returns (engine,
    prompts, target folder)."""
    import tempfile

    from dustin.attention.backend import AttentionBackend
    from dustin.engine.engine import Engine
    from dustin.models.loader import load_model

    root = Path(tempfile.mkdtemp())
    target = make_tiny_checkpoint(root / "t", "qwen2", layers=4, dim=256, heads=4, kv_heads=2, seed=5, vocab=512)
    draft = make_tiny_draft(target, root / "d", noise=0.1)
    be = AttentionBackend("triton")
    eng = Engine.from_models(load_model(target, "cuda", dtype, be), load_model(draft, "cuda", dtype, be))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (37, 700, 1500, 3001)]
    return eng, prompts, (target, draft)
