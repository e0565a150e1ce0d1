"""The prefill-heavy burst of docs/serving.md, offline and through the serving engine, on one GPU.

16 prompts of 8,000-19,250 tokens (real code with the real pair, random ids with random weights of the pair's
shapes), 64 greedy tokens each (EOS ignored), 16 slots of 24,576 positions:
- `Engine.generate` of all 16 at once, warm (one untimed call first), timed `--repeats` times;
- `EngineCore.generate` (the serving engine without HTTP) on the same prompts, warm, timed;
- with --http: the same burst as 16 concurrent streaming `/v1/completions` requests to a live `dustin serve` app
  in this process, `--bursts` times, plus each request sent alone: wall time, and whether the token ids are
  identical across bursts and equal to the request sent alone and to `Engine.generate`.
Writes one JSON to --out.

    PYTHONPATH=. python3 scripts/gpu_serving_bench.py --out $OUT/serving_burst.json [--real] [--http]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch


def _digest(seqs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(seqs).encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--methods", default="dustin,vanilla")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server", action="store_true", help="also EngineCore.generate on the same prompts")
    ap.add_argument("--server-repeats", type=int, default=1)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--http", action="store_true")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--lengths", default="8000,19250", help="MIN,MAX prompt tokens (decode-heavy: 2048,2048)")
    a = ap.parse_args()

    from dustin.bench.serve import make_prompts
    from dustin.engine.config import GenerationConfig
    from dustin.engine.engine import Engine

    lengths = tuple(int(x) for x in a.lengths.split(","))
    if a.real:
        eng = Engine.from_pretrained("default", "default", device="cuda", dtype=a.dtype)
        prompts = make_prompts(eng.pair.tokenizer, "code", lengths, 16, 0, eng.pair.vocab_limit)
    else:
        from dustin.bench.e2e import build_engine
        from dustin.models.args import named_config

        eng = build_engine(named_config("qwen2.5-1.5b"), named_config("qwen2.5-0.5b"), "cuda", dtype=a.dtype)
        prompts = make_prompts(None, "random", lengths, 16, 0, eng.pair.vocab_limit)
    n_prompt = sum(len(p) for p in prompts)
    report = {"real": a.real, "dtype": a.dtype, "prompt_tokens": n_prompt, "prompt_lens": [len(p) for p in prompts],
              "max_tokens": a.max_tokens, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "methods": {}}
    print(f"16 prompts, {n_prompt} prompt tokens, {a.max_tokens} new tokens each", flush=True)
    for method in a.methods.split(","):
        row: dict = {}
        cfg = GenerationConfig(method=method, max_new_tokens=a.max_tokens, stop_at_eos=False)
        t0 = time.perf_counter()
        r = eng.generate(prompts, cfg)
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        walls = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            r = eng.generate(prompts, cfg)
            torch.cuda.synchronize()
            walls.append(round(time.perf_counter() - t0, 3))
        offline = [s.token_ids for s in r.sequences]
        row["offline"] = {"wall_s": walls, "prefill_s": round(r.prefill_s, 3), "decode_s": round(r.decode_s, 3),
                          "tau": round(r.tau, 3), "prefill_tok_per_s": round(n_prompt / r.prefill_s),
                          "tokens_digest": _digest(offline)}
        row["offline"]["tokens_per_s"] = round(16 * a.max_tokens / min(walls), 1)
        print(method, "offline", row["offline"], flush=True)
        if a.server or a.http:
            from dustin.engine.config import GenerationConfig
            from dustin.engine.core import EngineCore
            from dustin.engine.request import SamplingParams

            kw = {} if a.prefill_chunk is None else {"prefill_chunk": a.prefill_chunk}
            eng.release_cached()
            llm = EngineCore(eng.pair, GenerationConfig(method=method, max_slots=16, max_context=24576, **kw))
            params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # capture, compile
            walls = []
            for _ in range(a.server_repeats):
                t0 = time.perf_counter()
                out = llm.generate(prompts, params)
                torch.cuda.synchronize()
                walls.append(round(time.perf_counter() - t0, 3))
            row["llm_engine"] = {"wall_s": walls, "decode_tokens_per_s": round(16 * a.max_tokens / min(walls), 1),
                                 "prefill_chunk": llm.config.prefill_chunk,
                                 "equal_to_offline": sum(o == f for o, f in zip(out, offline, strict=True)),
                                 "tokens_digest": _digest(out), "steps": llm.stats()["steps_total"]}
            print(method, "llm_engine", row["llm_engine"], flush=True)
            if a.http:
                row["http"] = _http_bursts(llm, prompts, a, offline)
                print(method, "http", row["http"], flush=True)
            del llm
            torch.cuda.empty_cache()
        report["methods"][method] = row
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


def _http_bursts(llm, prompts, a, offline) -> dict:
    """The burst as concurrent streaming HTTP requests (token ids as prompts), `a.bursts` times, then each alone."""
    import asyncio

    import httpx

    from dustin.serve.local import LocalServer

    async def one(client, url, p):
        body = {"model": llm.model_name, "prompt": p, "max_tokens": a.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        ids = []
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return ids

    async def burst(url, ps):
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, url, p) for p in ps))

    res: dict = {"burst_wall_s": [], "texts_digest": []}
    with LocalServer(llm, llm.model_name) as server:
        url = server.url
        texts = []
        for _ in range(a.bursts):
            t0 = time.perf_counter()
            t = asyncio.run(burst(url, prompts))
            res["burst_wall_s"].append(round(time.perf_counter() - t0, 3))
            res["tokens_per_s"] = round(len(prompts) * a.max_tokens / res["burst_wall_s"][-1], 1)
            texts.append(t)
        alone = [asyncio.run(burst(url, [p]))[0] for p in prompts]
    same = sum(all(t[i] == texts[0][i] for t in texts) for i in range(len(prompts)))
    res["identical_across_bursts"] = same
    res["equal_to_alone"] = sum(texts[0][i] == alone[i] for i in range(len(prompts)))
    res["equal_to_offline"] = sum(texts[0][i] == offline[i] for i in range(len(prompts)))
    return res


if __name__ == "__main__":
    main()
