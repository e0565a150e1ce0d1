"""Every Triton kernel compiles for sm_90 (H100/H200) with the specializations the engine launches.

The rest of the suite runs the kernels in the CPU interpreter, which does not type-check the way the real
compiler does (a kernel that passed every interpreter test once failed to compile on the H200). This test
compiles them ahead of time on the CPU: see tests/triton_compile.py. It also checks each compiled kernel's
shared memory against the H100/H200 limit, which the driver enforces only at launch (12 score heads per
layer once asked for 450560 B and crashed the H200 run)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"_add_rms_norm_kernel", "_rope_kernel", "_silu_mul_kernel", "_verify_attention_split_kernel",
           "_verify_attention_combine_kernel", "_sparse_verify_split_kernel", "_sparse_verify_combine_kernel",
           "_score_pass1_kernel", "_score_pass2_kernel", "_mask_scores_kernel",
           "_assemble_kernel", "_page_minmax_kernel", "_page_scores_kernel", "_prefill_attention_kernel",
           "_linear_kernel", "_gate_up_kernel", "_qkv_rope_kernel"}
SM90_SHARED_LIMIT = 232448  # bytes per block (227 KiB: cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90)


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_compile.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    launches = [line.split("\t") for line in proc.stdout.splitlines() if line.strip()]
    compiled = {name for name, *_ in launches}
    assert KERNELS <= compiled, f"not compiled: {sorted(KERNELS - compiled)}"
    over = [f"{name} {shared} B ({consts})" for name, shared, consts in launches if int(shared) > SM90_SHARED_LIMIT]
    assert not over, f"over sm_90's {SM90_SHARED_LIMIT} B of shared memory: {over}"
