"""DDP done right and done wrong, and two facts of DDP's design, on gloo ranks started by
`common.launch.run_on_ranks` (the tests and the lesson's figure use it; it is not a script):

    from common.launch import run_on_ranks
    from chapters.ch02_single_node.controls import ddp_controls
    rank0, rank1 = run_on_ranks(ddp_controls, 2, steps=8)

- the same training as train.py, correct and in four classic broken variants (VARIANTS), each
  returning its parameters after every step (to be compared with one process) and what
  train.py's checks of the shards (misplaced and distinct rows) and of replica agreement
  measure on it;
- DDP's construction broadcasts rank 0's parameters (ranks seeded differently end equal);
- DDP all-reduces the gradients *during* backward, in buckets, each gradient exactly once.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch02_single_node.task import (
    SHARD_CHECK_STEPS,
    TaskConfig,
    build_data,
    build_model,
    build_optimizer,
    global_batch_indices,
    misplaced_rows,
    replica_spread,
    rows_held,
    shard_for_rank,
    train_step,
)

VARIANTS = {
    "correct": "each rank its own shard, mean loss (train.py)",
    "same_shard": "every rank trains on shard 0 (forgot to shard / no DistributedSampler)",
    "sum_loss": "loss summed over the shard instead of averaged",
    "no_ddp": "no DDP: each rank steps on its own shard's gradient",
    "overlap": "shards overlap: each slice ends one row late (off by one)",
}


STRIDED = "strided"
"""Not a mistake: DistributedSampler's strided shard, indices[rank::world_size] (exercise 2)."""


def train_variant(cfg: TaskConfig, variant: str, device: torch.device) -> dict:
    """Train like train.py, or broken as `variant` says (or with the STRIDED shard). Returns
    the parameters after every step, and what train.py's two collective checks measure on it."""
    if variant not in VARIANTS and variant != STRIDED:
        raise ValueError(f"unknown variant {variant!r}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    X, Y = build_data(cfg, device)
    model = build_model(cfg, device)
    if variant != "no_ddp":
        model = DDP(model)
    opt = build_optimizer(model, cfg)
    history, misplaced, distinct = [], 0, 0
    for step in range(cfg.steps):
        batch = global_batch_indices(step, cfg.global_batch_size, cfg.n_samples)
        per_rank = len(batch) // world_size
        if variant == STRIDED:
            idx = batch[rank::world_size]
        elif variant == "overlap":  # the bug: [r·b, (r+1)·b + 1), rank r also takes r+1's first row
            idx = batch[rank * per_rank:(rank + 1) * per_rank + 1]
        else:
            shard_rank = 0 if variant == "same_shard" else rank  # the bug: everyone takes shard 0
            idx = shard_for_rank(batch, shard_rank, world_size)
        if step < SHARD_CHECK_STEPS:  # train.py's shard checks
            held = rows_held(idx, cfg.n_samples, device)
            misplaced += misplaced_rows(held, batch)
            distinct += int((held > 0).sum())
        reduction = "sum" if variant == "sum_loss" else "mean"
        train_step(model, opt, X[idx], Y[idx], reduction=reduction)
        plain = model.module if isinstance(model, DDP) else model
        history.append({k: v.detach().clone() for k, v in plain.state_dict().items()})
    return {"history": history, "misplaced_rows": misplaced, "distinct_rows": distinct,
            "replica_spread": replica_spread(model, device)}


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def broadcast_at_construction(cfg: TaskConfig, device: torch.device) -> dict:
    """Each rank initialises its replica from a different seed, then wraps it in DDP."""
    model = build_model(replace(cfg, seed=cfg.seed + 1000 * dist.get_rank()), device)
    before = flat_parameters(model)
    after = flat_parameters(DDP(model))
    return {"before": before, "after": after}


def _counting_allreduce(sizes, bucket):
    """DDP's own all-reduce (divide by world size, then sum), noting each bucket's size.
    (No annotations: DDP inspects them, and this module's postponed annotations are strings.)"""
    sizes.append(bucket.buffer().numel())
    return default_hooks.allreduce_hook(None, bucket)


def gradient_buckets(cfg: TaskConfig, device: torch.device, bucket_cap_mb: float | None,
                     steps: int = 3) -> list[dict]:
    """Per step: bucket sizes all-reduced before backward() was called and by the time it returned."""
    X, Y = build_data(cfg, device)
    model = DDP(build_model(cfg, device), bucket_cap_mb=bucket_cap_mb)
    sizes: list[int] = []
    model.register_comm_hook(sizes, _counting_allreduce)
    per_step = []
    for step in range(steps):
        idx = shard_for_rank(global_batch_indices(step, cfg.global_batch_size, cfg.n_samples),
                             dist.get_rank(), dist.get_world_size())
        sizes.clear()
        loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])
        before_backward = list(sizes)
        loss.backward()
        per_step.append({"before_backward": before_backward, "after_backward": list(sizes)})
    return per_step


def ddp_controls(steps: int = 8, seed: int = 0, small_bucket_mb: float = 0.004,
                 exercise: bool = False) -> dict:
    """Everything above in one start of the ranks (each start costs seconds). With `exercise`,
    also the lesson's exercise 2 (the strided shard) and exercise 5: bucket sizes of a
    4.2 M-parameter MLP (--d-hidden 1024 --n-layers 6) with the default cap and with
    bucket_cap_mb=1."""
    cfg = TaskConfig(steps=steps, seed=seed, device="cpu")
    device = torch.device("cpu")
    n_params = sum(p.numel() for p in build_model(cfg, device).parameters())
    extra = {}
    if exercise:
        big = TaskConfig(steps=2, seed=seed, device="cpu", d_hidden=1024, n_layers=6)
        extra = {"exercise_strided": train_variant(cfg, STRIDED, device),
                 "exercise_default": gradient_buckets(big, device, None, steps=2),
                 "exercise_1mb": gradient_buckets(big, device, 1, steps=2)}
    return {**extra,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "config": cfg,
        "n_params": n_params,
        "variants": {v: train_variant(cfg, v, device) for v in VARIANTS},
        "broadcast": broadcast_at_construction(cfg, device),
        "buckets_default": gradient_buckets(cfg, device, None),
        "buckets_small": gradient_buckets(cfg, device, small_bucket_mb),
    }
