"""Shared fixtures: tiny random checkpoints written by transformers itself, so our loader and model are
checked against the reference implementation of the same files."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU interpreter in tests
# OpenMP threads sleep at a barrier instead of spinning (read when torch loads libgomp, so before `import torch`;
# commands the tests start inherit it). The real pair runs on both cores: with any other process on the machine,
# a spinning thread took the core its partner needed (measured, 2 cores, one other busy process: one bf16
# generate of the real pair 43 s spinning, 9.9 s sleeping; alone 6.4 vs 6.0 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
def tiny_sparse_config(tmp_path_factory):
    """A sparse config for `tiny_pair` (3 target layers of 8 heads, 2 draft layers): k = 48, m = 12."""
    import json

    cfg = {"target": [{"layer": 2, "heads": [1, 6]}], "draft": [{"layer": 0, "heads": [3]}, {"layer": 1, "heads": [0]}],
           "budget": 48, "draft_topm": 12, "sinks": 4, "window": 16}
    path = tmp_path_factory.mktemp("cfg") / "sparse.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="session")
def text_pair(tiny_pair, tmp_path_factory):
    """The tiny pair with a character-level tokenizer: real code and prose become real token ids (the commands
    that build prompts from text, `bench e2e --real`, `demo`, `eval fidelity`, run on it on the CPU)."""
    return with_char_tokenizer(tiny_pair, tmp_path_factory.mktemp("text_pair"))


@pytest.fixture(scope="session")
def tok():
    """The default pair's (target) tokenizer, the shared pair's own; tests that need it skip when the pair is not
    fetched."""
    return _real_tokenizer()


@functools.cache
def _real_tokenizer():
    """One copy of the target's tokenizer for `tok` and the shared pair (each copy holds ~135 MB)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_pair_or_skip()[0]))


def real_pair_or_skip():
    """(target, draft) folders of the fetched default pair; the calling test skips when it is not fetched."""
    from dustin.errors import CheckpointError
    from dustin.models.fetch import resolve_model_path

    try:
        return resolve_model_path("default", "target"), resolve_model_path("default", "draft")
    except CheckpointError as e:
        pytest.skip(f"default pair not fetched: {e}")


# ---------------------------------------------------------------------------------------------------------------
# The real default pair, loaded once and shared. Its checkpoints are untied (lm_head apart from the embeddings):
# 2.4B parameters, 9.6 GB of weights in fp32 (bf16: 4.8 GB). Each test loading its own copy cost ~20 s a load, and
# one pytest process peaked at 21.7 GB where an earlier copy was still reachable (below: FastAPI's caches). Now one
# Engine is held at a time: `real_pair` (tests that check ranges or compare the pair's output with its own) and
# `real_pair_fp32` (tests that hold the output to an fp32 reference, near-tie epsilon 1e-4, or need fp32 as such).
# The real-pair tests run first, `real_pair` users before `real_pair_fp32` users, so the pair is loaded at most
# twice (once where the two dtypes coincide), and it is dropped (del + gc) right after its last user. The loader
# maps a checkpoint file anew every 256 MB read, since the pages read through one mapping of the whole file stayed
# resident beside an fp32 copy. `real_pair_fp32` holds its target in fp32 and its draft in `real_pair_dtype()`:
# measured alone, test_real_pair.py peaks at 9.9 GB RSS (11.0 GB with an fp32 draft).
# `real_pair`'s dtype: bf16 where the CPU computes bf16 natively (AVX512-BF16 / AMX: half the memory, 2.4x faster),
# fp32 elsewhere: on an AVX2-only CPU a bf16 matmul is 3x slower than fp32 (dustin/runtime.py). The probe reads
# the hardware, not DUSTIN_CPU_BF16 (pinned to 0 above).

_REAL_PAIR_FIXTURES = ("real_pair", "real_pair_fp32", "real_pair_cli")


class _RealPair:
    """At most one loaded default pair; the CPU's every core while it is held (conftest sets 1 for tiny models)."""

    def __init__(self) -> None:
        self.engine = None
        self.dtype = None
        self.loads = 0

    def get(self, dtype: torch.dtype):
        if self.engine is not None and self.dtype == dtype:
            return self.engine
        self.release()
        real_pair_or_skip()
        _drop_leaked_models()  # a model an earlier test loaded and left behind must not stay beside this one
        from dustin.engine.engine import Engine

        torch.set_num_threads(os.cpu_count() or 1)  # a 1.5B model wants every core
        name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        target = Engine.from_pretrained("default", device="cpu", tokenizer=_real_tokenizer(), dtype=name[dtype])
        # the draft in `real_pair_dtype()` even beside an fp32 target: its precision changes how many drafts are
        # accepted, never the output. Where bf16 is native the draft holds 1.3 GB less (measured on such a CPU:
        # all test processes together 11.4 GB); an AVX2-only CPU keeps an fp32 draft (bf16 is slow there)
        draft = Engine.from_pretrained(real_pair_or_skip()[1], device="cpu", dtype=name[real_pair_dtype()])
        self.engine = Engine.from_models(target.pair.target, draft.pair.target, target.pair.tokenizer,
                                         draft.pair.tokenizer)
        self.dtype, self.loads = dtype, self.loads + 1
        return self.engine

    def release(self) -> None:
        if self.engine is not None:
            self.engine = self.dtype = None
            # a failed test's traceback (kept by pytest as sys.last_traceback) holds its frames, and so the pair
            sys.last_type = sys.last_value = sys.last_traceback = None
            if hasattr(sys, "last_exc"):
                sys.last_exc = None
            _drop_leaked_models()  # a served pair stays in FastAPI's caches otherwise (below)
            torch.set_num_threads(1)


REAL_PAIR = _RealPair()


def _drop_leaked_models() -> None:
    """Free models that finished tests left reachable. FastAPI (0.165) keeps every endpoint function it has seen in
    module-level lru_caches (fastapi.dependencies.models), and `dustin serve`'s endpoints close over the engine: a
    test that served the real pair kept its 10 GB alive for the rest of the session (measured), so the shared pair
    came on top of it. Those caches only save re-inspecting endpoints; then a collection for reference cycles."""
    models = sys.modules.get("fastapi.dependencies.models")
    for name in dir(models) if models is not None else ():
        clear = getattr(getattr(models, name), "cache_clear", None)
        if callable(clear):
            clear()
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim): memory a model's threads freed stays in their
    malloc arenas otherwise (measured: 2.3 GB of RSS left after the served real pair was freed)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def real_pair_dtype() -> torch.dtype:
    """`real_pair`'s dtype: bf16 where this CPU computes it natively, else fp32 (see above)."""
    from dustin.runtime import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@pytest.fixture
def real_pair():
    """The shared default pair (Engine) in `real_pair_dtype()`: for tests that check ranges, structure, or the
    pair's agreement with itself. Skips when the pair is not fetched."""
    return REAL_PAIR.get(real_pair_dtype())


@pytest.fixture
def real_pair_fp32():
    """The shared default pair with its target in fp32 (the draft in `real_pair_dtype()`): for tests whose output
    is held to an fp32 reference."""
    return REAL_PAIR.get(torch.float32)


@pytest.fixture
def real_pair_cli(real_pair, monkeypatch):
    """`real_pair`, also handed to every command that loads the default pair on the CPU with `--dtype auto` (the
    commands load through Engine.from_pretrained): `dustin ...` end-to-end tests run on the shared pair instead of
    loading their own. A draft-less load gets the shared target alone. The commands run as on a user's CPU:
    TRITON_INTERPRET unset, so sparse methods estimate and select with the CPU's PyTorch code instead of the Triton
    kernels run by the interpreter (the kernel tests hold those to the PyTorch code on small shapes; on the pair's
    28 layers the interpreted score estimation took ~6 s a decode step: `eval tasks` code, dustin@64, 72 -> 30 s)."""
    from dustin.engine.engine import Engine

    without_interpreter(monkeypatch)

    load = Engine.from_pretrained
    target_dir, draft_dir = (str(p) for p in real_pair_or_skip())

    def shared(cls, target, draft=None, **kw):
        other = dict(kw)  # any other option (e.g. rope_scaling) must be unset for the shared pair to serve
        other.pop("tokenizer", None)  # `dustin generate` hands over the target's tokenizer: the pair has its own
        plain = (str(other.pop("device", "cpu")) == "cpu" and other.pop("dtype", None) in (None, "auto")
                 and other.pop("attention", "auto") == "auto" and all(v is None for v in other.values()))
        if plain and str(target) in ("default", target_dir) and (draft is None or str(draft) in ("default", draft_dir)):
            if draft is None:
                return Engine.from_models(real_pair.pair.target, None, real_pair.pair.tokenizer)
            return real_pair
        return load(target, draft, **kw)

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(shared))
    return real_pair


def without_interpreter(mp: pytest.MonkeyPatch) -> None:
    """Unset TRITON_INTERPRET (through `mp`) for a test that runs the CPU's PyTorch paths, as a user's CPU does.
    Every kernel module is imported first: @triton.jit makes a kernel interpreted or compiled when its module is
    imported, and one first imported while the variable is unset would stay compiled for the tests after, where
    it fails on CPU tensors."""
    import pkgutil

    import dustin.kernels

    for m in pkgutil.iter_modules(dustin.kernels.__path__):
        importlib.import_module(f"dustin.kernels.{m.name}")
    mp.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="module")
def cpu_paths():
    """TRITON_INTERPRET unset for a whole test module (`without_interpreter`): the engine selects with the CPU's
    PyTorch code (dustin's selection, Quest's pages), as on a user's CPU, instead of Triton kernels run by the
    interpreter. For engine tests whose property does not depend on which of the two selects (tests/kernels hold
    the kernels and the PyTorch code to the same reference): the interpreted selection kernel (one program per
    sequence and step, a tl.sort) cost ~0.3 s a row and a step, most of those tests' time."""
    with on_cpu_paths():
        yield


@contextlib.contextmanager
def on_cpu_paths():
    """TRITON_INTERPRET unset inside (`without_interpreter`): the engine estimates and selects with the CPU's
    PyTorch code, as `eval tasks` and a user's CPU run it. For end-to-end tests whose subject is not a kernel:
    under the interpreter every decode step's selection ran Triton's interpreted tl.sort (select_dustin's
    `_assemble_kernel`), ~1.7 s a row and layer on a 2-core machine (profiled: test_tail.py's budget test, 190 of
    197 s). The Triton path keeps its own tests: tests/kernels holds each kernel to its PyTorch code,
    test_selection.py's test_triton_kernels_give_the_same_sparse_decoding runs dustin on the Triton kernels in the
    engine, and tests/engine/test_warmup.py's plan tests run each method's real steps under the interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        without_interpreter(mp)
        yield


def _real_pair_group(item) -> int:
    names = set(getattr(item, "fixturenames", ()))
    if "real_pair_fp32" in names:
        return 2
    return 1 if names & set(_REAL_PAIR_FIXTURES) else 0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    """The shared real pair's users run first, grouped by dtype (a stable sort: file order is kept within a group),
    so that it is loaded once per dtype. Under pytest-xdist (`-n auto --dist loadgroup`, the README's test command)
    they form one group that a single worker runs from the start, while the other worker takes the tiny-model
    tests: the pair's ~6 minutes overlap with theirs, instead of ending the run on one busy core."""
    order = {1: 0, 2: 1, 0: 2}  # `real_pair` users, then `real_pair_fp32` users, then the rest
    items.sort(key=lambda item: order[_real_pair_group(item)])
    for item in items:
        if _real_pair_group(item):
            item.add_marker(pytest.mark.xdist_group("real_pair"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most two (each worker holds its own tiny models; the worker with the
    real pair peaks near 10 GB in fp32, so a third would pass the suite's 12 GB budget on a small machine)."""
    return min(2, os.cpu_count() or 1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After the last test that uses the shared pair (once its protocol is over: fixtures torn down, the test's
    arguments dropped), free it; after any other real-model test, and after each user of the pair, collect what it
    may have left in reference cycles or in FastAPI's caches (a model, a server's KV cache; gc runs by object
    counts, not bytes: gigabytes can wait there while the next test allocates its own)."""
    yield
    if REAL_PAIR.engine is not None and (nextitem is None or _real_pair_group(nextitem) == 0):
        REAL_PAIR.release()
    elif item.get_closest_marker("realmodels") is not None or _real_pair_group(item):
        _drop_leaked_models()  # e.g. a server's KV cache and threads, beside the pair still held


# optuna keeps the ImportErrors of its optional integrations, tracebacks included, for later (optuna._imports):
# imported first inside `dustin profile` (search._tune_m), those tracebacks held that call's frames, and so the
# real pair, until the process ended (measured: a bf16 pair beside the fp32 one). Imported here, they hold nothing.
try:
    importlib.import_module("optuna")
except ImportError:
    pass

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
