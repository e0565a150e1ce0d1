"""Which device `--device auto` and which dtype `--dtype auto` mean here.

`--device auto` is cuda when torch sees a CUDA GPU, else cpu (`resolve_device`).

On a GPU the answer is bf16: the engine's kernels are written for it and it halves the bytes every decode step
reads. On a CPU bf16 only pays where the CPU multiplies bf16 natively (AVX512-BF16, or AMX tiles); elsewhere a
bf16 matmul runs through slow conversion paths that cost far more than the halved bytes save, so `auto` picks
fp32 there. A 16x1536 @ 1536x8960 matmul (one MLP up-projection of Qwen2.5-1.5B on a 16-row
verify batch):
- a 2-core AVX2-only CPU: bf16 60 ms, fp32 18 ms.
- a 2-core Xeon with AVX512-BF16 and AMX (2026-12-01, torch 2.13.0+cpu, 1 thread, median of 30, another process
  busy on the second core): bf16 2.6 ms, fp32 4.5-6 ms. With oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, the
  nearest this machine gets to a CPU without native bf16), bf16 took 230-290 ms against fp32 4.5-7 ms.

`torch.backends.cpu.get_cpu_capability()` cannot decide this: it names the vector width ATen dispatches to
("AVX2", "AVX512"; "AVX512" on the AMX machine above too), not whether bf16 arithmetic is native. The probe asks
`torch.cpu.get_capabilities()` (cpuinfo's feature bits; absent from older torch releases) and falls back to the
kernel's flags in /proc/cpuinfo (`avx512_bf16`, `amx_bf16`). Other architectures (ARM's BF16 extension included,
not measured here) get fp32.

`DUSTIN_CPU_BF16=0` (or `1`) overrides the probe: `auto` then means fp32 (bf16) on every CPU. The test suite
sets 0, so its defaults are those of an AVX2-only machine wherever it runs.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

_NATIVE_BF16_FEATURES = ("avx512_bf16", "amx_bf16")  # feature names shared by cpuinfo and /proc/cpuinfo


def _torch_capabilities() -> dict | None:
    """cpuinfo's feature bits as torch reports them, or None where this torch has no such call."""
    probe = getattr(torch.cpu, "get_capabilities", None)
    if probe is None:
        return None
    try:
        return dict(probe())
    except Exception:  # noqa: BLE001 - a failed probe must not stop a run: fall back to /proc/cpuinfo
        return None


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux
        return ""


def _cpuinfo_flags(text: str) -> set[str]:
    """The feature flags of the first processor listed in a /proc/cpuinfo text (x86: the `flags` line)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True if this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16); probed once per process."""
    caps = _torch_capabilities()
    if caps is not None:
        return any(bool(caps.get(f)) for f in _NATIVE_BF16_FEATURES)
    flags = _cpuinfo_flags(_read_cpuinfo())
    return any(f in flags for f in _NATIVE_BF16_FEATURES)


def resolve_device(name: str) -> str:
    """What `--device` names: `auto` (the default of every command and of `LLM`) is cuda when torch sees a CUDA GPU,
    else cpu; any other name is returned as given (`dustin.engine.engine.parse_device` checks it)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype `--dtype auto` resolves to on `device`: bf16 on CUDA, bf16 on a CPU with native bf16, else fp32
    (other device types: fp32, as before this probe existed)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16
    if kind == "cpu":
        forced = os.environ.get("DUSTIN_CPU_BF16")
        native = cpu_has_native_bf16() if forced not in ("0", "1") else forced == "1"
        return torch.bfloat16 if native else torch.float32
    return torch.float32
