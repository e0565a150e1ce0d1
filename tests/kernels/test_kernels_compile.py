"""Every Triton kernel compiles for sm_90 (H100/H200) with the specializations the engine launches.

The rest of the suite runs the kernels in the CPU interpreter, which does not type-check the way the real
compiler does (a kernel that passed every interpreter test once failed to compile on the H200). This test
compiles them ahead of time on the CPU: see tests/triton_compile.py. It also checks each compiled kernel's
shared memory against the H100/H200 limit, which the driver enforces only at launch (12 score heads per
layer once asked for 450560 B and crashed the H200 run), and that the kernels of a decode / verify step compile
for Programmatic Dependent Launch with griddepcontrol.wait before their first memory access
(dustin/kernels/launch.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dustin.kernels import launch
from tests.triton_compile import pdl_order

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_add_rms_norm_kernel", "_rope_kernel", "_silu_mul_kernel", "_verify_attention_split_kernel",
           "_verify_attention_combine_kernel", "_sparse_verify_split_kernel", "_sparse_verify_combine_kernel",
           "_score_pass1_kernel", "_score_pass2_kernel", "_mask_scores_kernel",
           "_assemble_kernel", "_page_minmax_kernel", "_page_scores_kernel", "_prefill_attention_kernel",
           "_linear_kernel", "_gate_up_kernel", "_qkv_rope_kernel", "_capture_query_kernel"}
NO_PDL = {"_prefill_attention_kernel"}  # prefill only, between cuBLAS GEMMs: launched without PDL
WAVES_WITHOUT_PDL = {"_verify_attention_split_kernel"}  # without PDL when its grid exceeds the SMs (use_pdl_for)
SM90_SHARED_LIMIT = 232448  # bytes per block (227 KiB: cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90)


@pytest.fixture(scope="module")
def launches() -> list[list[str]]:
    """One line per launch of tests/triton_compile.py, compiled in a subprocess with the interpreter off: name,
    shared bytes, constexprs, launch_pdl, PTX order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_compile.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [line.split("\t") for line in proc.stdout.splitlines() if line.strip()]


# the tests that read `launches` run on one xdist worker: the compile subprocess (8-10 s) runs once, not once a worker
@pytest.mark.xdist_group("kernels_compile")
def test_every_kernel_compiles_for_sm90(launches):
    compiled = {name for name, *_ in launches}
    assert KERNELS <= compiled, f"not compiled: {sorted(KERNELS - compiled)}"
    over = [f"{name} {shared} B ({consts})" for name, shared, consts, *_ in launches
            if int(shared) > SM90_SHARED_LIMIT]
    assert not over, f"over sm_90's {SM90_SHARED_LIMIT} B of shared memory: {over}"


@pytest.mark.xdist_group("kernels_compile")
def test_step_kernels_wait_for_their_predecessor_first(launches):
    """Compiled as an H200 launches them (PDL forced on), every kernel but prefill's is launched with PDL and its
    PTX waits (griddepcontrol.wait) before any load, store or atomic, then lets its successor launch
    (griddepcontrol.launch_dependents): correctness never depends on the overlap. A full verify attention grid
    of more programs than SMs is launched without PDL (verify_attention.use_pdl_for)."""
    def ok(name: str, consts: str, pdl: str, order: str) -> bool:
        if name in WAVES_WITHOUT_PDL and "PDL=False" in consts.split():
            return pdl == "False" and order == "no wait"
        return pdl == "True" and order == "wait first" and "PDL=True" in consts.split()

    bad = [f"{name} ({consts}): launch_pdl {pdl}, {order}" for name, _, consts, pdl, order in launches
           if name not in NO_PDL and not ok(name, consts, pdl, order)]
    assert not bad, bad
    assert any(name in WAVES_WITHOUT_PDL and "PDL=False" in consts.split() for name, _, consts, *_ in launches)
    assert {name for name, *_ in launches} - NO_PDL == KERNELS - NO_PDL
    assert all(pdl == "False" and order == "no wait" for name, _, _, pdl, order in launches if name in NO_PDL)


def test_pdl_order_reads_the_ptx():
    """The check above fails where it should: an access before the wait, a missing wait or trigger."""
    head = "\tld.param.b64 \t%rd4, [k_param_0];\n"
    wait, trigger = "\tgriddepcontrol.wait ;\n", "\tgriddepcontrol.launch_dependents ;\n"
    load = "\t@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
    atom = "\tatom.global.gpu.acq_rel.add.u32 %r5, [%rd2], 1;\n"
    assert pdl_order(head + wait + trigger + load + atom) == "wait first"
    assert pdl_order(head + load + wait + trigger) == "ld.global.v4.b32 before griddepcontrol.wait"
    assert pdl_order(head + atom + wait + trigger) == "atom.global.gpu.acq_rel.add.u32 before griddepcontrol.wait"
    assert pdl_order(head + "\tcp.async.cg.shared.global [%r1], [%rd1], 16;\n" + wait + trigger).startswith("cp.async")
    assert pdl_order(head + load) == "no wait"
    assert pdl_order(head + wait + load) == "no launch_dependents"
    assert pdl_order(head + trigger + wait) == "griddepcontrol.launch_dependents before griddepcontrol.wait"


def test_use_pdl_only_when_asked_on_hopper_compiled(monkeypatch):
    """PDL only with DUSTIN_PDL=1 (opt-in: it slowed vanilla's step on the H200), on a CUDA device of compute
    capability >= 9, with the interpreter off; the answer is cached per device index (clear_cache() forgets it)."""
    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    monkeypatch.delenv("DUSTIN_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda0, cuda1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    launch.clear_cache()
    try:
        assert not launch.use_pdl(cuda0)  # off by default
        monkeypatch.setenv("DUSTIN_PDL", "1")
        launch.clear_cache()
        assert launch.use_pdl(cuda0) and not launch.use_pdl(cuda1) and not launch.use_pdl(cpu)
        assert launch.pdl_options(cuda0) == {"PDL": True, "launch_pdl": True}
        assert launch.pdl_options(cpu) == {"PDL": False, "launch_pdl": False}
        monkeypatch.setenv("DUSTIN_PDL", "0")
        assert launch.use_pdl(cuda0)  # cached: read once per device in a process
        launch.clear_cache()
        assert not launch.use_pdl(cuda0)
        monkeypatch.setenv("DUSTIN_PDL", "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        launch.clear_cache()
        assert not launch.use_pdl(cuda0)  # the interpreter has no griddepcontrol
    finally:
        launch.clear_cache()
