"""Does the conversion's work scale over this machine's worker processes? A probe without model files.

    PYTHONPATH=. python3 scripts/experiments/cpu_scaling_probe.py [--mb 32] [--workers 1,2,4,8,16] [--dir /tmp]

Why: `dustin models fetch` converts the 0.5B draft's GGUF in 5.4 s on 2 worker processes of our 2-core CPU, but
took 12.5 s on 16 worker processes of the H200 machine (which reports 16 CPUs and no cgroup CPU quota). Its "ready"
line said the config and tokenizer were done at 12.5 s too, so the tensors were done no later: the tokenizer (since
made ~5x cheaper) was at least as slow as the workers. Whether the workers themselves run in parallel there decides
whether the tensors become the critical path now. Each worker here does what a conversion worker does to a tensor
(dequantize GGML blocks with the gguf package, round to bf16 with `_to_bf16`, pwrite the result into a file in
--dir), on `--mb` MB of synthetic Q8_0 and Q5_0 blocks, and reports its import, compute and write times. W workers
run at once, for each W of --workers: if the machine runs them in parallel, the wall time stays flat as W grows (up
to its real core count); if it grows with W, the processes share fewer cores than reported, and the conversion
needs fewer or cheaper workers there, not more. Also printed: os.cpu_count(), the affinity mask, /proc/cpuinfo's
model and the load average. Writes $OUT/cpu_scaling_probe.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(mb: int, out_dir: str) -> dict:
    """One worker's share: import, dequantize + round, write; the seconds of each."""
    t0 = time.perf_counter()
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    from dustin.models.gguf_convert import _pwrite_all, _to_bf16
    t_import = time.perf_counter() - t0
    rng = np.random.default_rng(os.getpid())
    compute = write = 0.0
    with tempfile.NamedTemporaryFile(dir=out_dir) as f:
        offset = 0
        for name in ("Q8_0", "Q5_0"):
            qtype = GGMLQuantizationType[name]
            block, size = GGML_QUANT_SIZES[qtype]
            blocks = (mb << 19) // size  # half of --mb per type
            raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
            raw[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # a finite scale d in every block
            for first in range(0, blocks, 4096):
                t1 = time.perf_counter()
                values = np.ascontiguousarray(dequantize(raw[first:first + 4096], qtype), np.float32).reshape(-1)
                half = _to_bf16(values, name, "probe")
                t2 = time.perf_counter()
                _pwrite_all(f.fileno(), half, offset)
                offset += half.nbytes
                compute += t2 - t1
                write += time.perf_counter() - t2
    return {"import_s": round(t_import, 3), "compute_s": round(compute, 3), "write_s": round(write, 3)}


def machine() -> dict:
    info = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg()}
    try:
        info["model"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.startswith("model name"))
    except (OSError, StopIteration):
        info["model"] = None
    for quota in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if os.path.exists(quota):
            info["cgroup_quota"] = Path(quota).read_text().strip()
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=32, help="MB of quantized blocks per worker")
    ap.add_argument("--workers", default="1,2,4,8,16")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the workers write (the models' disk)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.mb, args.dir)))
        return
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    report = {"machine": machine(), "mb_per_worker": args.mb, "dir": args.dir, "runs": []}
    for w in map(int, args.workers.split(",")):
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--mb", str(args.mb), "--dir", args.dir],
                                  stdout=subprocess.PIPE, env=env, text=True) for _ in range(w)]
        outs = [json.loads(p.communicate()[0]) for p in procs]
        wall = time.perf_counter() - t0
        run = {"workers": w, "wall_s": round(wall, 3), "MB_per_s": round(w * args.mb / wall, 1),
               "mean": {k: round(sum(o[k] for o in outs) / w, 3) for k in outs[0]}}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    base = report["runs"][0]
    report["speedup_vs_first"] = [round(r["MB_per_s"] / base["MB_per_s"], 2) for r in report["runs"]]
    print(json.dumps({"machine": report["machine"], "speedup_vs_first": report["speedup_vs_first"]}))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cpu_scaling_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
