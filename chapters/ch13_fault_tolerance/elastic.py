"""What makes chapter 13's data-parallel run resumable at any world size: the restart count
torchrun hands each attempt, a data position that is one global integer (`batch_at`), per-rank
noise streams re-derived from (seed, step, rank) after a resize (`noise_seed`), and the plain
data-parallel SGD with momentum whose state a checkpoint holds. Chapter 24 trains the same loop.

The functions read these fields of a config (chapter 13's or 24's `Config`): `seed`,
`batch_size`, `n_samples`, `lr`, `momentum`.
"""

import os

import torch
import torch.distributed as dist


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def noise_seed(cfg, rank: int, step: int = 0) -> int:
    """Seed of a rank's noise stream begun at `step`: at the start of the run, and after a
    resize (the saved per-rank streams belong to a world that no longer exists)."""
    return cfg.seed + 1 + rank + (step << 20)


def batch_at(X, Y, cursor: int, rank: int, world_size: int, cfg):
    """This rank's batch at data position `cursor` (samples consumed by the whole job so far);
    each epoch is a fresh permutation seeded by its number, so a position fixes the batch."""
    positions = cursor + rank * cfg.batch_size + torch.arange(cfg.batch_size)
    epochs = positions // cfg.n_samples
    perms = {int(e): torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
        cfg.seed * 1000 + int(e))) for e in epochs.unique()}
    idx = torch.stack([perms[int(e)][int(p)] for e, p in zip(epochs, positions % cfg.n_samples)])
    return X[idx], Y[idx]


def all_reduce_mean_(tensors: list[torch.Tensor], world_size: int) -> None:
    for t in tensors:
        dist.all_reduce(t)
        t /= world_size


def sgd_momentum_step(params, grads, buffers, cfg) -> None:
    """torch.optim.SGD's update (dampening 0); `buffers` is the optimizer state."""
    with torch.no_grad():
        for p, g, b in zip(params, grads, buffers):
            b.mul_(cfg.momentum).add_(g)
            p.sub_(cfg.lr * b)
