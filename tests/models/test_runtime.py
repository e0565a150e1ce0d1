"""`--dtype auto`: bf16 on CUDA and on CPUs with native bf16, fp32 on other CPUs (dustin/runtime.py says why);
`--device auto`: cuda when torch sees a GPU, else cpu."""
from __future__ import annotations

import argparse

import pytest
import torch

from dustin import runtime

# Commands whose --dtype does not default to auto yet, with where they set it. Remove an entry once its
# command defaults to auto (the test fails on stale entries so that the list only shrinks).
KNOWN_NON_AUTO: dict[tuple[str, str], str] = {}


@pytest.fixture(autouse=True)
def _probe_decides(monkeypatch):
    """The suite pins `auto` to fp32 with DUSTIN_CPU_BF16=0 (tests/conftest.py); these tests exercise the probe."""
    monkeypatch.delenv("DUSTIN_CPU_BF16", raising=False)


@pytest.mark.parametrize("value, dtype", [("0", torch.float32), ("1", torch.bfloat16)])
def test_environment_overrides_the_probe(monkeypatch, value, dtype):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: value == "0")  # the opposite of the override
    monkeypatch.setenv("DUSTIN_CPU_BF16", value)
    assert runtime.auto_dtype("cpu") == dtype and runtime.auto_dtype("cuda") == torch.bfloat16


def test_resolve_dtype_uses_the_probe(monkeypatch):
    from dustin.engine.pair import resolve_dtype

    for native, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda native=native: native)
        assert resolve_dtype("auto", torch.device("cpu")) == resolve_dtype(None, torch.device("cpu")) == dtype


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_auto_is_fp32_on_a_cpu_without_native_bf16(monkeypatch, device):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: False)
    assert runtime.auto_dtype(device) == torch.float32


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_auto_is_bf16_on_a_cpu_with_native_bf16(monkeypatch, device):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)
    assert runtime.auto_dtype(device) == torch.bfloat16


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("device", [torch.device("cuda"), torch.device("cuda", 1), "cuda:0"])
def test_auto_is_bf16_on_cuda_whatever_the_cpu(monkeypatch, device, native):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: native)
    assert runtime.auto_dtype(device) == torch.bfloat16


def test_other_devices_keep_fp32(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)
    assert runtime.auto_dtype(torch.device("meta")) == torch.float32


@pytest.mark.parametrize("caps, native", [
    ({"avx2": True, "avx512_f": True, "avx512_bf16": False, "amx_bf16": False}, False),  # AVX512 alone is not it
    ({"avx2": True}, False),
    ({"avx512_f": True, "avx512_bf16": True}, True),
    ({"amx_tile": True, "amx_bf16": True}, True),
])
def test_probe_reads_torch_capabilities(monkeypatch, caps, native):
    monkeypatch.setattr(runtime, "_torch_capabilities", lambda: caps)
    monkeypatch.setattr(runtime, "_read_cpuinfo", lambda: pytest.fail("torch answered: /proc/cpuinfo not read"))
    assert runtime.cpu_has_native_bf16.__wrapped__() is native


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512bw {extra}
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512bw {extra}
"""


@pytest.mark.parametrize("extra, native", [("", False), ("avx512_bf16", True), ("amx_tile amx_bf16", True),
                                           ("avx512_bf16_x", False)])
def test_probe_falls_back_to_proc_cpuinfo(monkeypatch, extra, native):
    monkeypatch.setattr(runtime, "_torch_capabilities", lambda: None)  # a torch without get_capabilities
    monkeypatch.setattr(runtime, "_read_cpuinfo", lambda: CPUINFO.format(extra=extra))
    assert runtime.cpu_has_native_bf16.__wrapped__() is native


def test_probe_without_any_source_says_no(monkeypatch):
    monkeypatch.setattr(runtime, "_torch_capabilities", lambda: None)
    monkeypatch.setattr(runtime, "_read_cpuinfo", lambda: "")
    assert runtime.cpu_has_native_bf16.__wrapped__() is False


def test_probe_on_this_machine_is_a_bool():
    assert isinstance(runtime.cpu_has_native_bf16(), bool)
    assert runtime.auto_dtype("cpu") in (torch.float32, torch.bfloat16)


def _flag_defaults(flag: str, parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(subcommand path, the flag's default) for every (sub)parser that has the flag (e.g. --dtype)."""
    from dustin.cli.docs import options, subparsers

    flags = options(parser)
    if flag in flags:
        yield path, flags[flag].default
    for name, sub in subparsers(parser).items():
        yield from _flag_defaults(flag, sub, path + (name,))


def test_every_device_flag_defaults_to_auto():
    """--device is `auto` (cuda when torch sees a GPU, else cpu) wherever a command has it, and every command that
    runs models has it."""
    from dustin.cli.main import build_parser

    defaults = dict(_flag_defaults("--device", build_parser()))
    assert {path for path, value in defaults.items() if value != "auto"} == set()
    assert {("generate",), ("demo",), ("serve",), ("warmup",), ("bench", "e2e"), ("bench", "serve"),
            ("eval", "fidelity"), ("eval", "needles"), ("eval", "tasks"), ("eval", "arr-kl"),
            ("profile",)} <= set(defaults), sorted(defaults)


@pytest.mark.parametrize("gpu", [True, False])
def test_resolve_device(monkeypatch, gpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert runtime.resolve_device("auto") == ("cuda" if gpu else "cpu")
    assert runtime.resolve_device("cpu") == "cpu" and runtime.resolve_device("cuda:1") == "cuda:1"


def test_every_dtype_flag_defaults_to_auto():
    from dustin.cli.main import build_parser

    defaults = dict(_flag_defaults("--dtype", build_parser()))
    assert ("generate",) in defaults and ("serve",) in defaults  # the walk reaches the commands
    not_auto = {path for path, value in defaults.items() if value != "auto"}
    unexpected = sorted(not_auto - set(KNOWN_NON_AUTO))
    assert not unexpected, f"--dtype must default to auto (dustin/runtime.py picks per device): {unexpected}"
    stale = sorted(set(KNOWN_NON_AUTO) - not_auto)
    assert not stale, f"these now default to auto: remove them from KNOWN_NON_AUTO: {stale}"
