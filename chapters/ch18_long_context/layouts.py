"""How sequence parallelism cuts a sequence among N ranks: 2N chunks of c = T/(2N) tokens, and a
*layout* that says which two chunks a rank holds:

- "contiguous": rank r holds chunks 2r and 2r+1 (the plain split: positions rT/N … (r+1)T/N−1);
- "zigzag": rank r holds chunks r and 2N−1−r, so under a causal mask every rank has one early
  and one late chunk and does the same number of chunk products (the zigzag split of
  ring-flash-attention and torch's context_parallel "head-tail" balancer; Brandon et al. 2023,
  "Striped Attention", balance the same work with a token-by-token stripe instead).

Ring attention (ring.py) builds its causal masks from these chunk ids; parity.py and train.py
shard the whole-sequence tensors, and the tokens' positions, with `shard_sequence` and `positions`.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def chunk_ids(rank: int, world: int, layout: str) -> list[int]:
    """The two global chunk indices (of 2·world) that `rank` holds, in the order it holds them."""
    if layout == "contiguous":
        return [2 * rank, 2 * rank + 1]
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")


def length_error(length: int, world: int) -> str | None:
    """One sentence if a sequence of `length` cannot be cut into 2·world equal chunks, else None.
    (Fewer tokens than chunks would leave a rank with nothing; unequal chunks, wrong masks.)"""
    if length % (2 * world):
        return (f"ring attention cuts a sequence into 2N chunks: {world} ranks need sequence "
                f"lengths divisible by {2 * world}, not {length}")
    return None


def shard_sequence(x: torch.Tensor, rank: int, world: int, layout: str, dim: int) -> torch.Tensor:
    """This rank's part of the whole-sequence tensor `x` (its two chunks along `dim`)."""
    if error := length_error(x.shape[dim], world):
        raise ValueError(error)
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world, layout)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], layout: str, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's part (the inverse of `shard_sequence`)."""
    world = len(parts)
    chunks: list = [None] * (2 * world)
    for rank, part in enumerate(parts):
        for i, piece in zip(chunk_ids(rank, world, layout), part.chunk(2, dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)


def positions(seq_len: int, rank: int, world: int, layout: str) -> torch.Tensor:
    """The global positions of this rank's tokens (what the position embedding must see)."""
    return shard_sequence(torch.arange(seq_len), rank, world, layout, dim=0)
