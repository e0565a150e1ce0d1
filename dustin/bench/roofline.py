"""The byte roofline of a decode step: the bytes a step of each method must read from GPU memory.

Decoding at these batch sizes is memory-bound, so a step can be no faster than (bytes it must read) / (copy
bandwidth). The benchmarks report measured time against this floor ("% of byte roofline"). What a step reads:

- vanilla:   target weights + the target's whole KV cache;
- classic:   Γ draft forwards (draft weights + the draft's whole KV cache, each) + the verify forward (target
             weights + whole target KV);
- magicdec:  the same, with each draft forward reading only its streaming window (sinks + recent);
- streaming, dustin*: streaming draft + a verify forward over k selected positions per sequence, plus for
             dustin the estimation: the keys of every (layer, KV head) that holds a score head, over the whole
             context, for the target's and the draft's score heads (one pass each per step);
- quest:     streaming draft + a verify forward over k positions per KV head in each layer but the first two
             (dense, Quest's practice), plus the page statistics those layers' scoring reads (min and max
             keys of every 16-position page: 1/16 of the K+V bytes);
- specattn:  streaming draft + a verify forward over k positions, plus the keys of every draft layer and KV
             head over the whole context (its per-layer estimate reads them all).

Weights count every parameter a forward reads: the input embedding is a gather of a few rows, so it counts only
when tied to the LM head (which reads all of it). Activations, logits and score buffers are left out: at
B * (Γ+1) <= 256 rows they are a few MB against GBs. Under tensor parallelism pass the rank's shard (its model
args and weights): the roofline is per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dustin.defaults import DRAFT_WINDOW
from dustin.engine.config import METHODS
from dustin.kernels.quest import PAGE_SIZE
from dustin.selection.config import DUSTIN_POLICIES
from dustin.selection.layerwise import QUEST_DENSE_LAYERS


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters one forward reads (the untied input embedding excluded: a gather of rows)."""
    tied = model.args.tie_word_embeddings
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if n != "embed_tokens.weight" or tied)


def score_key_bytes(heads, args, batch: int, context: int, elem: int) -> int:
    """Keys an estimator reads per step: every (layer, KV head) holding a score head, over `context` positions.
    heads: ScoreHeads entries (global query-head indices); args: the model's (global) shape."""
    group = args.n_heads // args.n_kv_heads
    pairs = {(sh.layer, h // group) for sh in heads for h in sh.heads}
    return len(pairs) * batch * context * args.head_dim * elem


@dataclass(frozen=True)
class StepBytes:
    target: int  # verify (or decode) forward: weights + the KV rows it reads
    draft: int  # the Γ draft forwards
    estimate: int  # score heads' keys (dustin)

    @property
    def total(self) -> int:
        return self.target + self.draft + self.estimate

    def seconds(self, bandwidth: float) -> float:
        return self.total / bandwidth


def step_bytes(method: str, target, draft, batch: int, context: int, gamma: int, *, draft_window: int = DRAFT_WINDOW,
               sparse_cfg=None, target_args=None) -> StepBytes:
    """Bytes one step of `method` must read (see the module docstring). target/draft: the models (the rank's
    target shard under tensor parallelism); sparse_cfg: the SparseConfig of a sparse method (k, score heads);
    target_args: the target's global shape, which the score heads' indices refer to (default target.args)."""
    spec = METHODS[method]
    elem = target.embed_tokens.weight.element_size()
    t_kv = target.args.kv_bytes_per_token(elem)
    if spec.policy == "full":
        t_rows = context
    else:
        t_rows = min(context, sparse_cfg.budget) + gamma + 1
    tgt = weight_bytes(target) + batch * t_rows * t_kv
    est = 0
    per_layer = t_kv // target.args.n_layers
    if spec.policy == "quest":  # the dense first layers read everything; the others' pages are scored
        dense = min(QUEST_DENSE_LAYERS, target.args.n_layers)
        tgt += batch * dense * per_layer * (context - t_rows)
        est += batch * (target.args.n_layers - dense) * per_layer * -(-context // PAGE_SIZE)
    if not spec.speculative:
        return StepBytes(tgt, 0, 0)
    d_rows = context if spec.draft_kv == "full" else min(context, draft_window)
    drf = gamma * (weight_bytes(draft) + batch * d_rows * draft.args.kv_bytes_per_token(elem))
    if spec.policy == "specattn":  # every draft layer's keys (half its K+V), whole context
        est += batch * context * draft.args.kv_bytes_per_token(elem) // 2
    if spec.policy in DUSTIN_POLICIES and sparse_cfg is not None:
        t_args = target_args or target.args
        world = t_args.n_kv_heads // target.args.n_kv_heads  # rank's share of the target's score-head keys
        if spec.policy != "dustin-d":
            est += score_key_bytes(sparse_cfg.target, t_args, batch, context, elem) // max(world, 1)
        if spec.policy != "dustin-t":
            est += score_key_bytes(sparse_cfg.draft, draft.args, batch, context, elem)
    return StepBytes(tgt, drf, est)
