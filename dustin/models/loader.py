"""Load a local Hugging Face folder (config.json + safetensors, sharded or not) into our `Transformer`,
or build one with random weights of a named shape (benchmarks)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from dustin.attention.backend import AttentionBackend
from dustin.errors import CheckpointError, OutOfMemoryError
from dustin.models.args import ModelArgs, with_rope_scaling
from dustin.models.rope import RotaryEmbedding
from dustin.models.transformer import Transformer


def read_args(folder: Path, rope_scaling: str | None = None) -> ModelArgs:
    """The model's shape from its config.json; `rope_scaling` ("yarn:4"): see `with_rope_scaling`."""
    cfg_path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e})") from None
    return with_rope_scaling(ModelArgs.from_hf_config(cfg), rope_scaling)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt ({e})") from None
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors weights (only safetensors checkpoints are read)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder} is missing weight shards: {', '.join(missing)}")
    return files


def _our_name(hf_name: str) -> str:
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               backend: AttentionBackend | None = None, shard=None, *, fuse: bool = True,
               rope_scaling: str | None = None) -> Transformer:
    """`shard(model)`, if given, reshapes the model on the meta device (tensor parallelism, see
    dustin/parallel/tp.py); each tensor is then read from the safetensors files as only this rank's slice, so
    no process ever holds the whole checkpoint. fuse: concatenate the q/k/v and
    gate/up projections once loaded (and sharded), `Transformer.fuse_projections`; False keeps the checkpoint's
    separate modules (A/B, kernel counts)."""
    folder = Path(folder)
    args = read_args(folder, rope_scaling)
    with torch.device("meta"):
        model = Transformer(args, backend)
        full = {n: t.shape for n, t in model.state_dict().items()}
        if shard is not None:
            model = shard(model)
    expected = dict(model.state_dict())
    wrapped = {n.replace(".inner.", "."): n for n in expected if ".inner." in n}  # row-parallel wrappers
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(folder):
        try:
            for name, sl in _checkpoint_slices(f):
                ours = _our_name(name)
                ours = wrapped.get(ours, ours)
                if ours not in expected:
                    continue  # e.g. rotary inv_freq saved by old exports
                want = full.get(ours.replace(".inner.", "."), expected[ours].shape)
                if tuple(sl.get_shape()) != tuple(want):
                    raise CheckpointError(f"{f.name}: tensor {name} has shape {tuple(sl.get_shape())}, "
                                          f"config.json implies {tuple(want)}")
                state[ours] = _to_device(_read_shard(sl, want, expected[ours].shape, shard), device, dtype)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt files
            if isinstance(e, torch.OutOfMemoryError):
                raise OutOfMemoryError(f"the weights of {folder} do not fit on {device}") from None
            raise CheckpointError(f"cannot read {f}: {e}") from None
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{folder} is missing {len(missing)} tensors, e.g. {', '.join(missing[:3])}")
    model.load_state_dict(state, strict=False, assign=True)
    del state  # the model alone holds the weights now, so fusing frees each separate projection as it goes
    return _finish(model, args, device, fuse)


_REMAP_ELEMENTS = 128 << 20  # map a checkpoint file anew after reading this many elements (256 MB of bf16)


def _checkpoint_slices(f: Path):
    """(name, slice) for each tensor of one safetensors file, mapping the file anew every `_REMAP_ELEMENTS`: the
    pages read through a mapping count in this process's RSS until it is unmapped, so one mapping for the whole
    file kept it all resident beside the loaded copy (the fp32 default pair on a CPU peaked at 10.9 GB RSS that
    way, 9.8 GB remapped; a mapping per tensor cost 5 ms each, 3 s per load)."""
    with safe_open(str(f), framework="pt", device="cpu") as sf:
        names = list(sf.keys())
    i = 0
    while i < len(names):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            read = 0
            while i < len(names) and read < _REMAP_ELEMENTS:
                sl = sf.get_slice(names[i])
                yield names[i], sl
                read += math.prod(sl.get_shape())
                i += 1


def _read_shard(sl, full_shape, local_shape, shard) -> torch.Tensor:
    """The whole tensor, or, when tensor parallelism made it smaller along one dimension, this rank's
    contiguous chunk of that dimension (the layout `shard_transformer` gives every sharded tensor)."""
    if tuple(full_shape) == tuple(local_shape):
        return sl[:]
    dim = next(i for i, (a, b) in enumerate(zip(full_shape, local_shape, strict=True)) if a != b)
    rank = getattr(shard, "rank", 0)
    n = local_shape[dim]
    index = tuple(slice(None) for _ in range(dim)) + (slice(rank * n, (rank + 1) * n),)
    return sl[index]


def _to_device(t: torch.Tensor, device, dtype) -> torch.Tensor:
    try:
        return t.to(device=device, dtype=dtype)
    except torch.OutOfMemoryError:
        raise OutOfMemoryError(f"model weights do not fit on {device}") from None


def _finish(model: Transformer, args: ModelArgs, device, fuse: bool) -> Transformer:
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(args).to(device)  # buffers built on meta must be recomputed
    model = model.eval().requires_grad_(False)
    if fuse:  # after sharding: the fused projections hold the rank's slices, split by the per-rank args
        model.fuse_projections()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the separate weights' blocks: return them, so mem_get_info sees them free
    return model


def random_model(args: ModelArgs, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, backend: AttentionBackend | None = None, shard=None, *,
                 fuse: bool = True) -> Transformer:
    """Random weights of a real shape, for benchmarks: timing does not depend on the values. `shard(model)`, if
    given, reshapes the model while it is still on the meta device (tensor parallelism: each rank materializes
    only its own shard, so a 72B target never exists whole on one GPU). fuse: see `load_model` (the values are
    drawn before fusing, so they do not depend on it)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    try:
        with torch.device("meta"):
            model = Transformer(args, backend)
            if shard is not None:
                model = shard(model)
        model = model.to(dtype).to_empty(device=device)  # cast on meta: never a full fp32 copy
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.data.fill_(1.0)
            else:  # std 0.02 like HF init, drawn on the device (fast for 70B-class shapes)
                p.data.normal_(0.0, 0.02, generator=gen)
        return _finish(model, args, device, fuse)  # inside: fusing copies one layer's projections at a time
    except torch.OutOfMemoryError as e:
        size = f"{args.num_params() / 1e9:.1f}B-parameter"
        raise OutOfMemoryError(f"a random {size} model does not fit on {device}") from e
