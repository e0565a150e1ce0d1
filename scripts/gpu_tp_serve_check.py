"""`dustin serve` under torchrun on 2 GPUs (NCCL): rank 0 serves HTTP, rank 1 follows its engine steps.

    PYTHONPATH=. python3 scripts/gpu_tp_serve_check.py      # on a machine with 2 GPUs (nvidia-h200-x2)

Tiny random Qwen2 pair (tests/tiny_models.py), fp32: 6 concurrent greedy completions (dustin, k = 64, prompts of
37-3001 tokens as token ids) must return exactly the tokens of `Engine.generate` of each prompt alone on one GPU;
then a malformed request gets 400, /health still answers, and SIGINT to torchrun ends every rank.
Writes $OUT/tp_serve_check.json.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dustin.engine.config import GenerationConfig  # noqa: E402
from dustin.engine.engine import Engine  # noqa: E402
from dustin.engine.request import SamplingParams  # noqa: E402
from tests.tiny_models import gpu_check_pair  # noqa: E402

SERVE = ["--method", "dustin", "--budget", "64", "--max-slots", "4", "--max-context", "4096", "--dtype", "fp32",
         "--prefill-chunk", "1024"]
LIMIT = 32


def main() -> int:
    _, prompts, (target, draft) = gpu_check_pair(torch.float32)
    prompts = [[3 + t % 90 for t in p] for p in prompts + [prompts[1][:300], prompts[2][::-1]]]  # the tokenizer: 97 ids
    ref_engine = Engine.from_pretrained(str(target), str(draft), device="cuda", dtype="fp32")
    cfg = GenerationConfig(method="dustin", budget=64)
    params = SamplingParams(max_tokens=LIMIT, temperature=0, ignore_eos=True)
    want = [ref_engine.generate([p], cfg, params).sequences[0].token_ids for p in prompts]
    del ref_engine
    torch.cuda.empty_cache()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dustin",
           "serve", "--target", str(target), "--draft", str(draft), "--device", "cuda", "--port", str(port), *SERVE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    report = {"command": " ".join(cmd[2:])}
    try:
        t0 = time.time()
        while time.time() - t0 < 240:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        report["start_s"] = round(time.time() - t0, 1)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]

        def complete(p):
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "model": model, "prompt": p, "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        report["equal_to_one_gpu_generate"] = [g == w for g, w in zip(got, want, strict=True)]
        bad = httpx.post(url + "/v1/completions", timeout=30, content=b"{not json")
        report["malformed_status"] = bad.status_code
        report["health_after"] = httpx.get(url + "/health", timeout=10).status_code
        metrics = httpx.get(url + "/metrics", timeout=10).text
        report["metrics_tau"] = [ln for ln in metrics.splitlines() if "tau" in ln and not ln.startswith("#")][:1]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
            report["exit_code"] = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            report["exit_code"] = "killed after 60 s"
        report["server_output_tail"] = out[-1500:]
    ok = (all(report.get("equal_to_one_gpu_generate", [False])) and report.get("malformed_status") == 400
          and report.get("health_after") == 200 and report.get("exit_code") == 0)
    report["ok"] = ok
    print(json.dumps(report, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "tp_serve_check.json").write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
