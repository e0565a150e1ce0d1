"""GGUF (qwen2 architecture) -> Hugging Face folder: config.json, bf16 model.safetensors, tokenizer files.

Tensors are dequantized one at a time with the `gguf` package and streamed into the safetensors file, so peak
memory stays near one tensor; the folder is written under a temporary name and renamed into place at the end.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

from dustin.errors import CheckpointError
from dustin.models.progress import bar, spinner

MARKER = "dustin-source.json"  # written last into a finished folder (see fetch.py)

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
_REQUIRED = object()


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True, marker: dict | None = None) -> Path:
    """Convert a Qwen2 GGUF into a Hugging Face folder (bf16 safetensors), written atomically to `out_dir`.

    We dequantize one tensor at a time and stream it to disk (transformers' own GGUF loader needs
    `accelerate` and holds the whole model): peak RAM is one fp32 tensor (0.9 GB for the 1.5B embedding).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _read_gguf(gguf_path)
    config, plan = _plan_conversion(reader, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_safetensors(plan, tmp / "model.safetensors", gguf_path, progress)
        config.save_pretrained(tmp)
        from transformers import GenerationConfig
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(tmp)
        _write_tokenizer(gguf_path, reader, config, tmp, progress)
        if marker is not None:  # written last: its presence means the folder is complete
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _read_gguf(path: Path):
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    from gguf import GGUFReader
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on truncated or foreign files
        raise CheckpointError(f"{path} is not a readable GGUF file (corrupt or truncated?): {e}") from None


def _meta(reader, key: str, path: Path, default=_REQUIRED):
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{path}: the GGUF metadata lacks {key}")
        return default
    return field.contents()


def _plan_conversion(reader, path: Path):
    """The HF config, and (hf_name, gguf_tensor, shape) for every weight, checked before writing anything."""
    from transformers import Qwen2Config
    arch = _meta(reader, "general.architecture", path)
    if arch != "qwen2":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (dustin converts qwen2)")

    def meta(key, default=_REQUIRED):
        return _meta(reader, key, path, default)
    tokens = meta("tokenizer.ggml.tokens")
    hidden, layers = int(meta("qwen2.embedding_length")), int(meta("qwen2.block_count"))
    heads, inter = int(meta("qwen2.attention.head_count")), int(meta("qwen2.feed_forward_length"))
    kv_heads = int(meta("qwen2.attention.head_count_kv", heads))
    tensors = {t.name: t for t in reader.tensors}
    tie = "output.weight" not in tensors  # llama.cpp writes output.weight only when the head is untied
    eos = [int(meta("tokenizer.ggml.eos_token_id"))]
    if "<|endoftext|>" in tokens and tokens.index("<|endoftext|>") not in eos:
        eos.append(tokens.index("<|endoftext|>"))  # upstream Qwen generation_config stops on both
    config = Qwen2Config(
        architectures=["Qwen2ForCausalLM"], vocab_size=len(tokens), hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=int(meta("qwen2.context_length", 32768)),
        # GGUF stores float32: 9.99999997e-07 back to the 1e-06 of the upstream config
        rms_norm_eps=float(f'{meta("qwen2.attention.layer_norm_rms_epsilon", 1e-6):.7g}'),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta("qwen2.rope.freq_base", 1e6))},
        tie_word_embeddings=tie, use_sliding_window=False, max_window_layers=layers, dtype="bfloat16",
        bos_token_id=meta("tokenizer.ggml.bos_token_id", None), eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=meta("tokenizer.ggml.padding_token_id", None))
    q, kv = heads * (hidden // heads), kv_heads * (hidden // heads)
    shapes = {"model.embed_tokens.weight": (len(tokens), hidden), "model.norm.weight": (hidden,)}
    if not tie:
        shapes["lm_head.weight"] = (len(tokens), hidden)
    for i in range(layers):
        block = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                 "self_attn.q_proj.weight": (q, hidden), "self_attn.q_proj.bias": (q,),
                 "self_attn.k_proj.weight": (kv, hidden), "self_attn.k_proj.bias": (kv,),
                 "self_attn.v_proj.weight": (kv, hidden), "self_attn.v_proj.bias": (kv,),
                 "self_attn.o_proj.weight": (hidden, q), "mlp.gate_proj.weight": (inter, hidden),
                 "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter)}
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in block.items()})
    plan = []
    for name, tensor in tensors.items():
        hf_name = _hf_tensor_name(name)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest-varying dim first
        if hf_name not in shapes:
            raise CheckpointError(f"{path}: unexpected tensor {name} for a qwen2 model")
        if shape != shapes[hf_name]:
            raise CheckpointError(f"{path}: tensor {name} has shape {shape}, expected {shapes[hf_name]}")
        plan.append((hf_name, tensor, shape))
    missing = sorted(shapes.keys() - {hf_name for hf_name, _, _ in plan})
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} weights are missing, e.g. {missing[0]}")
    return config, plan


def _hf_tensor_name(name: str) -> str | None:
    module, _, kind = name.rpartition(".")
    if module in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[module]}.{kind}"
    block = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if block and block.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{block.group(1)}.{_BLOCK_TENSORS[block.group(2)]}.{kind}"
    return None


def _write_safetensors(plan, dest: Path, path: Path, progress: bool) -> None:
    """Write a bf16 safetensors file by hand: the header only needs shapes, so tensors can stream."""
    import numpy as np
    import torch
    from gguf import dequantize
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for hf_name, _, shape in plan:
        nbytes = 2 * int(np.prod(shape))
        header[hf_name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # like safetensors itself: keep the tensor data 8-byte aligned
    with open(dest, "wb") as out, bar(progress, f"converting {path.name}", len(plan)) as advance:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for hf_name, tensor, shape in plan:
            try:
                values = np.require(dequantize(tensor.data, tensor.tensor_type), np.float32, ["C", "W"])
                weight = torch.from_numpy(values).reshape(shape).to(torch.bfloat16)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot dequantize {tensor.name} (corrupt?): {e}") from None
            if not torch.isfinite(weight).all():
                raise CheckpointError(f"{path}: tensor {tensor.name} holds NaN/inf values: the GGUF is corrupt")
            out.write(weight.view(torch.int16).numpy().tobytes())
            advance()


def _write_tokenizer(path: Path, reader, config, out: Path, progress: bool) -> None:
    from tokenizers import normalizers
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with spinner(progress, f"building the tokenizer of {path.name}"):
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if _meta(reader, "tokenizer.ggml.pre", path, None) == "qwen2":
        # upstream Qwen2 tokenizer.json normalizes to NFC; transformers' GGUF converter drops that step
        tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    # transformers 5 saves the template as chat_template.jinja; keep a copy in tokenizer_config.json
    # for readers that only look there (transformers 4, other tools)
    config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    for key in ("is_local", "local_files_only"):  # describe this load, not the model
        tokenizer_config.pop(key, None)
    template = _meta(reader, "tokenizer.chat_template", path, None)
    if template:
        tokenizer_config["chat_template"] = template
    config_file.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def _replace_dir(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():  # --force or a stale folder: move it aside first, a directory rename can't overwrite
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.chmod(tmp, 0o755)  # mkdtemp made it private to us; a model folder is not a secret
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
