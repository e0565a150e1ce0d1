"""Shared fixtures: tiny random checkpoints written by transformers itself, so our loader and model are
checked against the reference implementation of the same files."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU interpreter in tests

import pytest
import torch

from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft, with_char_tokenizer


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", rope="llama3")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A target and a smaller draft sharing a tokenizer (draft = the target plus weight noise)."""
    root = tmp_path_factory.mktemp("pair")
    target = make_tiny_checkpoint(root / "target", "qwen2", layers=3, seed=1)
    draft = make_tiny_draft(target, root / "draft", noise=0.1)
    return target, draft


@pytest.fixture(scope="session")
def text_pair(tiny_pair, tmp_path_factory):
    """The tiny pair with a character-level tokenizer: real code and prose become real token ids (the commands
    that build prompts from text, `bench e2e --real`, `demo`, `eval fidelity`, run on it on the CPU)."""
    return with_char_tokenizer(tiny_pair, tmp_path_factory.mktemp("text_pair"))


@pytest.fixture(scope="session")
def tok():
    """The default pair's (target) tokenizer; tests that need it skip when the pair is not fetched."""
    from transformers import AutoTokenizer

    from dustin.errors import CheckpointError
    from dustin.models.fetch import resolve_model_path
    try:
        return AutoTokenizer.from_pretrained(str(resolve_model_path("default", "target")))
    except CheckpointError as e:
        pytest.skip(f"default pair not fetched: {e}")


def real_pair_or_skip():
    """(target, draft) folders of the fetched default pair; the calling test skips when it is not fetched."""
    from dustin.errors import CheckpointError
    from dustin.models.fetch import resolve_model_path

    try:
        return resolve_model_path("default", "target"), resolve_model_path("default", "draft")
    except CheckpointError as e:
        pytest.skip(f"default pair not fetched: {e}")


# Tiny models: one thread avoids OpenMP hand-off costs that dominate small matmuls on a 2-core machine
# (measured: a 144x64 matmul 15 ms with 2 threads under load vs 20 us with 1). The real-pair tests raise it.
torch.set_num_threads(1)

# `--dtype auto` on a CPU follows the CPU's bf16 support (dustin/runtime.py); the suite pins it to fp32, the
# AVX2-only answer, so that what a test computes does not depend on the machine CI lands on
os.environ["DUSTIN_CPU_BF16"] = "0"


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
