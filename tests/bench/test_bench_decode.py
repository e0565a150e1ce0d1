"""`dustin bench decode`. It times CUDA-graph replays with CUDA events and refuses to run without a GPU, so on
the CPU this file checks the refusal, and runs the rest of the command (random model of a named shape, KV cache,
eager forwards, the byte count against the bandwidth limit, the skip rule, the table and the JSON) with the
CUDA-only calls swapped for CPU ones and a fixed step time: the numbers it reports are then known by hand."""
from __future__ import annotations

import json
import types

import pytest
import torch

from dustin.cli.main import main
from dustin.models.args import NAMED_CONFIGS, ModelArgs

STEP_S, BW = 1e-6, 1e9  # the step time `_time` reports, the copy bandwidth (bytes/s): the fraction pins the bytes
TINY = ModelArgs(vocab_size=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, intermediate_size=144,
                 max_position_embeddings=4096, qkv_bias=True, family="qwen2")


def test_bench_decode_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "decode", "--models", "llama-3.1-8b"]) == 2
    err = capsys.readouterr().err
    assert err == "dustin: error: dustin bench decode needs a CUDA GPU\n"


@pytest.fixture
def on_cpu(monkeypatch):
    """bench decode's CUDA calls answered on the CPU: tensors made "on cuda" are made on the CPU, free memory is
    2 GiB + 100 KiB (the skip rule keeps 2 GiB free), every step takes STEP_S; the model is the tiny named shape
    "tiny-bench" in bf16 on SDPA."""
    from dustin.bench import decode
    from dustin.cache import kv_cache
    from dustin.models import loader

    def cpu(fn):
        def call(*a, **k):
            a = tuple("cpu" if x == "cuda" else x for x in a)
            return fn(*a, **{n: "cpu" if v == "cuda" else v for n, v in k.items()})
        return call

    fake_cuda = types.SimpleNamespace(mem_get_info=lambda *a: ((2 << 30) + 100 * 1024, 80 << 30),
                                      empty_cache=lambda: None, is_available=lambda: True,
                                      get_device_name=lambda *a: "Fake GPU")
    class Shim(types.SimpleNamespace):  # torch, but for the calls above
        def __getattr__(self, name):
            return getattr(torch, name)

    shim = Shim(full=cpu(torch.full), randint=cpu(torch.randint), arange=cpu(torch.arange), cuda=fake_cuda)
    monkeypatch.setattr(decode, "torch", shim)
    monkeypatch.setattr(decode, "random_model", cpu(loader.random_model))
    monkeypatch.setattr(decode, "KVCache", cpu(kv_cache.KVCache))
    monkeypatch.setitem(NAMED_CONFIGS, "tiny-bench", TINY)
    calls = []

    def timed(fn, iters):
        calls.append(fn())  # one real forward on the CPU: the step the GPU would replay
        return STEP_S

    monkeypatch.setattr(decode, "_time", timed)
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: BW)
    return calls


def test_bench_decode_rows_by_hand(on_cpu, tmp_path, capsys):
    """Guards the bytes a step is held to (every weight once, the embedding table only when it is the tied LM
    head, plus the K/V of every cached position and the new ones), the fraction of the limit and TB/s derived
    from them, the skip rule for caches that do not fit, and the table and JSON the command prints."""
    out = tmp_path / "decode.json"
    code = main(["bench", "decode", "--models", "tiny-bench", "--contexts", "64,1024", "--batches", "2,8",
                 "--gamma", "3", "--attention", "sdpa", "--no-graphs", "--iters", "2", "--json-out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    # weights by hand: q/k/v with bias, o, gate/up/down, two norms per layer; the final norm and the untied LM head
    per_layer = 64 * 64 + 64 + 2 * (64 * 16 + 16) + 64 * 64 + 3 * 64 * 144 + 2 * 64
    weight_bytes = 2 * (2 * per_layer + 64 + 96 * 64)  # bf16
    kv_per_token = 2 * 2 * 2 * 8 * 2  # K and V, 2 layers, 2 KV heads, head_dim 8, bf16
    data = json.loads(out.read_text())
    assert data["device"] == "Fake GPU" and data["copy_bandwidth_Bps"] == BW and data["gamma"] == 3
    rows = {(r["batch"], r["context"]): r for r in data["results"]}
    assert list(rows) == [(2, 64), (2, 1024), (8, 64), (8, 1024)]
    # 2 x 1024 positions x 128 B = 256 KiB of KV (+10%) does not fit in the 100 KiB above the 2 GiB kept free;
    # 8 x 64 (64 KiB) does
    for key in ((2, 1024), (8, 1024)):
        assert rows[key] == {"model": "tiny-bench", "batch": key[0], "context": key[1],
                             "skipped": "does not fit in memory"}
    for (B, ctx) in ((2, 64), (8, 64)):
        r = rows[(B, ctx)]
        assert r["attention"] == "sdpa" and r["cuda_graphs"] is False
        for label, T in (("decode", 1), ("verify", 4)):
            read = weight_bytes + B * (ctx - 4 + T) * kv_per_token  # lengths = ctx - Γ - 1, plus the T new rows
            assert r[f"{label}_ms"] == round(STEP_S * 1e3, 3)
            assert r[f"{label}_fraction_of_limit"] == round(read / STEP_S / BW, 3)
            assert r[f"{label}_TBps"] == round(read / STEP_S / 1e12, 3)
    assert len(on_cpu) == 4 and all(x.shape[-1] == 96 for x in on_cpu)  # decode + verify of the two that fit
    assert on_cpu[1].shape[:2] == (2, 4) and on_cpu[2].shape[:2] == (8, 1)  # verify Γ + 1 = 4 rows, decode 1
    r = rows[(2, 64)]
    assert (f"| tiny-bench | 2 | 64 | 0.00 | {100 * r['decode_fraction_of_limit']:.0f}% | 0.00 | "
            f"{100 * r['verify_fraction_of_limit']:.0f}% |") in printed.out
    assert "| tiny-bench | 8 | 1024 | skipped: does not fit in memory | | | |" in printed.out
    assert printed.out.startswith("# Fake GPU | torch ")


def test_bench_decode_writes_nothing_it_was_not_told_to(on_cpu, tmp_path, monkeypatch, capsys):
    """Results files come from --json-out only: an `OUT` variable in the environment (the device machine sets one)
    does not make the benchmark write there, nor does the working folder get a file."""
    out_dir, cwd = tmp_path / "out", tmp_path / "cwd"
    out_dir.mkdir(), cwd.mkdir()
    monkeypatch.setenv("OUT", str(out_dir))
    monkeypatch.chdir(cwd)
    code = main(["bench", "decode", "--models", "tiny-bench", "--contexts", "64", "--batches", "2", "--gamma", "3",
                 "--attention", "sdpa", "--no-graphs", "--iters", "2"])
    assert code == 0, capsys.readouterr().err
    assert "| tiny-bench | 2 | 64 |" in capsys.readouterr().out
    assert list(out_dir.iterdir()) == [] and list(cwd.iterdir()) == []


def test_read_kernel_sums_what_it_reads():
    """`read_all` (the read-only kernel behind `read_bandwidth`) against its reference, at a size that leaves the
    last program a partial block (Triton's CPU interpreter)."""
    from dustin.bench.decode import read_all, read_bandwidth

    x = torch.randn(3 * 4096 * 2 + 77, dtype=torch.bfloat16)
    assert torch.allclose(read_all(x, block=4096, iters=2), x.float().sum(), rtol=1e-4, atol=1e-2)
    assert read_bandwidth("cpu", nbytes=1 << 20) > 0
