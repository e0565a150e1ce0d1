"""`dustin bench serve`: a load generator against `dustin serve`, per decoding method and scenario.

For each method the models load once, an `EngineCore` of that method is served over HTTP in this process
(`serve/local.py`, the same app as `dustin serve`), and streaming completions are sent, from this process
(`--client thread`, the default) or from another one (`--client process`: a real client's setting, whose HTTP and
JSON work does not share this process's interpreter lock with the server). Scenarios (`--scenario`, comma
separated, default `burst,decode`; explicit flags override a scenario's values):
- `burst`: 16 prompts of 8,000-19,250 tokens all at once, 64 tokens each (prefill-heavy);
- `decode`: 16 prompts of 2,048 tokens all at once, 512 tokens each (decode-heavy: the per-token path of the
  server, detokenization, SSE chunks and the event loop, against the engine's own speed);
- `poisson`: 64 prompts of 2,048-16,384 tokens, Poisson arrivals at 4 requests/s, 128 tokens each;
- `custom`: the flags alone.
Prompts are real long texts (code by default: the standard library and installed packages; `essays` needs the
data package) cut to token counts drawn uniformly from the range, or random ids (`random`). Every request asks for
exactly its max tokens, greedy, EOS ignored, so methods do the same work.

Each server is warmed up first (two short requests, untimed: kernel compiles and graph capture happen once at
start). Reported per method and scenario: wall time, request and output-token throughput, TTFT (arrival -> first
streamed token), TPOT (time per output token after the first, per request) and ITL (gap between stream chunks; a
speculative step sends several tokens in one chunk) at p50/p90/p99, τ and steps from the server's metrics; and
the two baselines the server is held to:
- `Engine.generate` of the same prompts in the same run (batched offline, warm: one untimed call first), the
  engine's own speed on the same work: `offline_tokens_per_s`, and `server_vs_offline` = offline wall / server
  wall = the server's tokens/s / `Engine.generate`'s (1.0: HTTP costs nothing). For the Poisson scenario the
  offline run gets every prompt at once, so the ratio there also holds the arrival span;
- the step's byte roofline (dustin/bench/roofline.py) at the run's batch and mean context, with the server's τ:
  the tokens/s a step that only reads its bytes at the measured copy bandwidth would give (decode-heavy runs).
"""
from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import time
from pathlib import Path

from dustin.data.corpora import long_texts
from dustin.engine.config import METHODS, ExecutionOptions, GenerationConfig
from dustin.engine.request import SamplingParams
from dustin.errors import DustinError, InputError
from dustin.flags import (
    add_draft_kernel_arg,
    add_model_args,
    add_sparse_args,
    add_speculation_args,
    budget_settings,
    method_list,
)
from dustin.selection.config import DUSTIN_POLICIES

SCENARIOS = {  # name -> (prompt tokens MIN,MAX, requests, max tokens, rate)
    "burst": ("8000,19250", 16, 64, float("inf")),
    "decode": ("2048,2048", 16, 512, float("inf")),
    "poisson": ("2048,16384", 64, 128, 4.0),
}


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--methods", default="vanilla,magicdec,dustin", help="decoding methods, one server each")
    p.add_argument("--scenario", default="burst,decode",
                   help=f"comma separated: {', '.join(SCENARIOS)} or custom (see the module docstring)")
    p.add_argument("--prompt-tokens", default=None, help="MIN,MAX prompt length in tokens (uniform)")
    p.add_argument("--prompts", default="code", choices=["code", "essays", "random"], help="prompt source")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="mean arrivals per second (Poisson); inf: all at once")
    p.add_argument("--max-tokens", type=int, default=None, help="generated tokens per request (EOS ignored)")
    add_draft_kernel_arg(add_speculation_args(p))
    add_sparse_args(p)
    p.add_argument("--max-slots", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prefill-tokens", type=int, default=None)
    p.add_argument("--no-offline", action="store_true", help="skip the Engine.generate reference run")
    p.add_argument("--client", default="thread", choices=["thread", "process"],
                   help="send the requests from this process (thread) or from another one (process, as a real "
                        "client does: its HTTP and JSON work does not compete with the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="results JSON (a .md table and a .png beside it)")


def _scenarios(args) -> list[dict]:
    """Each requested scenario's settings (explicit flags override), checked."""
    names = [x.strip() for x in args.scenario.split(",") if x.strip()]
    unknown = [n for n in names if n not in SCENARIOS and n != "custom"]
    if not names or unknown:
        raise InputError(f"--scenario takes {', '.join(SCENARIOS)} or custom, got {args.scenario!r}")
    out = []
    for name in names:
        lengths, n, m, rate = SCENARIOS.get(name, ("8000,19250", 16, 64, float("inf")))
        text = args.prompt_tokens or lengths
        try:
            lo, hi = (int(x) for x in text.split(","))
        except ValueError:
            raise InputError(f"--prompt-tokens must be MIN,MAX, got {text!r}") from None
        if not 1 <= lo <= hi:
            raise InputError(f"--prompt-tokens needs 1 <= MIN <= MAX, got {lo},{hi}")
        sc = {"name": name, "lengths": (lo, hi), "num_requests": args.num_requests or n,
              "max_tokens": args.max_tokens or m, "rate": args.rate if args.rate is not None else rate}
        if sc["num_requests"] < 1 or sc["max_tokens"] < 1:
            raise InputError("--num-requests and --max-tokens must be >= 1")
        if not sc["rate"] > 0:
            raise InputError(f"--rate must be > 0 (inf: all at once), got {sc['rate']}")
        out.append(sc)
    return out


def _serve_config(args, method: str, max_waiting: int):
    return GenerationConfig(method=method, gamma=args.gamma, draft_window=args.draft_window,
                            **budget_settings(args, tail=METHODS[method].policy in DUSTIN_POLICIES),
                            sparse_config=args.config, max_slots=args.max_slots, max_context=args.max_context,
                            prefill_chunk=args.prefill_chunk, prefill_tokens=args.prefill_tokens,
                            max_waiting=max_waiting, options=ExecutionOptions(draft_kernel=args.draft_kernel))


def _plan(args) -> dict:
    methods = method_list(args.methods)
    scenarios = _scenarios(args)
    for m in methods:  # bad methods and scheduling flags: one line before any model loads
        _serve_config(args, m, 1)
    return {"methods": methods, "scenarios": scenarios}


def make_prompts(tokenizer, kind: str, lengths: tuple[int, int], n: int, seed: int, vocab: int) -> list[list[int]]:
    """n prompts of token counts uniform in lengths, from real texts (or random ids)."""
    rng = random.Random(seed)
    sizes = [rng.randint(*lengths) for _ in range(n)]
    if kind == "random":
        return [[rng.randrange(3, vocab) for _ in range(s)] for s in sizes]
    if tokenizer is None:
        raise InputError("--prompts code/essays need the target's tokenizer; use --prompts random")
    texts = long_texts(kind, "heldout", lengths[1] + 64, tokenizer, n, seed)
    return [tokenizer.encode(t, add_special_tokens=False)[:s] for t, s in zip(texts, sizes, strict=False)]


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, delay: float, t0: float) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    chunks: list[tuple[float, int]] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids:
                chunks.append((time.perf_counter(), len(ids)))
    end = time.perf_counter()
    n = sum(c for _, c in chunks)
    return {"arrival": start - t0, "ttft": chunks[0][0] - start if chunks else None, "end": end - t0,
            "tokens": n, "prompt_tokens": len(prompt),
            "tpot": (end - chunks[0][0]) / (n - 1) if n > 1 else None,
            "itl": [b[0] - a[0] for a, b in zip(chunks, chunks[1:], strict=False)]}


def _load_in_process(conn, url: str, model: str, prompts: list[list[int]], max_tokens: int, rate: float,
                     seed: int) -> None:
    """`--client process`: `_load` in a process of its own; its result goes back through `conn`."""
    conn.send(asyncio.run(_load(url, model, prompts, max_tokens, rate, seed)))
    conn.close()


def load(url: str, model: str, prompts: list[list[int]], max_tokens: int, rate: float, seed: int, client: str,
         progress=None) -> tuple[list[dict], float]:
    """Send the scenario's requests from this process (client "thread") or from a spawned one ("process")."""
    if client == "thread":
        return asyncio.run(_load(url, model, prompts, max_tokens, rate, seed, progress))
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_load_in_process, args=(theirs, url, model, prompts, max_tokens, rate, seed),
                       daemon=True)
    proc.start()
    theirs.close()
    try:
        results, wall = mine.recv()
    except EOFError:
        proc.join()
        raise DustinError(f"the load-generating process ended without a result (exit code {proc.exitcode})") from None
    proc.join()
    if progress is not None:
        for _ in results:
            progress()
    return results, wall


async def _load(url: str, model: str, prompts: list[list[int]], max_tokens: int, rate: float, seed: int,
                progress=None) -> tuple[list[dict], float]:
    import httpx

    rng = random.Random(seed + 1)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def run(p, d):
            r = await _one(client, url, model, p, max_tokens, d, t0)
            if progress is not None:
                progress()
            return r
        results = await asyncio.gather(*(run(p, d) for p, d in zip(prompts, delays, strict=False)))
    return list(results), time.perf_counter() - t0


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)
    def pick(q):
        return s[min(len(s) - 1, int(q * len(s)))]
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(s) / len(s)}


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
            "output_tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
            "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
            "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
            "itl_s": percentiles([x for r in ok for x in r["itl"]]),
            "errors": sorted({r["error"] for r in results if "error" in r})[:5]}


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dustin.engine.core import EngineCore
    from dustin.engine.engine import Engine
    from dustin.serve.local import LocalServer

    p = _plan(args)
    speculative = any(METHODS[m].speculative for m in p["methods"])
    engine = Engine.from_pretrained(args.target, args.draft if speculative else None, device=args.device,
                                    dtype=args.dtype, attention=args.attention,
                                    rope_scaling=args.rope_scaling)
    work = {sc["name"]: make_prompts(engine.pair.tokenizer, args.prompts, sc["lengths"], sc["num_requests"], args.seed,
                                     engine.pair.vocab_limit) for sc in p["scenarios"]}
    bandwidth = _bandwidth(args.device)
    console = Console(stderr=True)
    rows = []
    for method in p["methods"]:
        waiting = max(sc["num_requests"] for sc in p["scenarios"])
        llm = EngineCore(engine.pair, _serve_config(args, method, waiting))
        # warm-up, untimed: the first steps compile the kernels and capture the step graph (one-time costs a
        # server pays once at start, not per scenario)
        first = work[p["scenarios"][0]["name"]]
        llm.generate(first[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for sc in p["scenarios"]:
            prompts = work[sc["name"]]
            for q in prompts:
                llm.check_request(q, SamplingParams(temperature=0, max_tokens=sc["max_tokens"]))
            row = {"method": method, "scenario": sc["name"], "num_requests": len(prompts),
                   "prompt_tokens": sum(map(len, prompts)), "max_tokens": sc["max_tokens"],
                   "rate": None if math.isinf(sc["rate"]) else sc["rate"]}
            with LocalServer(llm, "bench") as srv, Progress(
                    TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console) as progress:
                before = srv.async_engine.stats()
                bar = progress.add_task(f"{method} / {sc['name']}: requests", total=len(prompts))
                results, wall = load(srv.url, "bench", prompts, sc["max_tokens"], sc["rate"], args.seed,
                                     args.client, functools.partial(progress.advance, bar))
                stats = srv.async_engine.stats()
            row.update(summarize(results, wall))
            row["tau"], row["steps"] = stats.get("tau"), stats.get("steps_total", 0) - before.get("steps_total", 0)
            row["slots"], row["context"] = llm.max_slots, llm.max_context
            if not args.no_offline:  # the engine's own speed on the same work: Engine.generate, batched, warm
                cfg = GenerationConfig(method=method, gamma=args.gamma, draft_window=args.draft_window,
                                       **budget_settings(args, METHODS[method].policy != "full",
                                                         METHODS[method].policy in DUSTIN_POLICIES),
                                       sparse_config=args.config,
                                       options=ExecutionOptions(draft_kernel=args.draft_kernel))
                params = SamplingParams(temperature=0, max_tokens=sc["max_tokens"], ignore_eos=True)
                row.update(_offline(engine, prompts, cfg, params))
                row["server_vs_offline"] = row["offline_wall_s"] / row["wall_s"]
            if bandwidth:
                row.update(_roofline(engine, llm, method, prompts, sc["max_tokens"], row["tau"], bandwidth, args))
            rows.append(row)
        del llm
        engine.release_cached()
    data = {"settings": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
                         if k in ("target", "draft", "device", "dtype", "prompts", "scenario", "gamma",
                                  "draft_window", "budget", "config", "max_slots", "max_context", "prefill_chunk",
                                  "prefill_tokens", "seed", "client")},
            "copy_bandwidth_gb_s": None if not bandwidth else round(bandwidth / 1e9, 1), "results": rows}
    md = markdown(rows)
    print(md)
    if args.json_out:
        out = Path(args.json_out)
        out.write_text(json.dumps(data, indent=1))
        out.with_suffix(".md").write_text(md)
        plot(rows, out.with_suffix(".png"))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _offline(engine, prompts: list[list[int]], cfg, params) -> dict:
    """`Engine.generate` of all prompts at once, after one untimed call (compiles, graph capture)."""
    import torch

    engine.generate(prompts, cfg, params)
    if engine.pair.device.type == "cuda":
        torch.cuda.synchronize(engine.pair.device)
    t0 = time.perf_counter()
    r = engine.generate(prompts, cfg, params)
    if engine.pair.device.type == "cuda":
        torch.cuda.synchronize(engine.pair.device)
    wall = time.perf_counter() - t0
    tokens = sum(len(x.token_ids) for x in r.sequences)
    return {"offline_wall_s": wall, "offline_tokens_per_s": tokens / wall, "offline_prefill_s": r.prefill_s,
            "offline_tau": r.tau}


def _bandwidth(device: str) -> float | None:
    """The copy bandwidth the step roofline is computed with (GPU only: a CPU roofline means little here)."""
    if not device.startswith("cuda"):
        return None
    from dustin.bench.decode import copy_bandwidth

    return copy_bandwidth()


def _roofline(engine, llm, method: str, prompts, max_tokens: int, tau, bandwidth: float, args) -> dict:
    """Tokens/s of a step that only reads its bytes, at the batch the run decodes (all requests, at most the
    slots) and the mean context of its decode, with the measured τ."""
    from dustin.bench.roofline import step_bytes

    batch = min(len(prompts), llm.max_slots)
    ctx = sum(map(len, prompts)) // len(prompts) + max_tokens // 2
    pair = engine.pair
    b = step_bytes(method, pair.target, pair.draft, batch, ctx, args.gamma, draft_window=args.draft_window,
                   sparse_cfg=llm.runner.policy.cfg, target_args=pair.target_args)
    step_s = b.seconds(bandwidth)
    return {"roofline_ms_per_step": 1e3 * step_s, "roofline_tokens_per_s": batch * (tau or 1.0) / step_s}


def markdown(rows: list[dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{1000 * x:.0f}"

    lines = ["| scenario | method | server wall s | server tokens/s | Engine.generate wall s | Engine.generate "
             "tokens/s | server / Engine.generate | roofline tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL p50 / p99 ms | τ | failed |", "|---" * 13 + "|"]
    for r in rows:
        off = r.get("offline_wall_s")
        roof = r.get("roofline_tokens_per_s")
        ratio = "-" if off is None else f"{100 * r['server_vs_offline']:.0f}%"
        off_tps = "-" if off is None else f"{r['offline_tokens_per_s']:.0f}"
        ttft, tpot, itl = r["ttft_s"], r["tpot_s"], r["itl_s"]
        lines.append(f"| {r['scenario']} | {r['method']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{'-' if off is None else f'{off:.2f}'} | {off_tps} | "
                     f"{ratio} | "
                     f"{'-' if roof is None else f'{roof:.0f}'} | "
                     f"{ms(ttft['p50'])} / {ms(ttft['p99'])} | {ms(tpot['p50'])} / {ms(tpot['p99'])} | "
                     f"{ms(itl['p50'])} / {ms(itl['p99'])} | {r['tau'] or 0:.2f} | {r['failed']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """One row of panels per scenario: output tokens/s (server bar; offline and roofline marks), TTFT and TPOT
    p50 / p99 per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(len(scenarios), 3, figsize=(12, 3.4 * len(scenarios)), squeeze=False)
    for ax_row, sc in zip(axes, scenarios, strict=True):
        rs = [r for r in rows if r["scenario"] == sc]
        names = [r["method"] for r in rs]
        ax = ax_row[0]
        ax.bar(names, [r["tokens_per_s"] for r in rs], label="server")
        if all("offline_tokens_per_s" in r for r in rs):
            ax.plot(names, [r["offline_tokens_per_s"] for r in rs], "k_", ms=30, mew=2, label="Engine.generate")
        if all("roofline_tokens_per_s" in r for r in rs):
            ax.plot(names, [r["roofline_tokens_per_s"] for r in rs], "r_", ms=30, mew=2, label="byte roofline")
        ax.set_ylabel("output tokens/s")
        ax.set_title(sc, fontsize=9)
        ax.legend(fontsize=7)
        for ax, key, title in ((ax_row[1], "ttft_s", "TTFT (s)"), (ax_row[2], "tpot_s", "TPOT (s)")):
            for i, q in enumerate(("p50", "p99")):
                ax.bar([j + 0.4 * i for j in range(len(rs))], [r[key][q] or 0 for r in rs], width=0.4, label=q)
            ax.set_xticks([j + 0.2 for j in range(len(rs))], names)
            ax.set_title(f"{sc}: {title}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
