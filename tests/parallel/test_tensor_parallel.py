"""Tensor-parallel target (dustin/parallel/tp.py) on CPU with gloo: 2 and 4 spawned ranks must produce exactly the
single-process tokens (greedy, fp32) for vanilla, classic, magicdec and dustin (with and without a sampled tail),
and agree with each other."""
from __future__ import annotations

import faulthandler
import os
import pickle
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dustin.engine.config import ExecutionOptions, GenerationConfig
from dustin.engine.engine import Engine
from dustin.errors import InputError
from dustin.models.loader import load_model
from dustin.parallel.tp import TensorParallel, finish_distributed, shard_transformer
from tests.offline import offline
from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

WORKER_TIMEOUT_S = 120
PROMPT_LENGTHS = [45, 30, 52]  # ragged, and longer than the dustin budget below so selection really drops positions
RUNS = {  # name -> GenerationConfig kwargs
    "vanilla": {"method": "vanilla"},
    "classic": {"method": "classic", "gamma": 3},
    "magicdec": {"method": "magicdec", "gamma": 3, "draft_window": 12},
    "dustin": {"method": "dustin", "gamma": 3, "draft_window": 12, "budget": 26},
    "dustin-t": {"method": "dustin-t", "gamma": 3, "draft_window": 12, "budget": 24},
    # a sampled tail: each rank draws its own KV heads' positions from rank 0's exact set, the single process's
    "dustin-tail": {"method": "dustin", "gamma": 3, "draft_window": 12, "budget": 44, "tail_share": 0.5},
    "sampled": {"method": "classic", "gamma": 3, "temperature": 0.8, "seed": 5},
    # acceptance-controlled benchmark mode: the random accept decisions must be identical on every rank
    "controlled": {"method": "dustin", "gamma": 3, "draft_window": 12, "budget": 26,
                   "options": ExecutionOptions(accept_prob=0.6)},
}


def _cfg(kw):
    return offline(max_new_tokens=12, stop_at_eos=False, **kw)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _generate_all(engine) -> dict[str, list[list[int]]]:
    prompts = _prompts()
    return {name: [s.token_ids for s in engine.generate(prompts, *_cfg(kw)).sequences] for name, kw in RUNS.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, target, draft, out_dir) -> None:
    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True)  # a hung collective fails the test, not the suite
    torch.set_num_threads(1)
    os.environ.pop("TRITON_INTERPRET", None)  # the engine's CPU path is pure PyTorch; the interpreter is only slower
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from dustin.parallel.tp import init_distributed

    assert init_distributed("gloo") == (rank, world)
    try:
        # sharded loading (each rank reads only its slices), as Engine.from_pretrained does under torchrun
        parallel = TensorParallel(rank, world)
        engine = Engine.from_models(load_model(target, shard=parallel), load_model(draft), parallel=parallel)
        a = engine.pair.target.args
        assert (a.n_heads, a.n_kv_heads) == (8 // world, 4 // world)
        fused_rows = engine.pair.target.layers[0].self_attn.qkv_proj.weight.shape[0]  # [q | k | v] of the rank's heads
        assert fused_rows == (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
        outputs = _generate_all(engine)
        s = engine.start(_prompts(), *_cfg(RUNS["classic"])).runner.batch  # the cache holds only this rank's KV heads
        assert s.target_cache.k.shape[2] == 4 // world
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(outputs, f)
        finish_distributed(exit_process=True)
    finally:
        if dist.is_initialized():  # error path: leave without a barrier
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_pair")
    target = make_tiny_checkpoint(root / "target", "qwen2", layers=2, heads=8, kv_heads=4, seed=3)
    draft = make_tiny_draft(target, root / "draft", noise=0.1)
    return target, draft


@pytest.fixture(scope="module")
def reference(tp_pair):
    target, draft = tp_pair
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread avoids OpenMP spin contention on a shared 2-core machine
    try:
        with pytest.MonkeyPatch.context() as mp_env:
            mp_env.delenv("TRITON_INTERPRET", raising=False)  # same selection path as the workers
            return _generate_all(Engine.from_models(load_model(target), load_model(draft)))
    finally:
        torch.set_num_threads(threads)


def test_reference_is_meaningful(reference):
    """Speculation must agree with vanilla, and the outputs must vary, for the TP comparison to mean something."""
    for name in ("classic", "magicdec"):
        assert reference[name] == reference["vanilla"]
    assert len({tuple(t) for t in reference["vanilla"]}) == len(PROMPT_LENGTHS)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_process(tp_pair, reference, tmp_path, world):
    target, draft = tp_pair
    mp.spawn(_worker, args=(world, _free_port(), str(target), str(draft), str(tmp_path)), nprocs=world, join=True)
    per_rank = []
    for r in range(world):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            per_rank.append(pickle.load(f))
    for r in range(1, world):
        assert per_rank[r] == per_rank[0], f"rank {r} disagrees with rank 0"
    for name in RUNS:
        if name == "sampled":
            continue  # sampling: only rank agreement is required (checked above)
        assert per_rank[0][name] == reference[name], name


def test_shard_rejects_indivisible_kv_heads(tp_pair):
    model = load_model(tp_pair[0])
    with pytest.raises(InputError, match="KV head count"):
        shard_transformer(model, 0, 3)


def test_parallel_object_is_handed_in_not_patched(tp_pair):
    """Without torchrun there is no TensorParallel; with one, the engine keeps the full shape for sparse configs
    and asks the object for the TP form of a policy (unsupported ones are one InputError); nothing is patched."""
    from dustin.parallel.tp import current_parallel
    from dustin.parallel.tp_selection import TPDustinSelection

    assert current_parallel() is None
    plain = Engine.from_models(load_model(tp_pair[0]), load_model(tp_pair[1]))
    assert plain.pair.parallel is None and plain.pair.target_args is plain.pair.target.args
    parallel = TensorParallel(0, 2)
    engine = Engine.from_models(load_model(tp_pair[0], shard=parallel), load_model(tp_pair[1]), parallel=parallel)
    assert engine.pair.target.args.n_heads == 4 and engine.pair.target_args.n_heads == 8
    assert "make_policy" not in vars(engine.pair) and not any(k.startswith("tp_") for k in vars(engine.pair.target))
    policy = engine.pair.make_policy(GenerationConfig(method="dustin", budget=32))
    assert isinstance(policy, TPDustinSelection) and policy.rank == 0
    assert engine.pair.identities()[0]["n_heads"] == 8  # the fingerprint names the unsharded shape
    with pytest.raises(InputError, match="not supported with tensor parallelism"):
        engine.pair.make_policy(GenerationConfig(method="quest", budget=32))


def _bench_worker(rank: int, world: int, port: int, target, draft, out_json) -> None:
    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True)
    torch.set_num_threads(1)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from dustin.cli.main import main

    try:  # what `torchrun --nproc-per-node 2 -m dustin bench e2e ...` runs on each rank
        assert main(["bench", "e2e", "--device", "cpu", "--pairs", f"{target}:{draft}", "--contexts", "60,75",
                     "--batches", "2", "--steps", "4", "--warmup", "1", "--budget", "26", "--draft-window", "12",
                     "--gamma", "3", "--tau", "2.0", "--json-out", out_json]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_bench_e2e_under_tensor_parallelism(tp_pair, tmp_path):
    """The end-to-end benchmark runs tensor-parallel (random sharded target, replicated draft, acceptance control)
    and rank 0 alone writes one row per (context, method)."""
    target, draft = tp_pair
    out = tmp_path / "e2e.json"
    mp.spawn(_bench_worker, args=(2, _free_port(), str(target), str(draft), str(out)), nprocs=2, join=True)
    import json

    data = json.loads(out.read_text())
    assert data["label"] == "acceptance-controlled"
    rows = data["results"]
    assert [(r["context"], r["method"]) for r in rows] == [
        (c, m) for c in (60, 75) for m in ("vanilla", "classic", "magicdec", "dustin")]
    for r in rows:
        assert r["tp"] == 2 and r["steps"] == 4 and r["tokens_per_s"] > 0
        if r["method"] == "vanilla":
            assert r["tau"] == 1.0 and r["accept_prob"] is None
        else:  # p solved for tau 2.0 at gamma 3; the same random accept draws for every speculative method
            assert 0.4 < r["accept_prob"] < 0.6 and 1.0 <= r["tau"] <= 4.0
    taus = {r["tau"] for r in rows if r["method"] != "vanilla" and r["context"] == 60}
    assert len(taus) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_loading_reads_exactly_the_rank_slices(tp_pair, world):
    """load_model(shard=...) reads each rank's slices from safetensors; they equal slicing the full model."""
    for rank in range(world):
        direct = load_model(tp_pair[0], shard=TensorParallel(rank, world)).state_dict()
        sliced = shard_transformer(load_model(tp_pair[0]), rank, world).state_dict()
        assert direct.keys() == sliced.keys()
        for name, t in sliced.items():
            assert torch.equal(direct[name], t), name
        assert direct["layers.0.self_attn.o_proj.inner.weight"].shape[1] == 64 // world
