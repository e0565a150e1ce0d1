"""Triton compiles on the main thread in a fresh process's first prefill and decode steps, with and without the
background kernel warm-up (dustin/engine/warmup.py), and the time of load + prefill + first decode step, on a GPU.

Every case runs in a fresh Python process with its own Triton cache folder:
  off    DUSTIN_KERNEL_WARMUP=0, empty cache: the first forwards compile their kernels on the main thread
  on     the warm-up on, empty cache: its threads compile while the prompts prefill
  disk   the warm-up on, over the folder the "on" case filled: kernels and launchers load from Triton's disk cache
  on1    as "on" with one compile thread; on-si: as "on" with a 0.5 ms GIL switch interval (diagnostics)
Random weights of the default pair's shapes (Qwen2.5-1.5B + 0.5B), the pair's tuned sparse config, 16 prompts of
16,384 random token ids (--context), 8 new tokens; speculative methods with acceptance control at τ 3.85 (the
one-shot run's). --real adds the fetched pair run as the one-shot benchmark runs it (docs/benchmarks.md,
"One-shot"): a fresh `python3 -m dustin generate ... --json` per method and case, 128 new tokens on 16 code prompts
of 29,500 tokens (--real-context), its process wall clock, and the kernels compiled (new kernels in its Triton
cache folder).

One JSON line per case on stdout, also appended to --out/first_step_compile.jsonl. Fields (random weights):
process_s (the child's wall clock, interpreter start included), import_s, load_s, prompts_s, generate_s;
Engine.generate's prefill_s, capture_s (the one-time first-step cost: compile wait, eager step, graph capture)
and decode_s; timeline (seconds from the child's start: engine created, background compile start and end, first
and last prefill step, first decode step start and end); compiles: main_thread (kernels compiled on the main
thread, and seconds), first_step (of those, after the first decode launch, with the kernels' names),
warmup_threads, disk_hits (loaded from the cache folder instead of compiled); kernel_warmup (the warm-up's stats).
About 2 minutes on an H200 for the defaults (the earlier form of the warm-up at --context 29500: 191 s).

    PYTHONPATH=. python3 scripts/gpu_first_step_compile.py --out $OUT
    PYTHONPATH=. python3 scripts/gpu_first_step_compile.py --out $OUT --real --cases off,on   # + the real pair
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

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "dustin/configs/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct.json"
CASES = ("off", "on", "disk", "on1", "on-si")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="folder of the JSONL file")
    p.add_argument("--methods", default="dustin,vanilla")
    p.add_argument("--cases", default="off,on,disk", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=16384, help="prompt tokens per sequence (random weights)")
    p.add_argument("--new-tokens", type=int, default=8, help="new tokens per sequence (random weights)")
    p.add_argument("--tau", type=float, default=3.85, help="acceptance-controlled τ of speculative methods")
    p.add_argument("--real", action="store_true", help="also the fetched pair through `dustin generate`")
    p.add_argument("--real-new-tokens", type=int, default=128)
    p.add_argument("--real-context", type=int, default=29500, help="prompt tokens per sequence (--real)")
    p.add_argument("--timeout", type=int, default=120, help="seconds per child process")
    p.add_argument("--child", nargs=2, metavar=("CASE", "METHOD"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for c in a.cases.split(","):
        if c not in CASES:
            p.error(f"--cases: unknown case {c!r}")
    return a


def child(a: argparse.Namespace) -> None:
    """One case in this (fresh) process: random-weight pair, one Engine.generate; prints its JSON line."""
    t_start = time.perf_counter()
    import random

    import torch

    from dustin.bench.e2e import build_engine
    from dustin.engine.config import METHODS, GenerationConfig
    from dustin.engine.sampling import accept_prob_for_tau
    from dustin.engine.session import Session
    from dustin.engine.warmup import watch_compiles
    from dustin.models.args import named_config

    case, method = a.child
    if os.environ.get("SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL"]))
    events, marks, prefills, engines = [], {}, [], []
    watch_compiles(lambda thread, name, hit, secs: events.append((time.perf_counter(), thread, name, hit, secs)))
    launch, complete, prefill = Session.launch, Session.complete, Session.prefill
    from dustin.engine.llm_engine import LLMEngine
    init = LLMEngine.__init__

    def first_launch(self, *args, **kw):  # when the first decode step starts and ends
        marks.setdefault("first_launch", time.perf_counter())
        return launch(self, *args, **kw)

    def first_complete(self, *args, **kw):
        out = complete(self, *args, **kw)
        marks.setdefault("first_complete", time.perf_counter())
        return out

    def timed_prefill(self, *args, **kw):  # host time of each packed prefill step
        t0 = time.perf_counter()
        out = prefill(self, *args, **kw)
        prefills.append((t0, time.perf_counter()))
        return out

    def engine_init(self, *args, **kw):
        marks["engine_init"] = time.perf_counter()
        init(self, *args, **kw)
        marks["engine_ready"] = time.perf_counter()
        engines.append(self.kernel_warmup)

    Session.launch, Session.complete, Session.prefill, LLMEngine.__init__ = (first_launch, first_complete,
                                                                             timed_prefill, engine_init)
    t_import = time.perf_counter()
    engine = build_engine(named_config("qwen2.5-1.5b"), named_config("qwen2.5-0.5b"), "cuda")
    torch.cuda.synchronize()
    t_load = time.perf_counter()
    rng = random.Random(0)
    vocab = engine.vocab_limit
    prompts = [[rng.randrange(3, vocab) for _ in range(a.context)] for _ in range(a.batch)]
    t_prompts = time.perf_counter()
    spec = METHODS[method]
    cfg = GenerationConfig(method=method, max_new_tokens=a.new_tokens, stop_at_eos=False,
                           sparse_config=str(CONFIG) if spec.policy != "full" else None,
                           accept_prob=accept_prob_for_tau(a.tau, 4) if spec.speculative else None)
    r = engine.generate(prompts, cfg)
    t_end = time.perf_counter()
    main = [e for e in events if e[1] == "MainThread" and not e[3]]
    first = [e for e in main if e[0] >= marks.get("first_launch", float("inf"))]
    warm = engines[0] if engines else None
    w0, w1 = (getattr(warm, "started", None), getattr(warm, "finished", None)) if warm is not None else (None, None)
    rel = lambda t: None if t is None else round(t - t_start, 3)  # noqa: E731
    during = [b - a_ for a_, b in prefills if w0 is not None and w1 is not None and a_ < w1]
    print(json.dumps({
        "case": case, "method": method, "weights": "random", "batch": a.batch, "context": a.context,
        "import_s": round(t_import - t_start, 3), "load_s": round(t_load - t_import, 3),
        "prompts_s": round(t_prompts - t_load, 3), "generate_s": round(t_end - t_prompts, 3),
        "prefill_s": round(r.prefill_s, 3), "capture_s": round(r.capture_s, 3), "decode_s": round(r.decode_s, 3),
        "steps": r.steps, "tau": round(r.tau, 3),
        "timeline": {"engine_init": rel(marks.get("engine_init")), "engine_ready": rel(marks.get("engine_ready")),
                     "compile_start": rel(w0), "compile_end": rel(w1),
                     "first_prefill": rel(prefills[0][0] if prefills else None),
                     "last_prefill_end": rel(prefills[-1][1] if prefills else None), "prefill_steps": len(prefills),
                     "prefill_host_s_during_compile": round(sum(during), 3),
                     "prefill_steps_during_compile": len(during),
                     "first_decode_start": rel(marks.get("first_launch")),
                     "first_decode_end": rel(marks.get("first_complete")), "end": rel(t_end)},
        "compiles": {"main_thread": len(main), "main_thread_s": round(sum(e[4] for e in main), 3),
                     "first_step": len(first),
                     "warmup_threads": sum(1 for e in events if e[1] != "MainThread" and not e[3]),
                     "warmup_threads_s": round(sum(e[4] for e in events if e[1] != "MainThread" and not e[3]), 3),
                     "disk_hits": sum(1 for e in events if e[3]),
                     "main_thread_kernels": sorted({e[2] for e in main}),
                     "first_step_kernels": sorted({e[2] for e in first})},
        "kernel_warmup": r.kernel_warmup}), flush=True)


def run_child(a, case: str, method: str, cache: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), DUSTIN_KERNEL_WARMUP="0" if case == "off" else "1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if case == "on1":
        env["DUSTIN_COMPILE_THREADS"] = "1"
    if case == "on-si":
        env["SWITCH_INTERVAL"] = "0.0005"
    cmd = [sys.executable, __file__, "--child", case, method, "--batch", str(a.batch), "--context", str(a.context),
           "--new-tokens", str(a.new_tokens), "--tau", str(a.tau)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    wall = time.perf_counter() - t0
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"case": case, "method": method, "weights": "random", "error": proc.stderr[-2000:]}
    return {**json.loads(lines[-1]), "process_s": round(wall, 3)}


def write_real_prompts(path: Path, batch: int, context: int) -> None:
    """The one-shot benchmark's prompts: `batch` code prompts of `context` tokens (scripts/device_speed.sh)."""
    from transformers import AutoTokenizer

    from dustin.bench.serve import make_prompts
    from dustin.models.fetch import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path("default", "target")))
    ids = make_prompts(tok, "code", (context, context), batch, 0, len(tok))
    with open(path, "w") as f:
        for p in ids:
            f.write(json.dumps({"prompt": tok.decode(p)}) + "\n")


def run_real(a, case: str, method: str, cache: Path, prompts: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), DUSTIN_KERNEL_WARMUP="0" if case == "off" else "1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "dustin", "generate", "--device", "cuda", "--method", method, "--prompts-jsonl",
           str(prompts), "--max-new-tokens", str(a.real_new_tokens), "--ignore-eos", "--json"]
    before = len(list(cache.glob("*/__grp__*.json")))  # one group file per compiled kernel
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"case": case, "method": method, "weights": "real", "error": proc.stderr[-2000:]}
    r = json.loads(proc.stdout)
    keep = ("steps", "tau", "tokens_per_s", "prefill_s", "decode_s", "capture_s", "time_split_s", "kernel_warmup")
    return {"case": case, "method": method, "weights": "real", "process_s": round(wall, 3),
            "kernels_compiled": len(list(cache.glob("*/__grp__*.json"))) - before, **{k: r.get(k) for k in keep}}


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        child(a)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / "first_step_compile.jsonl"
    cases = a.cases.split(",")
    root = Path(tempfile.mkdtemp(prefix="first_step_compile_"))
    runs = [("random", m) for m in a.methods.split(",")] + ([("real", m) for m in a.methods.split(",")] if a.real
                                                            else [])
    prompts = root / "oneshot.jsonl"
    for weights, method in runs:
        if weights == "real" and not prompts.exists():
            write_real_prompts(prompts, a.batch, a.real_context)
        filled = None  # the cache folder the "on" case filled, for "disk"
        for case in cases:
            cache = filled if case == "disk" and filled is not None else root / f"{weights}-{method}-{case}"
            cache.mkdir(exist_ok=True)
            row = run_real(a, case, method, cache, prompts) if weights == "real" else run_child(a, case, method,
                                                                                                 cache)
            if case == "on":
                filled = cache
            line = json.dumps(row)
            print(line, flush=True)
            with open(out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
