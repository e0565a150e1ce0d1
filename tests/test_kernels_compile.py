"""Every Triton kernel compiles for sm_90 (H100/H200) with the specializations the engine launches.

The rest of the suite runs the kernels in the CPU interpreter, which does not type-check the way the real
compiler does (a kernel that passed every interpreter test once failed to compile on the H200). This test
compiles them ahead of time on the CPU: see tests/triton_compile.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"_add_rms_norm_kernel", "_rope_kernel", "_verify_attention_split_kernel",
           "_verify_attention_combine_kernel", "_sparse_verify_split_kernel", "_sparse_verify_combine_kernel",
           "_score_pass1_kernel", "_score_combine_kernel", "_score_pass2_kernel", "_mask_scores_kernel",
           "_assemble_kernel", "_page_minmax_kernel", "_page_scores_kernel"}


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_compile.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = set(proc.stdout.split())
    assert KERNELS <= compiled, f"not compiled: {sorted(KERNELS - compiled)}"
