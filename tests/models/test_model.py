"""Our model runtime against transformers' implementation of the same checkpoint files."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.errors import CheckpointError
from dustin.models.args import NAMED_CONFIGS, ModelArgs
from dustin.models.loader import load_model, random_model
from tests.tiny_models import hf_model, make_tiny_checkpoint


def _prefill_logits(model, tokens):
    a = model.args
    B, T = tokens.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, T + 8, torch.float32, "cpu")
    ctx = ForwardContext(cache, torch.arange(T)[None].expand(B, T), torch.zeros(B, dtype=torch.int32), T,
                         fresh=True)
    return model(tokens, ctx), cache


@pytest.mark.parametrize("family,rope,tie", [("qwen2", "default", True), ("llama", "llama3", False),
                                             ("qwen2", "yarn", False), ("llama", "default", True)])
def test_prefill_logits_match_transformers(tmp_path, family, rope, tie):
    folder = make_tiny_checkpoint(tmp_path, family, rope=rope, tie=tie)
    tokens = torch.randint(0, 96, (1, 600))  # longer than the llama3/yarn original context: scaling matters
    with torch.no_grad():
        ref = hf_model(folder)(tokens).logits
        ours, _ = _prefill_logits(load_model(folder), tokens)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_rope_scaling_is_applied(tmp_path):
    """Guard against a silently ignored rope_scaling: dropping it must change the logits."""
    folder = make_tiny_checkpoint(tmp_path, "llama", rope="llama3")
    tokens = torch.randint(0, 96, (1, 600))
    model = load_model(folder)
    plain = ModelArgs.from_hf_config({**json.loads((folder / "config.json").read_text()),
                                      "rope_scaling": None, "rope_parameters": {"rope_theta": 500000.0}})
    from dustin.models.rope import RotaryEmbedding
    with torch.no_grad():
        scaled, _ = _prefill_logits(model, tokens)
        model.rotary = RotaryEmbedding(plain)
        unscaled, _ = _prefill_logits(model, tokens)
    assert (scaled - unscaled).abs().max() > 1e-2


def test_logits_in_the_model_dtype_are_the_fp32_logits_before_the_cast(tiny_qwen2):
    """float_logits=False (a speculative step's forwards) returns the lm_head's bf16 output; the default fp32
    logits are exactly that tensor cast, so an argmax or a later cast sees the same values."""
    model = load_model(tiny_qwen2, dtype=torch.bfloat16)
    a = model.args
    tokens = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        outs = []
        for float_logits in (True, False):
            cache = KVCache(a.n_layers, 2, a.n_kv_heads, a.head_dim, 16, torch.bfloat16, "cpu")
            ctx = ForwardContext(cache, torch.arange(9)[None].expand(2, 9), torch.zeros(2, dtype=torch.int32), 9,
                                 fresh=True)
            outs.append(model(tokens, ctx, float_logits=float_logits))
    assert outs[0].dtype == torch.float32 and outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[1].float(), outs[0])


def test_cached_decode_of_ragged_batch_matches_full_forward(tiny_qwen2):
    """Append 1 and then 3 tokens per sequence to a ragged cache; logits equal a full forward of each."""
    model, ref = load_model(tiny_qwen2), hf_model(tiny_qwen2)
    a = model.args
    seqs = [torch.randint(0, 96, (n,)) for n in (7, 31, 18)]
    cache = KVCache(a.n_layers, 3, a.n_kv_heads, a.head_dim, 64, torch.float32, "cpu")
    with torch.no_grad():
        for b, s in enumerate(seqs):
            n = len(s) - 4
            ctx = ForwardContext(cache, torch.arange(n)[None], torch.zeros(1, dtype=torch.int32), n,
                                 rows=slice(b, b + 1), fresh=True)
            model(s[None, :n], ctx)
        cache.lengths.copy_(torch.tensor([len(s) - 4 for s in seqs], dtype=torch.int32))
        for T in (1, 3):
            L = cache.lengths.clone()
            toks = torch.stack([s[int(L[b]): int(L[b]) + T] for b, s in enumerate(seqs)])
            pos = L.long()[:, None] + torch.arange(T)
            out = model(toks, ForwardContext(cache, pos, L, int(L.max()) + T))
            for b, s in enumerate(seqs):
                full = ref(s[None, : int(L[b]) + T]).logits[0, -T:]
                torch.testing.assert_close(out[b], full, rtol=1e-4, atol=1e-4)
            cache.lengths.add_(T)


def test_named_configs_are_consistent():
    assert NAMED_CONFIGS["llama-3.1-8b"].gqa_group == 4
    assert NAMED_CONFIGS["qwen2.5-7b"].n_kv_heads == 4
    assert 7.0e9 < NAMED_CONFIGS["qwen2.5-7b"].num_params() < 8.0e9
    assert 7.5e9 < NAMED_CONFIGS["llama-3.1-8b"].num_params() < 8.5e9
    model = random_model(NAMED_CONFIGS["qwen2.5-0.5b"].__class__(**{**NAMED_CONFIGS["qwen2.5-0.5b"].__dict__,
                                                                     "n_layers": 1, "vocab_size": 128}),
                         dtype=torch.float32)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied like the real 0.5B


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)


def test_corrupt_weights(tmp_path, tiny_qwen2):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # an interrupted copy
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(bad)


def test_remapping_the_checkpoint_while_reading_loads_the_same_weights(tiny_qwen2, monkeypatch):
    """The loader maps a checkpoint file anew every `_REMAP_ELEMENTS` read (so the pages read stop counting in the
    process's RSS); with a remap after every tensor the model is the one a single mapping reads."""
    from dustin.models import loader

    want = load_model(tiny_qwen2).state_dict()
    monkeypatch.setattr(loader, "_REMAP_ELEMENTS", 1)
    opened = []
    real_open = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    got = load_model(tiny_qwen2).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert len(opened) > 10  # one mapping for the names, then one per tensor


def test_missing_tensor_and_wrong_shape(tmp_path, tiny_qwen2):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2, bad)
    state = load_file(bad / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing 1 tensors"):
        load_model(bad)
    cfg = json.loads((tiny_qwen2 / "config.json").read_text())
    cfg["intermediate_size"] += 1
    shutil.copy(tiny_qwen2 / "model.safetensors", bad / "model.safetensors")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(bad)


def test_unsupported_architecture(tmp_path, tiny_qwen2):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load_model(bad)
