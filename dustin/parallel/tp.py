"""Tensor parallelism of the target model (Megatron / gpt-fast `tp.py` style), launched with torchrun.

    torchrun --nproc-per-node 2 -m dustin generate --method classic --device cuda ...

Layout on `world` ranks, applied in place to a loaded `Transformer` by `shard_transformer`:
- attention: q/k/v_proj are column-parallel by heads. Rank r keeps the contiguous query heads
  [r * H/world, (r+1) * H/world) and KV heads [r * Hkv/world, (r+1) * Hkv/world) (with their bias rows). Since
  H/world = group * Hkv/world, every local query head's KV head is local too, so attention needs no communication.
  o_proj is row-parallel (the input columns of the rank's heads) and its output is all_reduced (`RowParallelLinear`).
- MLP: gate/up_proj column-parallel over the intermediate size, down_proj row-parallel + all_reduce.
- fused projections (`Transformer.fuse_projections`): a qkv_proj / gate_up_proj keeps the rank's rows of each of
  its parts, which equals fusing the rank's sharded parts. Loading shards the separate modules and fuses last.
- embed_tokens, norms and lm_head are replicated: the simplest correct choice (no vocabulary gather); every rank
  computes identical logits from the identical all_reduced hidden state, so greedy choices agree on all ranks and
  sampling agrees too because each rank's runner seeds its generator from cfg.seed.
- `model.args` (and every Attention's `args`) becomes the per-rank shape (n_heads, n_kv_heads, intermediate_size
  divided by world), so the unchanged Attention reshapes work and the runner's `KVCache(target.args...)` holds only
  the rank's KV heads. The full shape is kept by the `TensorParallel` object that sharded the model.
The draft is replicated: every rank runs the same draft forward (deterministic, no communication).

`TensorParallel` is the one object that carries all of this: it shards the target at load time and is handed to
`ModelPair(..., parallel=...)`, which asks it for the model's full shape (sparse configs name global heads) and for
the TP form of a selection policy (tp_selection.py). Nothing is patched into the engine or the model.

Loading: `load_model(..., shard=TensorParallel(rank, world))` shards the model on the meta device and reads only
the rank's slice of each tensor from the safetensors files (`safe_open(...).get_slice`), so no rank ever holds
the whole checkpoint; `random_model(..., shard=...)` does the same for benchmark weights.
"""
from __future__ import annotations

import atexit
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from dustin.errors import InputError
from dustin.parallel.tp_selection import tp_policy

_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _set_no_multicast_env() -> None:
    for k, v in _NO_MULTICAST.items():
        os.environ.setdefault(k, v)


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the torchrun process group; (rank, world), or (0, 1) when not launched distributed.

    nccl when CUDA is available (and the rank's GPU becomes the current device, so `--device cuda` loads on
    LOCAL_RANK's GPU), gloo otherwise. Idempotent. NVLink multicast (NVLS) is switched off before init."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not dist.is_available():
        return 0, 1
    _set_no_multicast_env()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, rank=rank, world_size=world)
    atexit.register(_shutdown)
    return rank, world


def _shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish_distributed(exit_process: bool = False) -> None:
    """Leave the process group after a successful run: barrier first, so that no rank tears down its gloo/NCCL
    connections while a peer still completes the last collective (gloo then aborts the process with
    "terminate called without an active exception"). Only on success: after an error on one rank a barrier would
    wait for peers that never arrive, so the atexit handler destroys without one.
    exit_process: then end the process at once (exit code 0, stdio flushed). Even after a clean destroy, the
    interpreter's shutdown aborted a gloo rank the same way in about 1 run of 6 (2026-11-30, CPU, 2 ranks), so a
    finished distributed run leaves without it."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        if exit_process:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def tp_rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_device(device: torch.device | str) -> torch.device:
    """Under a distributed CUDA run, every rank uses its own GPU (LOCAL_RANK's, made current by init_distributed),
    whatever index --device named; otherwise `device` unchanged."""
    device = torch.device(device)
    if device.type == "cuda" and tp_rank_world()[1] > 1:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def broadcast_object(obj=None, src: int = 0, group=None, device: torch.device | str | None = None):
    """`obj` (any picklable object) from rank `src` to every rank of `group` (None: the default group): rank
    `src` passes it, the others pass None; every rank returns it. The pickled bytes travel as a tensor on `device`
    (None: the backend's choice; for NCCL the calling thread's current CUDA device, which is set per thread)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=None if device is None else torch.device(device))
    return box[0]


def is_main_process() -> bool:
    """True on rank 0 or when not distributed: only this process prints results."""
    return tp_rank_world()[0] == 0


class RowParallelLinear(nn.Module):
    """A row-parallel linear layer: the wrapped `Linear` holds this rank's input columns; the partial outputs are
    summed over ranks with one all_reduce (a bias, if any, is added once, after the reduce)."""

    def __init__(self, inner: nn.Linear, group=None) -> None:
        super().__init__()
        self.bias = None
        if inner.bias is not None:
            self.bias = inner.bias
            inner.bias = None
        self.inner, self.group = inner, group

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out if self.bias is None else out + self.bias


def _rows(t: torch.Tensor, ranges) -> torch.Tensor:
    if t.is_meta:  # only the shape (torch.cat of meta tensors imports torch._dynamo: ~2 s of every rank's start)
        return t.new_empty((sum(size for _, size in ranges), *t.shape[1:]))
    # cat copies (even one range): free the full tensor, keep a contiguous shard
    return torch.cat([t.narrow(0, start, size) for start, size in ranges])


def _shard_out(linear: nn.Linear, *ranges: tuple[int, int]) -> None:
    """Column-parallel: keep output features [start, start + size) of each (start, size) range, in order (weight
    rows, bias entries). Several ranges: a fused projection (qkv_proj, gate_up_proj) keeps the rank's slice of
    each of its parts, i.e. exactly what fusing the rank's sharded parts gives."""
    linear.weight = nn.Parameter(_rows(linear.weight.data, ranges), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rows(linear.bias.data, ranges), requires_grad=False)
    linear.out_features = sum(size for _, size in ranges)


def _shard_in(linear: nn.Linear, start: int, size: int) -> None:
    """Row-parallel: keep input features [start, start + size) (weight columns)."""
    w = linear.weight.data.narrow(1, start, size).clone()
    linear.weight = nn.Parameter(w, requires_grad=False)
    linear.in_features = size


def check_shardable(args, world: int) -> None:
    if args.n_kv_heads % world:
        raise InputError(f"tensor parallelism over {world} ranks needs the KV head count ({args.n_kv_heads}) to be "
                         f"a multiple of the world size: run with --nproc-per-node dividing {args.n_kv_heads}")
    if args.intermediate_size % world:
        raise InputError(f"tensor parallelism over {world} ranks needs intermediate_size ({args.intermediate_size}) "
                         f"to be a multiple of the world size")


def shard_transformer(model, rank: int, world: int, group=None):
    """Shard a loaded `Transformer` in place for rank `rank` of `world` (see the module docstring)."""
    if world == 1:
        return model
    full = model.args
    check_shardable(full, world)
    hd = full.head_dim
    hq, hkv, inter = full.n_heads // world, full.n_kv_heads // world, full.intermediate_size // world
    local = replace(full, n_heads=hq, n_kv_heads=hkv, head_dim=hd, intermediate_size=inter)
    q, kv = (rank * hq * hd, hq * hd), (rank * hkv * hd, hkv * hd)  # (start, size) of the rank's rows
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        if att.qkv_proj is None:
            _shard_out(att.q_proj, q)
            _shard_out(att.k_proj, kv)
            _shard_out(att.v_proj, kv)
        else:  # fused [q | k | v] rows of the full model (Transformer.fuse_projections)
            k0, v0 = full.n_heads * hd, (full.n_heads + full.n_kv_heads) * hd
            _shard_out(att.qkv_proj, q, (k0 + kv[0], kv[1]), (v0 + kv[0], kv[1]))
        _shard_in(att.o_proj, rank * hq * hd, hq * hd)
        att.o_proj = RowParallelLinear(att.o_proj, group)
        att.args = local
        if mlp.gate_up_proj is None:
            _shard_out(mlp.gate_proj, (rank * inter, inter))
            _shard_out(mlp.up_proj, (rank * inter, inter))
        else:  # fused [gate | up] rows
            _shard_out(mlp.gate_up_proj, (rank * inter, inter), (full.intermediate_size + rank * inter, inter))
        _shard_in(mlp.down_proj, rank * inter, inter)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
    model.args = local
    return model


class TensorParallel:
    """Rank `rank` of `world` (process group `group`, None: the default one). `shard(model)` (also its call, the
    `shard=` hook of load_model / random_model) shards a target, on the meta device or loaded, and remembers its
    full shape; `make_policy` builds the TP form of a selection policy for `ModelPair.make_policy`."""

    def __init__(self, rank: int, world: int, group=None) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.full_args = None  # the unsharded ModelArgs of the target this object sharded

    def shard(self, model):
        self.full_args = model.args
        return shard_transformer(model, self.rank, self.world, self.group)

    __call__ = shard

    def make_policy(self, name: str, cfg):
        """The selection policy `name` with sparse config `cfg` (global heads) for this rank."""
        return tp_policy(name, cfg, self.rank, self.group)


def current_parallel() -> TensorParallel | None:
    """This process's TensorParallel under torchrun (None when not distributed)."""
    rank, world = tp_rank_world()
    return TensorParallel(rank, world) if world > 1 else None
