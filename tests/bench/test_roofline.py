"""The byte roofline (dustin/bench/roofline.py) against bytes counted by hand on small shapes."""
from __future__ import annotations

from dataclasses import replace

import torch

from dustin.bench.roofline import score_key_bytes, step_bytes, weight_bytes
from dustin.models.args import named_config
from dustin.models.loader import random_model
from dustin.selection.config import ScoreHeads, SparseConfig


def _pair():
    t_args = replace(named_config("qwen2.5-0.5b"), n_layers=3, vocab_size=1000, dim=128, intermediate_size=256,
                     n_heads=4, n_kv_heads=2, head_dim=32)
    d_args = replace(t_args, n_layers=2, n_heads=2, n_kv_heads=1)
    return random_model(t_args, "cpu", torch.bfloat16), random_model(d_args, "cpu", torch.bfloat16)


def test_weight_bytes_counts_a_tied_embedding_once_and_an_untied_one_not_at_all():
    t, _ = _pair()
    a = t.args
    per_layer = 2 * (a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
                     + a.n_heads * a.head_dim * a.dim + 3 * a.dim * a.intermediate_size + 2 * a.dim)
    head = 2 * (a.vocab_size * a.dim + a.dim)  # tied: the LM head reads the embedding matrix; + the final norm
    assert a.tie_word_embeddings and weight_bytes(t) == a.n_layers * per_layer + head


def test_step_bytes_by_method():
    t, d = _pair()
    B, ctx, gamma, window = 3, 1000, 4, 64
    t_kv, d_kv = t.args.kv_bytes_per_token(2), d.args.kv_bytes_per_token(2)
    wt, wd = weight_bytes(t), weight_bytes(d)
    assert step_bytes("vanilla", t, d, B, ctx, gamma).total == wt + B * ctx * t_kv
    classic = step_bytes("classic", t, d, B, ctx, gamma)
    assert (classic.target, classic.draft, classic.estimate) == (wt + B * ctx * t_kv, gamma * (wd + B * ctx * d_kv), 0)
    magic = step_bytes("magicdec", t, d, B, ctx, gamma, draft_window=window)
    assert magic.draft == gamma * (wd + B * window * d_kv)
    # dustin: k + Γ + 1 target rows, plus the keys of each (layer, KV head) holding a score head, once
    cfg = SparseConfig(target=(ScoreHeads(1, (0, 1)),), draft=(ScoreHeads(0, (0,)), ScoreHeads(1, (0, 1))),
                       budget=128, draft_topm=32)
    du = step_bytes("dustin", t, d, B, ctx, gamma, draft_window=window, sparse_cfg=cfg)
    assert du.target == wt + B * (128 + gamma + 1) * t_kv
    # target heads 0 and 1 share KV head 0 (group 2); the draft's three heads sit on its one KV head in 2 layers
    assert du.estimate == B * ctx * 32 * 2 * (1 + 2)
    assert score_key_bytes(cfg.draft, d.args, B, ctx, 2) == 2 * B * ctx * 32 * 2
    dt = step_bytes("dustin-t", t, d, B, ctx, gamma, draft_window=window, sparse_cfg=cfg)
    dd = step_bytes("dustin-d", t, d, B, ctx, gamma, draft_window=window, sparse_cfg=cfg)
    assert (dt.estimate, dd.estimate) == (B * ctx * 32 * 2, 2 * B * ctx * 32 * 2)
    assert step_bytes("streaming", t, d, B, ctx, gamma, draft_window=window, sparse_cfg=cfg).estimate == 0
    # a context below k reads the whole context
    assert step_bytes("dustin", t, d, B, 50, gamma, sparse_cfg=cfg).target == wt + B * (50 + gamma + 1) * t_kv


def test_step_bytes_of_the_per_layer_baselines():
    """quest: layers 0-1 dense, the other layer's k rows per KV head plus its pages' min/max keys (2 x D per
    16 positions per KV head); specattn: k rows plus every draft layer's keys over the whole context."""
    t, d = _pair()  # target: 3 layers, 2 KV heads, D 32; draft: 2 layers, 1 KV head
    B, ctx, gamma, window = 3, 1000, 4, 64
    cfg = SparseConfig(target=(), draft=(), budget=128, draft_topm=32)
    wt, wd = weight_bytes(t), weight_bytes(d)
    per_layer = 2 * 2 * 32 * 2  # K + V of one layer, one token, bf16
    q = step_bytes("quest", t, d, B, ctx, gamma, draft_window=window, sparse_cfg=cfg)
    assert q.target == wt + B * (2 * ctx + 1 * (128 + gamma + 1)) * per_layer
    assert q.estimate == B * 1 * 2 * (2 * 32 * 2) * 63  # 63 pages of 16 cover 1000 positions
    assert q.draft == gamma * (wd + B * window * d.args.kv_bytes_per_token(2))
    s = step_bytes("specattn", t, d, B, ctx, gamma, draft_window=window, sparse_cfg=cfg)
    assert s.target == wt + B * (128 + gamma + 1) * 3 * per_layer
    assert s.estimate == B * ctx * 2 * 1 * 32 * 2
