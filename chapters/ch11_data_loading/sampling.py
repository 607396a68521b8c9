"""Sharding a dataset over ranks: a hand-written sampler, the check that judges any sampler,
and two broken samplers that the check must reject (chapter 11).

`ShardSampler` does what `torch.utils.data.DistributedSampler` does, written out: shuffle all
indices with a generator seeded by `seed + epoch`, pad the list by repeating its head until it
divides by the world size (or drop the tail with `drop_last`), then give rank r every
world_size-th index starting at r.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch.utils.data import Sampler


def shuffled_indices(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The permutation every rank computes identically: a generator seeded by seed + epoch."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def shard_sizes(n: int, world_size: int, drop_last: bool) -> tuple[int, int]:
    """(samples per rank, total samples drawn): ceil(n/W) with padding, floor(n/W) without."""
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)
    return per_rank, per_rank * world_size


def shard(indices: list[int], world_size: int, rank: int, drop_last: bool) -> list[int]:
    """Pad (repeat the head) or trim (drop the tail) to a multiple of W, then take a stride."""
    per_rank, total = shard_sizes(len(indices), world_size, drop_last)
    if drop_last:
        indices = indices[:total]
    else:
        pad = total - len(indices)
        indices = indices + (indices * math.ceil(pad / len(indices)))[:pad]
    return indices[rank:total:world_size]


class ShardSampler(Sampler[int]):
    """A hand-written DistributedSampler: same arguments (the dataset's length for the dataset), same indices."""

    def __init__(self, n: int, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.n, self.world_size, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch on every rank, or every epoch repeats epoch 0's order."""
        self.epoch = epoch

    def __iter__(self):
        order = shuffled_indices(self.n, self.seed, self.epoch, self.shuffle)
        return iter(shard(order, self.world_size, self.rank, self.drop_last))

    def __len__(self) -> int:
        return shard_sizes(self.n, self.world_size, self.drop_last)[0]


class NoEpochSampler(ShardSampler):
    """Broken on purpose: forgets the epoch, so every epoch has the same order."""

    def __iter__(self):
        order = shuffled_indices(self.n, self.seed, 0, self.shuffle)
        return iter(shard(order, self.world_size, self.rank, self.drop_last))


class WrongStrideSampler(ShardSampler):
    """Broken on purpose, the multi-node bug: shards by the node-local rank over the ranks
    per node (stride 2 on 2 nodes x 2 ranks), so every node reads the same half of the data."""

    ranks_per_node = 2

    def __iter__(self):
        order = shuffled_indices(self.n, self.seed, self.epoch, self.shuffle)
        local_world = min(self.ranks_per_node, self.world_size)
        return iter(shard(order, local_world, self.rank % local_world, self.drop_last))


def check_shards(shards: list[list[int]], n: int, drop_last: bool) -> dict:
    """Judge the ranks' shards of one epoch of an n-item dataset.

    Returns the counts the lesson's checks compare: `repeats` (draws beyond the first of an
    index), `missing` (indices nobody drew), `expected_repeats` and `expected_missing` (what
    padding or dropping the remainder must give), and `ok`: equal sizes, and exactly those.
    """
    world_size = len(shards)
    per_rank, total = shard_sizes(n, world_size, drop_last)
    counts = Counter(i for s in shards for i in s)
    repeats = sum(c - 1 for c in counts.values())
    missing = n - len(counts)
    expected_repeats = 0 if drop_last else total - n
    expected_missing = n - total if drop_last else 0
    ok = (all(len(s) == per_rank for s in shards) and set(counts) <= set(range(n))
          and repeats == expected_repeats and missing == expected_missing)
    return {"repeats": repeats, "missing": missing, "expected_repeats": expected_repeats,
            "expected_missing": expected_missing, "per_rank": per_rank, "ok": ok}


def epoch_shards(make_sampler, world_size: int, epoch: int) -> list[list[int]]:
    """Every rank's indices for one epoch, from `make_sampler(rank)` (no process group needed:
    a sampler takes num_replicas and rank explicitly)."""
    shards = []
    for rank in range(world_size):
        sampler = make_sampler(rank)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards
