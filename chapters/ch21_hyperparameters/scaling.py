"""Batch-size scaling: steps to a target loss against the batch size, each batch size at its best
learning rate on a grid and at the linearly scaled rate of the smallest batch's best
(`scaling_experiment`, the batch sizes split over the ranks), the law S = S_min (1 + B_crit/B)
fitted to it (`fit_critical_batch`), and the figures a run records beside the closed-form noise
scale (`batch_scaling`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from chapters.ch21_hyperparameters import schedules as S
from chapters.ch21_hyperparameters.problem import feature_scales, loss_and_grad, sample, teacher
from common.log import log
from common.results import RunRecorder


def steps_to_target(cfg, batch: int, lr: float, seed: int,
                    give_up: int | None = None) -> int | None:
    """SGD from zero on fresh batches of `batch` samples until the *population* loss
    (exact for this Gaussian problem) reaches the target; None if it never does, or not
    within `give_up` steps (a search that already has a run this fast stops the others)."""
    g = torch.Generator().manual_seed(seed)
    w, wstar, var = torch.zeros(cfg.d, dtype=torch.float64), teacher(cfg), feature_scales(cfg) ** 2
    limit = cfg.max_steps if give_up is None else min(cfg.max_steps, give_up + 1)
    for step in range(limit):
        pop = ((w - wstar) ** 2 * var).sum().item() + cfg.label_noise**2
        if pop <= cfg.target_loss:
            return step
        if not math.isfinite(pop) or pop > 1e6:
            return None
        x, y = sample(cfg, batch, g)
        w = w - lr * loss_and_grad(w, x, y)[1]
    return None


LR_GRID = [2.0**-e for e in range(1, 11)]  # 0.5 ... 0.001: the Hessian 2 diag(var) allows lr < 1


def scaling_experiment(cfg, rank: int, world: int, data_seed: int | None = None) -> dict:
    """Steps to target against batch size, each batch size at its best lr on the grid and at
    the linearly scaled lr of the smallest batch's best. Ranks split the batch sizes. The i-th
    batch size draws its samples from seed `data_seed + i` (default: cfg.seed, which also
    picks the problem, w*): another data_seed reruns the same problem on other data."""
    sizes = [int(b) for b in cfg.batch_sizes.split(",")]
    data_seed = cfg.seed if data_seed is None else data_seed
    out = {}
    for i, b in enumerate(sizes):
        if i % world != rank:
            continue
        best, best_steps = float("nan"), None
        for lr in LR_GRID:  # from the largest: the smallest lr among the fastest wins ties
            s = steps_to_target(cfg, b, lr, data_seed + i, give_up=best_steps)
            if s is not None and (best_steps is None or s <= best_steps):
                best, best_steps = lr, s
        out[b] = {"best_lr": best, "best_steps": -1 if best_steps is None else best_steps}
    merged = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(merged, out)  # Python objects: gloo sends them from the CPU
    else:
        merged = [out]
    table = {b: v for part in merged for b, v in part.items()}
    table = dict(sorted(table.items()))
    b0 = sizes[0]
    lin = {b: steps_to_target(cfg, b, S.linear_scaled(table[b0]["best_lr"], b, b0), data_seed + i)
           for i, b in enumerate(sizes)} if rank == 0 else {}
    return {"table": table, "linear": lin}


def fit_critical_batch(steps: dict[int, int]) -> tuple[float, float]:
    """Least squares of S = S_min (1 + B_crit/B) in 1/B (McCandlish et al., 2018)."""
    xs = torch.tensor([1 / b for b in steps], dtype=torch.float64)
    ys = torch.tensor([float(s) for s in steps.values()], dtype=torch.float64)
    A = torch.stack([torch.ones_like(xs), xs], 1)
    a, c = torch.linalg.lstsq(A, ys[:, None]).solution.flatten().tolist()
    return a, c / a


def law_gain(b: int, b_noise: float) -> float:
    """Steps saved by doubling the batch from b, by S(B) = S_min (1 + B_noise / B)."""
    return (1 + b_noise / b) / (1 + b_noise / (2 * b))


def batch_scaling(rec: RunRecorder, cfg, info, closed: dict) -> None:
    """Steps to the target against the batch size, the fitted knee beside the closed-form
    noise scales at the target: figures, not checks (one noisy run per point; the lesson)."""
    exp = scaling_experiment(cfg, info.rank, info.world_size)
    steps = {b: v["best_steps"] for b, v in exp["table"].items() if v["best_steps"] >= 0}
    s_min, b_crit = fit_critical_batch(steps)
    if info.is_main:
        for b, v in exp["table"].items():
            log.info("batch %4d  best lr %.4g  steps %5d  linear-scaled steps %s", b, v["best_lr"],
                     v["best_steps"], exp["linear"].get(b))
    sizes = sorted(steps)
    rec.figure("steps to target per batch size", [steps[b] for b in sizes])
    rec.figure("steps gain per doubling (law: B_noise)",
               [round(steps[a] / steps[b], 3) for a, b in zip(sizes, sizes[1:])],
               [round(law_gain(a, closed["b_noise"]), 3) for a in sizes[:-1]])
    rec.figure("fitted S_min", s_min)
    rec.figure("fitted B_crit (expected: B_noise at target)", b_crit, expected=closed["b_noise"])
    rec.figure("linear-scaled lr: steps per batch size",
               [exp["linear"].get(b) for b in sizes] if info.is_main else [])
