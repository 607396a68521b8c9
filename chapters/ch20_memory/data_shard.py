"""Each rank's shard of the course's regression data, built without the other ranks' rows.

`common.data.regression_data` draws the whole data set, every rank's rows, on every rank. These
functions draw the same numbers from the same generator stream but keep only this rank's rows,
bit for bit.
"""

from __future__ import annotations

import torch


def rank_rows(steps: int, tokens: int, rank: int, world: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of the global data that this rank trains on: step s of the full data
    is rows s·N·tokens ... (s+1)·N·tokens, and rank r takes its r-th slice of tokens rows (the
    split `chunk(world)[rank]` makes). Adjacent ranges are merged (one range at world 1)."""
    n, ranges = tokens * world, []
    for s in range(steps):
        start, stop = s * n + rank * tokens, s * n + (rank + 1) * tokens
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((start, stop))
    return ranges


def randn_rows(g: torch.Generator, n: int, d: int, rows: list[tuple[int, int]],
               chunk: int = 1 << 22) -> torch.Tensor:
    """The rows `rows` (sorted [start, stop) ranges) of `torch.randn(n, d, generator=g,
    dtype=torch.float64)`, bit for bit, without building the rest, and `g` left where that
    call leaves it. torch's CPU normal fill (float64, 16 elements or more) draws one uniform
    per element, turns each run of 16 into normals (Box-Muller), and when 16 does not divide
    the size redraws the last 16 from 16 more uniforms. So the stream is walked in pieces of a
    multiple of 16 elements: a piece holding wanted rows is drawn with randn, any other is
    skipped by drawing its uniforms; the last piece, at least 16 long, is always drawn with
    randn so that it redraws the same tail. Host memory: the rows kept plus one piece."""
    total, chunk = n * d, max(16, chunk // 16 * 16)
    if total < 16 + chunk:  # small: draw it whole (also the < 16 path, which draws differently)
        full = torch.randn(n, d, generator=g, dtype=torch.float64)
        return torch.cat([full[a:b] for a, b in rows]) if rows else full[:0]
    wanted = [(a * d, b * d) for a, b in rows]
    out, bounds = [], list(range(0, total, chunk)) + [total]
    if bounds[-1] - bounds[-2] < 16:  # the last piece must be at least 16 long
        del bounds[-2]
    for c0, c1 in zip(bounds, bounds[1:]):
        hits = [(max(a, c0), min(b, c1)) for a, b in wanted if a < c1 and b > c0]
        if hits or c1 == total:
            piece = torch.randn(c1 - c0, generator=g, dtype=torch.float64)
            out += [piece[a - c0:b - c0].clone() for a, b in hits]  # not views: the piece goes
        else:
            torch.empty(c1 - c0, dtype=torch.float64).uniform_(generator=g)
    return torch.cat(out).view(-1, d) if out else torch.empty(0, d, dtype=torch.float64)


def regression_shard(n: int, d_in: int, d_out: int, rows: list[tuple[int, int]], seed: int = 0,
                     noise: float = 0.1, dtype: torch.dtype = torch.float32, chunk: int = 1 << 22):
    """The rows `rows` of `common.data.regression_data(n, d_in, d_out, seed, noise, dtype)`,
    drawn from the same generator stream in the same order (X, then W, then the noise) but
    keeping only those rows: each rank builds its shard, not every rank's data."""
    g = torch.Generator().manual_seed(seed)
    X = randn_rows(g, n, d_in, rows, chunk)
    W = torch.randn(d_in, d_out, generator=g, dtype=torch.float64) / d_in**0.5
    Y = X @ W + noise * randn_rows(g, n, d_out, rows, chunk)
    return X.to(dtype), Y.to(dtype)
