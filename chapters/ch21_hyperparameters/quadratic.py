"""The problem tune.py searches, whose best region follows from a formula: gradient descent on
f(w) = 1/2 sum_i h_i (w_i - w*_i)^2 contracts the slowest direction by rho(lr) per step, best at
lr* = 2/(h_min + h_max) (`rho`, `best_lr`, `known_region`, `loss_after`); the grid of learning
rates and the order its trials start in; the rows the trials train on (`problem_data`, and
`ddp_halves`, one half per TorchTrainer worker) and the loss they report (`full_loss`).
"""

from __future__ import annotations

import torch


def curvatures(cfg) -> list[float]:
    return [cfg.h_min * (cfg.h_max / cfg.h_min) ** (i / (cfg.d - 1)) for i in range(cfg.d)]


def best_lr(cfg) -> float:
    return 2 / (cfg.h_min + cfg.h_max)


def rho(lr: float, cfg) -> float:
    """Per-step contraction of the slowest direction."""
    return max(abs(1 - lr * cfg.h_min), abs(1 - lr * cfg.h_max))


def known_region(cfg) -> tuple[float, float]:
    """{lr : rho(lr) <= rho* + slack} = [(1 - r)/h_min, (1 + r)/h_max], r = rho* + slack."""
    r = rho(best_lr(cfg), cfg) + cfg.slack
    return (1 - r) / cfg.h_min, (1 + r) / cfg.h_max


def lr_grid(cfg) -> list[float]:
    return [best_lr(cfg) * 2 ** (k / 3) for k in range(-6, cfg.grid - 6)]


def grid_order(cfg) -> list[float]:
    """The grid in a fixed shuffled order (ascending order would let every improving trial pass
    its rungs: ASHA compares a trial only with those that reached the rung before it)."""
    g = torch.Generator().manual_seed(cfg.order_seed)
    grid = lr_grid(cfg)
    return [grid[i] for i in torch.randperm(len(grid), generator=g).tolist()]


def trial_lrs(cfg) -> list[float]:
    if cfg.trials == "none":
        return []
    return [best_lr(cfg) * 2 ** (int(k) / 3) for k in cfg.trials.split(",")]


def problem_data(cfg, copies: int = 2):
    """Rows X with X^T X / n = diag(h) (copies of diag(sqrt(h d))), targets y = X w*, float64."""
    h = torch.tensor(curvatures(cfg), dtype=torch.float64)
    block = torch.diag((h * cfg.d).sqrt())
    x = block.repeat(copies, 1)
    wstar = torch.ones(cfg.d, dtype=torch.float64)
    return x, x @ wstar


def loss_after(lr: float, t: int, cfg) -> float:
    """f after t steps from w = 0 (error 1 in every direction): 1/2 sum h_i (1 - lr h_i)^(2t)."""
    return 0.5 * sum(h * (1 - lr * h) ** (2 * t) for h in curvatures(cfg))


def ddp_halves(cfg, world: int = 2):
    """Rank r's rows: diag(sqrt(h d a_r)), a_r = 1 + s_r (-1)^i, s_r = +1/2, -1/2 in turn, targets
    X_r w*. The halves differ (so training on one half alone, without the all-reduce, ends
    elsewhere), and their mean X^T X / n is still diag(h): the averaged gradient is the full one."""
    h = torch.tensor(curvatures(cfg), dtype=torch.float64)
    alt = torch.tensor([(-1.0) ** i for i in range(cfg.d)], dtype=torch.float64)
    wstar = torch.ones(cfg.d, dtype=torch.float64)
    halves = []
    for r in range(world):
        s = 0.5 if r % 2 == 0 else -0.5
        if world % 2 and r == world - 1:
            s = 0.0
        x = torch.diag((h * cfg.d * (1 + s * alt)).sqrt())
        halves.append((x, x @ wstar))
    return halves


def full_loss(w: torch.Tensor, cfg) -> float:
    x, y = problem_data(cfg)
    return 0.5 * ((x @ w - y) ** 2).mean().item()
