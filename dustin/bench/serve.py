"""`dustin bench serve`: a load generator against `dustin serve`, per decoding method.

For each method the models load once, an `LLMEngine` of that method is served over HTTP in this process
(`serve/local.py`, the same app as `dustin serve`), and `--num-requests` streaming completions are sent with
Poisson arrivals (`--rate` requests/s; `inf` sends them all at once). Prompts are real long texts (code by
default: the standard library and installed packages; `essays` needs the data package) cut to token counts drawn
uniformly from `--prompt-tokens MIN,MAX`, or random ids (`random`, for checkpoints without a text tokenizer).
Every request asks for exactly `--max-tokens` greedy tokens (ignore_eos), so methods do the same work.

Reported per method: request and output-token throughput over the run, TTFT (arrival -> first streamed
token), TPOT (time per output token after the first, per request) and ITL (gap between stream chunks; a
speculative step sends several tokens in one chunk) at p50/p90/p99, τ and KV use from the server's metrics; and
the same prompts through the offline engine (`LLMEngine.generate`, all submitted at once, no HTTP) as the
reference throughput: the server should be within a few percent of it.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from pathlib import Path

from dustin.cli.args import add_model_args, add_sparse_args, add_speculation_args, method_list
from dustin.errors import InputError


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--methods", default="vanilla,magicdec,dustin", help="decoding methods, one server each")
    p.add_argument("--prompt-tokens", default="8192,32768", help="MIN,MAX prompt length in tokens (uniform)")
    p.add_argument("--prompts", default="code", choices=["code", "essays", "random"], help="prompt source")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=float("inf"), help="mean arrivals per second (Poisson); inf: all at once")
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request (EOS ignored)")
    add_speculation_args(p)
    add_sparse_args(p)
    p.add_argument("--max-slots", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--no-offline", action="store_true", help="skip the offline reference run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="results JSON (a .md table and a .png beside it)")


def _plan(args) -> dict:
    methods = method_list(args.methods)
    try:
        lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    except ValueError:
        raise InputError(f"--prompt-tokens must be MIN,MAX, got {args.prompt_tokens!r}") from None
    if not 1 <= lo <= hi:
        raise InputError(f"--prompt-tokens needs 1 <= MIN <= MAX, got {lo},{hi}")
    if args.num_requests < 1 or args.max_tokens < 1:
        raise InputError("--num-requests and --max-tokens must be >= 1")
    if not args.rate > 0:
        raise InputError(f"--rate must be > 0 (inf: all at once), got {args.rate}")
    from dustin.engine.llm_engine import ServeConfig

    for m in methods:  # offline-only methods and bad scheduling flags: one line before any model loads
        ServeConfig(method=m, gamma=args.gamma, draft_window=args.draft_window, budget=args.budget,
                    sparse_config=args.config, max_slots=args.max_slots, max_context=args.max_context, prefill_chunk=args.prefill_chunk)
    return {"methods": methods, "lengths": (lo, hi)}


def make_prompts(tokenizer, kind: str, lengths: tuple[int, int], n: int, seed: int, vocab: int) -> list[list[int]]:
    """n prompts of token counts uniform in lengths, from real texts (or random ids)."""
    rng = random.Random(seed)
    sizes = [rng.randint(*lengths) for _ in range(n)]
    if kind == "random":
        return [[rng.randrange(3, vocab) for _ in range(s)] for s in sizes]
    if tokenizer is None:
        raise InputError("--prompts code/essays need the target's tokenizer; use --prompts random")
    from dustin.data.corpora import long_texts

    texts = long_texts(kind, "heldout", lengths[1] + 64, tokenizer, n, seed)
    return [tokenizer.encode(t, add_special_tokens=False)[:s] for t, s in zip(texts, sizes)]


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
            "itl": [b[0] - a[0] for a, b in zip(chunks, chunks[1:])]}


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
        results = await asyncio.gather(*(run(p, d) for p, d in zip(prompts, delays)))
    return list(results), time.perf_counter() - t0


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]
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

    from dustin.engine.engine import Engine
    from dustin.engine.llm_engine import LLMEngine, ServeConfig
    from dustin.engine.request import RequestParams
    from dustin.engine.config import METHODS
    from dustin.serve.local import LocalServer

    p = _plan(args)
    speculative = any(METHODS[m].speculative for m in p["methods"])
    engine = Engine.from_pretrained(args.target, args.draft if speculative else None, device=args.device,
                                    dtype=args.dtype, attention=args.attention)
    prompts = make_prompts(engine.tokenizer, args.prompts, p["lengths"], args.num_requests, args.seed,
                           engine.vocab_limit)
    console = Console(stderr=True)
    rows = []
    for method in p["methods"]:
        cfg = ServeConfig(method=method, gamma=args.gamma, draft_window=args.draft_window, budget=args.budget,
                          sparse_config=args.config,
                          max_slots=args.max_slots, max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                          max_waiting=max(args.num_requests, 1))
        llm = LLMEngine(engine, cfg)
        for q in prompts:
            llm.check_request(q, RequestParams(max_tokens=args.max_tokens))
        row = {"method": method}
        with LocalServer(llm, "bench") as srv, Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console) as progress:
            bar = progress.add_task(f"{method}: requests", total=len(prompts))
            results, wall = asyncio.run(_load(srv.url, "bench", prompts, args.max_tokens, args.rate, args.seed,
                                              lambda: progress.advance(bar)))
            stats = srv.async_engine.stats()
        row.update(summarize(results, wall))
        row["tau"], row["steps"] = stats.get("tau"), stats.get("steps_total")
        row["slots"], row["context"] = llm.max_slots, llm.max_context
        if not args.no_offline:  # the same work without HTTP: all requests submitted at once
            ref = LLMEngine(engine, cfg)
            t0 = time.perf_counter()
            out = ref.generate(prompts, RequestParams(max_tokens=args.max_tokens, ignore_eos=True))
            off = time.perf_counter() - t0
            row["offline_tokens_per_s"] = sum(map(len, out)) / off
            row["server_vs_offline"] = row["tokens_per_s"] / row["offline_tokens_per_s"]
        rows.append(row)
        del llm
    data = {"settings": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
                         if k in ("target", "draft", "device", "dtype", "prompt_tokens", "prompts", "num_requests",
                                  "rate", "max_tokens", "gamma", "draft_window", "budget", "config", "max_slots", "max_context",
                                  "prefill_chunk", "seed")},
            "prompt_tokens": [len(q) for q in prompts], "results": rows}
    md = markdown(rows)
    print(md)
    if args.json_out:
        out = Path(args.json_out)
        out.write_text(json.dumps(data, indent=1))
        out.with_suffix(".md").write_text(md)
        plot(rows, out.with_suffix(".png"))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def markdown(rows: list[dict]) -> str:
    ms = lambda x: "-" if x is None else f"{1000 * x:.0f}"
    lines = ["| method | req/s | tokens/s | offline tokens/s | server / offline | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL p50 / p99 ms | τ | failed |", "|---" * 10 + "|"]
    for r in rows:
        off = r.get("offline_tokens_per_s")
        off_s = "-" if off is None else f"{off:.1f}"
        ratio = "-" if off is None else f"{100 * r['server_vs_offline']:.0f}%"
        ttft, tpot, itl = r["ttft_s"], r["tpot_s"], r["itl_s"]
        lines.append(f"| {r['method']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | {off_s} | {ratio} | "
                     f"{ms(ttft['p50'])} / {ms(ttft['p99'])} | {ms(tpot['p50'])} / {ms(tpot['p99'])} | "
                     f"{ms(itl['p50'])} / {ms(itl['p99'])} | {r['tau'] or 0:.2f} | {r['failed']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [r["method"] for r in rows]
    axes[0].bar(names, [r["tokens_per_s"] for r in rows], label="server")
    if all("offline_tokens_per_s" in r for r in rows):
        axes[0].plot(names, [r["offline_tokens_per_s"] for r in rows], "k_", ms=30, mew=2, label="offline")
    axes[0].set_ylabel("output tokens/s")
    axes[0].legend(fontsize=7)
    for ax, key, title in ((axes[1], "ttft_s", "TTFT (s)"), (axes[2], "tpot_s", "TPOT (s)")):
        for i, q in enumerate(("p50", "p99")):
            ax.bar([j + 0.4 * i for j in range(len(rows))], [r[key][q] or 0 for r in rows], width=0.4, label=q)
        ax.set_xticks([j + 0.2 for j in range(len(rows))], names)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
