"""GPU check of the serving core (EngineCore): continuous batching on CUDA with graphs and chunked prefill gives
each request the tokens of its own offline generation (bf16: near-ties may flip; the count is reported), and
the engine's steady-state throughput next to the offline engine's on the same work.

    PYTHONPATH=. python3 scripts/gpu_serve_check.py [fp32] [methods...]  # random Qwen2.5-0.5B-shaped pair
"""
from __future__ import annotations

import random
import time

import torch

from dustin.attention.backend import AttentionBackend
from dustin.engine.config import GenerationConfig
from dustin.engine.core import EngineCore
from dustin.engine.engine import Engine
from dustin.engine.request import SamplingParams
from dustin.models.args import named_config
from dustin.models.loader import random_model


def main() -> None:
    import sys

    dtype = torch.float32 if "fp32" in sys.argv else torch.bfloat16
    methods = [m for m in sys.argv[1:] if m != "fp32"] or ["classic", "magicdec", "dustin", "vanilla"]
    backend = AttentionBackend.for_device("cuda")
    a = named_config("qwen2.5-0.5b")
    eng = Engine.from_models(random_model(a, "cuda", dtype, seed=0, backend=backend),
                             random_model(a, "cuda", dtype, seed=1, backend=backend))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 150000) for _ in range(rng.randrange(300, 3000))] for _ in range(10)]
    new = 48
    for method in methods:
        kw = {"budget": 256} if method == "dustin" else {}
        t0 = time.perf_counter()
        ref = [eng.generate([p], GenerationConfig(method=method, max_new_tokens=new, stop_at_eos=False, **kw))
               .sequences[0].token_ids for p in prompts]
        t_ref = time.perf_counter() - t0
        llm = EngineCore(eng.pair, GenerationConfig(method=method, max_slots=4, max_context=4096, prefill_chunk=1024,
                                                    **kw))
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # capture the graphs
        t0 = time.perf_counter()
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        torch.cuda.synchronize()
        t_llm = time.perf_counter() - t0
        same = sum(o == r for o, r in zip(out, ref, strict=True))
        prefix = [next((i for i, (x, y) in enumerate(zip(o, r, strict=False)) if x != y), len(r))
                  for o, r in zip(out, ref, strict=True)]
        st = llm.stats()
        print(f"{method:9s} same {same}/{len(prompts)} first-diff {prefix}  tau {st['tau']:.2f}  "
              f"llm {t_llm:.2f}s ({len(prompts) * new / t_llm:.0f} tok/s)  one-by-one offline {t_ref:.2f}s", flush=True)
        assert all(len(o) == new for o in out)


if __name__ == "__main__":
    main()
