"""Semantic retrieval heads (paper Sec. 4.2.1, following CompressKV), found by needle-in-a-haystack trials.

A trial: a haystack of real essays with one needle fact inserted at a sentence boundary at some depth, the
prompt ending with the needle's question; greedy decoding of up to ~50 tokens. At every decoding step whose
generated token is one of the tokens of the needle span, each (layer, query head) adds its attention mass on
the whole span (the query that produced that token, over everything it sees). A trial counts only if it
retrieved the needle (ROUGE-1 recall of the answer > 0.5) and had at least one such step; a head's score is
its mean over the counted trials. The top heads of each layer (4, as in the paper) are that model's SRHs.

Trials of one context length run as a batch (ragged prompt lengths) on the engine core, greedy with the full
cache, the model verifying alone, with a `NeedleMassProbe` observing every layer; each finished trial is appended
to a JSONL file, so a run that stops resumes where it was.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from dustin.engine.config import ExecutionOptions, GenerationConfig
from dustin.engine.engine import Engine
from dustin.engine.request import SamplingParams
from dustin.errors import InputError
from dustin.eval.needles import make_needle_prompt, rouge1_recall
from dustin.profiling.observe import SpanMass
from dustin.selection.base import SelectionPolicy, StepState

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


class NeedleMassProbe(SelectionPolicy):
    """Full verification that records, at every token a row generates that is one of its needle span's tokens, each
    (layer, query head)'s attention mass on the span: the mass of the query that chose the token (for the first
    token, the prompt's last query, seen by the gang's prefill). Its state spans the batch (the rows' spans), so
    the engine runs it as a gang. total [B, L, H] and hits [B] accumulate on the device."""

    name = "needle-mass"

    def __init__(self, n_layers: int, n_heads: int, spans: torch.Tensor, needle: torch.Tensor) -> None:
        """spans: int [B, 2] = [start, end) per row; needle: bool [B, V], the tokens of each row's span."""
        self.obs = SpanMass(n_layers, n_heads, spans)
        self.needle = needle
        self.total = torch.zeros_like(self.obs.mass)
        self.hits = torch.zeros(spans.shape[0], dtype=torch.long, device=spans.device)
        self._first = True

    def target_observers(self, state: StepState):
        return [self.obs]

    def _count(self, state: StepState) -> None:
        """Book the mass of the forward that chose each running row's `pending` token, if it is a needle token."""
        rows = torch.arange(self.needle.shape[0], device=self.needle.device)
        hit = self.needle[rows, state.pending] & ~state.done
        self.total += self.obs.mass * hit[:, None, None]
        self.hits += hit

    def begin_step(self, state: StepState) -> None:
        if self._first:  # the first token, chosen by the prefill
            self._first = False
            self._count(state)

    def after_verify(self, state: StepState, n_accepted: torch.Tensor) -> None:
        self._count(state)


def run_needle_batch(engine, model, prompts, max_new_tokens: int):
    """Greedy decoding of a batch of `NeedlePrompt`s by `model` (the pair's target or draft) on the engine core,
    with every head's mass on the asked needle recorded (`NeedleMassProbe`). Returns (mass [B, L, H] summed over the
    steps that generated a needle token, hits [B], generated ids)."""
    a, dev = model.args, model.embed_tokens.weight.device
    spans = torch.tensor([p.spans[p.asked] for p in prompts], device=dev)
    needle = torch.zeros(len(prompts), engine.pair.vocab_limit, dtype=torch.bool, device=dev)
    for b, (p, (start, end)) in enumerate(zip(prompts, spans.tolist(), strict=True)):
        needle[b, p.ids[start:end]] = True
    probe = NeedleMassProbe(a.n_layers, a.n_heads, spans, needle)
    runner = engine if model is engine.pair.target else Engine.from_models(model, None, engine.pair.tokenizer)
    # each step read back before the next is launched, so that `done` masks every token past a row's stop
    cfg = GenerationConfig(method="vanilla", options=ExecutionOptions(overlap=False))
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0)
    out = runner.generate([p.ids for p in prompts], cfg, params, policy=probe)
    return probe.total, probe.hits.tolist(), [s.token_ids for s in out.sequences]


def run_srh(engine, role: str, out_dir: Path, contexts: list[int], depths: int, needles, haystacks: list[str],
            max_new_tokens: int = 50, batch_tokens: int = 1 << 18, progress=None) -> dict:
    """Run (or resume) the trials of one model of the pair and write srh_<role>.json; returns its content."""
    model = engine.pair.target if role == "target" else engine.pair.draft
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
            prompts = [make_needle_prompt(engine.pair.tokenizer, haystacks[n % len(haystacks)], c, [needles[n]], [d])
                       for d, n in chunk]
            mass, hits, gen = run_needle_batch(engine, model, prompts, max_new_tokens)
            with log.open("a") as f:
                for b, (d, n) in enumerate(chunk):
                    text = engine.pair.tokenizer.decode(gen[b], skip_special_tokens=True)
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

