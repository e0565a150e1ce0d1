"""Semantic retrieval heads (paper Sec. 4.2.1, following CompressKV), found by needle-in-a-haystack trials.

A trial: a haystack of real essays with one needle fact inserted at a sentence boundary at some depth, the
prompt ending with the needle's question; greedy decoding of up to ~50 tokens. At every decoding step whose
generated token is one of the tokens of the needle span, each (layer, query head) adds its attention mass on
the whole span (the query that produced that token, over everything it sees). A trial counts only if it
retrieved the needle (ROUGE-1 recall of the answer > 0.5) and had at least one such step; a head's score is
its mean over the counted trials. The top heads of each layer (4, as in the paper) are that model's SRHs.

Trials of one context length run as a batch (ragged prompt lengths) through the model's own forward with a
`SpanMass` observer on every layer; each finished trial is appended to a JSONL file, so a run that stops
resumes where it was.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from dustin.attention.context import ForwardContext
from dustin.cache.kv_cache import KVCache
from dustin.errors import InputError
from dustin.profiling.observe import SpanMass

TOP_HEADS = 4  # SRHs kept per layer (the paper's choice)
RETRIEVED = 0.5  # ROUGE-1 recall of the answer above which a trial retrieved the needle


def default_contexts(max_tokens: int, n: int = 20, low: int = 1024) -> list[int]:
    """n prompt lengths from `low` to `max_tokens`, evenly spaced in log scale, multiples of 64."""
    if max_tokens < low:
        return [max_tokens]
    ratio = (max_tokens / low) ** (1 / max(n - 1, 1))
    return sorted({min(max_tokens, round(low * ratio ** i / 64) * 64) for i in range(n)})


def trial_key(context: int, depth: float, needle: int) -> str:
    return f"{context}/{depth:.3f}/{needle}"


@torch.inference_mode()
def run_needle_batch(model, prompts, max_new_tokens: int, eos_ids: set[int], vocab_limit: int):
    """Greedy decoding of a batch of `NeedlePrompt`s with every head's mass on the asked needle recorded.
    Returns (mass [B, L, H] summed over the steps that generated a needle token, hits [B], generated ids)."""
    a, dev = model.args, model.embed_tokens.weight.device
    B, dtype = len(prompts), model.embed_tokens.weight.dtype
    lengths = [p.n_tokens for p in prompts]
    cache = KVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, max(lengths) + max_new_tokens + 1, dtype, dev)
    spans = torch.tensor([p.spans[p.asked] for p in prompts], device=dev)
    obs = SpanMass(a.n_layers, a.n_heads, spans)
    needle_tokens = [set(p.ids[s:e]) for p, (s, e) in zip(prompts, spans.tolist(), strict=True)]
    total = torch.zeros(B, a.n_layers, a.n_heads, dtype=torch.float32, device=dev)
    hits, out, done = [0] * B, [[] for _ in prompts], [False] * B
    first = []
    for b, p in enumerate(prompts):  # prefill one sequence at a time (its last query is observed)
        n = p.n_tokens
        pos = torch.arange(n, device=dev)[None]
        ctx = ForwardContext(cache, pos, torch.zeros(1, dtype=torch.int32, device=dev), n, rows=slice(b, b + 1),
                             fresh=True, observers=[obs])
        logits = model(torch.tensor(p.ids, device=dev)[None], ctx, logits_at=torch.tensor([n - 1], device=dev))
        first.append(logits[:, :vocab_limit].argmax(-1))
    tok = torch.cat(first)
    cache.lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
    for step in range(max_new_tokens):
        host = tok.tolist()
        hit = torch.tensor([not done[b] and host[b] in needle_tokens[b] for b in range(B)], device=dev)
        total += obs.mass * hit[:, None, None]
        for b, t in enumerate(host):
            if not done[b]:
                hits[b] += int(hit[b])
                out[b].append(t)
                done[b] = t in eos_ids
        if all(done) or step == max_new_tokens - 1:
            break
        L = cache.lengths
        ctx = ForwardContext(cache, L.long()[:, None], L, int(max(lengths)) + step + 1, observers=[obs])
        tok = model(tok[:, None], ctx)[:, 0, :vocab_limit].argmax(-1)
        cache.lengths.add_(1)
    return total, hits, out


def run_srh(engine, role: str, out_dir: Path, contexts: list[int], depths: int, needles, haystacks: list[str],
            max_new_tokens: int = 50, batch_tokens: int = 1 << 18, progress=None) -> dict:
    """Run (or resume) the trials of one model of the pair and write srh_<role>.json; returns its content."""
    from dustin.eval.needles import make_needle_prompt, rouge1_recall

    model = engine.target if role == "target" else engine.draft
    if model is None:
        raise InputError(f"SRH profiling of the {role} needs a {role} model")
    log = out_dir / f"srh_{role}_trials.jsonl"
    done = {json.loads(line)["key"] for line in log.read_text().splitlines()} if log.is_file() else set()
    depth_list = [i / max(depths - 1, 1) for i in range(depths)]
    todo = [(c, d, n) for c in contexts for n in range(len(needles)) for d in depth_list
            if trial_key(c, d, n) not in done]
    task = progress.add_task(f"SRH trials ({role})", total=len(todo)) if progress else None
    for c in contexts:
        group = [(d, n) for (cc, d, n) in todo if cc == c]
        per_batch = max(1, batch_tokens // c)
        for i in range(0, len(group), per_batch):
            chunk = group[i:i + per_batch]
            prompts = [make_needle_prompt(engine.tokenizer, haystacks[n % len(haystacks)], c, [needles[n]], [d])
                       for d, n in chunk]
            mass, hits, gen = run_needle_batch(model, prompts, max_new_tokens, engine.eos_ids, engine.vocab_limit)
            with log.open("a") as f:
                for b, (d, n) in enumerate(chunk):
                    text = engine.tokenizer.decode(gen[b], skip_special_tokens=True)
                    rec = {"key": trial_key(c, d, n), "context": c, "prompt_tokens": prompts[b].n_tokens,
                           "depth": d, "needle": n, "prediction": text, "answer": needles[n].answer,
                           "rouge1_recall": rouge1_recall(text, needles[n].answer), "hits": hits[b],
                           "mass": [[round(x, 5) for x in row] for row in mass[b].tolist()]}
                    f.write(json.dumps(rec) + "\n")
            if progress:
                progress.advance(task, len(chunk))
    trials = [json.loads(line) for line in log.read_text().splitlines()]
    result = summarize(trials, model.args.n_layers, model.args.n_heads)
    result.update({"role": role, "contexts": contexts, "depths": depths, "needles": [n.fact for n in needles],
                   "max_new_tokens": max_new_tokens})
    (out_dir / f"srh_{role}.json").write_text(json.dumps(result, indent=1))
    return result


def summarize(trials: list[dict], n_layers: int, n_heads: int, top: int = TOP_HEADS) -> dict:
    """Head scores = mean mass over the counted trials; the top heads of each layer by score."""
    counted = [t for t in trials if t["rouge1_recall"] > RETRIEVED and t["hits"] > 0]
    scores = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for t in counted:
        scores += torch.tensor(t["mass"], dtype=torch.float64)
    scores /= max(len(counted), 1)
    by_context: dict[int, list[float]] = {}
    for t in trials:
        by_context.setdefault(t["context"], []).append(float(t["rouge1_recall"] > RETRIEVED))
    return {"trials": len(trials), "counted": len(counted),
            "retrieval_by_context": {str(c): sum(v) / len(v) for c, v in sorted(by_context.items())},
            "scores": [[round(float(x), 6) for x in row] for row in scores],
            "top_heads": {str(layer): top_heads(scores[layer], top) for layer in range(n_layers)}}


def top_heads(row: torch.Tensor, k: int = TOP_HEADS) -> list[int]:
    """The k best heads of a layer, ascending by index (ties broken by the lower index)."""
    order = sorted(range(row.numel()), key=lambda h: (-float(row[h]), h))
    return sorted(order[:min(k, row.numel())])


def load_srh(path: Path) -> dict[int, list[int]]:
    """layer -> SRH query heads, from an srh_<role>.json."""
    if not path.is_file():
        raise InputError(f"{path} does not exist: run `dustin profile srh` first")
    try:
        raw = json.loads(path.read_text())
        heads = {int(k): [int(h) for h in v] for k, v in raw["top_heads"].items()}
        counted = int(raw["counted"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise InputError(f"{path} is malformed ({e})") from None
    if counted == 0:
        raise InputError(f"{path}: no trial retrieved its needle, so no head scored: profile at contexts the "
                         f"model can answer (--contexts) or with more --srh-max-new-tokens")
    return heads


def shuffled_haystacks(essays: list[str], count: int, seed: int) -> list[str]:
    """`count` haystack texts, each the essays in its own seeded order (different text around each needle)."""
    if not essays:
        raise InputError("no haystack essays available")
    out = []
    for i in range(count):
        order = list(essays)
        random.Random(seed * 1000 + i).shuffle(order)
        out.append("\n\n".join(order))
    return out

