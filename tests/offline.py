"""A test shorthand for offline batches: `Engine.generate(prompts, *offline(method=..., max_new_tokens=8))`.

One set of keywords, split into the engine's settings (`GenerationConfig`) and the batch's one `SamplingParams`
(greedy and 128 tokens unless a test says otherwise: the settings most tests compare methods under). The engine
itself has one source of sampling defaults, `SamplingParams`; this only spares each test the split."""
from __future__ import annotations

import torch

from dustin.engine.config import GenerationConfig
from dustin.engine.request import SamplingParams


def offline(*, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
            stop_at_eos: bool = True, **engine) -> tuple[GenerationConfig, SamplingParams]:
    return GenerationConfig(**engine), SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                                      top_p=top_p, top_k=top_k, ignore_eos=not stop_at_eos)


def random_prompts(lengths, seed: int) -> list[list[int]]:
    """Prompts of random token ids in [3, 96) (the tiny pair's ordinary tokens), one per length, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]
