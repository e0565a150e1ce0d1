"""The index plan of one packed prefill forward (`PrefillPlan`): which cache rows and positions its chunks fill,
and the tile list the packed prefill kernel (prefill_attention.py) runs over.

It lives with the kernel that reads it and imports no Triton, so the forward context above it
(dustin/attention/context.py) carries it on machines without Triton too."""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_M = 64  # query rows per program of the packed prefill kernel: a plan's tile list is built for it


@dataclass
class PrefillPlan:
    """Index metadata of one packed prefill forward (built once, shared by every layer).

    rows/q_start/lengths/pos0: int32 [C] per chunk (cache row, offset in the packed tokens, tokens, cached
    positions before it); tile_chunk/tile_block: int32 [NT], the (chunk, query block) of each program;
    n_tokens: real packed tokens (the forward may carry padding past them); token_rows/token_pos: int64 [n_tokens],
    the cache row and position of each real token (the cache write); last: int64 [C], the packed index of each
    chunk's last token; host: (row, pos0, len) per chunk, for the CPU path and for callers; row_ids / row_last:
    each distinct row once, with the packed index of its last token here (what a per-row write of "the last
    prompt query" must use: writing per chunk would hand one row two values, and which one a GPU scatter keeps
    is undefined)."""

    rows: torch.Tensor
    q_start: torch.Tensor
    lengths: torch.Tensor
    pos0: torch.Tensor
    tile_chunk: torch.Tensor
    tile_block: torch.Tensor
    n_tokens: int
    token_rows: torch.Tensor
    token_pos: torch.Tensor
    last: torch.Tensor
    host: tuple[tuple[int, int, int], ...]
    block_m: int = BLOCK_M
    # each distinct row's last token in this forward (a row may bring consecutive chunks): int64 [R] each
    row_ids: torch.Tensor | None = None
    row_last: torch.Tensor | None = None

    @classmethod
    def build(cls, chunks: list[tuple[int, int, int]], device, block_m: int = BLOCK_M) -> "PrefillPlan":
        """chunks: (cache row, cached positions before the chunk, chunk tokens), packed in this order. All index
        arrays are assembled on the host and sent in one copy (no device sync)."""
        if not chunks or any(n < 1 or p < 0 for _, p, n in chunks):
            raise ValueError(f"a prefill plan needs chunks of >= 1 token at positions >= 0, got {chunks}")
        C = len(chunks)
        rows = torch.tensor([r for r, _, _ in chunks], dtype=torch.long)
        pos0 = torch.tensor([p for _, p, _ in chunks], dtype=torch.long)
        lens = torch.tensor([n for _, _, n in chunks], dtype=torch.long)
        ends = lens.cumsum(0)
        starts = ends - lens
        blocks = (lens + block_m - 1) // block_m
        tile_chunk = torch.repeat_interleave(torch.arange(C), blocks)
        tile_block = torch.arange(len(tile_chunk)) - torch.repeat_interleave(blocks.cumsum(0) - blocks, blocks)
        # the longest tiles (most keys: far into a long prompt) first, so the short ones fill the last wave
        order = torch.argsort(pos0[tile_chunk] + tile_block * block_m, descending=True, stable=True)
        tile_chunk, tile_block = tile_chunk[order], tile_block[order]
        n = int(ends[-1])
        token_rows = torch.repeat_interleave(rows, lens)
        token_pos = torch.arange(n) - torch.repeat_interleave(starts - pos0, lens)
        final = {r: e - 1 for (r, _, _), e in zip(chunks, ends.tolist(), strict=True)}  # a later chunk wins
        row_ids = torch.tensor(list(final), dtype=torch.long)
        row_last = torch.tensor(list(final.values()), dtype=torch.long)
        host = torch.cat([rows, starts, lens, pos0, tile_chunk, tile_block, token_rows, token_pos, ends - 1, row_ids,
                          row_last])
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        nt = len(tile_chunk)
        nr = len(final)
        sizes = [C, C, C, C, nt, nt, n, n, C, nr, nr]
        r, st, ln, p0, tc, tb, trow, tpos, last, rid, rlast = dev.split(sizes)
        i32 = torch.int32
        return cls(r.to(i32), st.to(i32), ln.to(i32), p0.to(i32), tc.to(i32), tb.to(i32), n, trow, tpos, last,
                   tuple(chunks), block_m, rid, rlast)
