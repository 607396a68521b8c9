"""Learning-rate schedules and batch-size scaling rules as pure functions of the step.

Each returns the learning rate of step `step` (0-based): no optimizer, no state, so a test can
compare it with its formula at any step, and `torch_cosine_lrs` shows torch's schedulers
producing the same numbers. Checked by checks.py and used by scaling.py; train.py runs both:

    python chapters/ch21_hyperparameters/train.py
"""

from __future__ import annotations

import math


def linear_warmup(step: int, peak: float, warmup: int) -> float:
    """peak * min(1, (step+1)/warmup): step 0 already trains, step warmup-1 reaches the peak."""
    return peak * min(1.0, (step + 1) / warmup) if warmup > 0 else peak


def cosine(step: int, peak: float, total: int, warmup: int = 0, floor: float = 0.0) -> float:
    """Linear warm-up, then floor + (peak-floor)/2 * (1 + cos(pi * t)), t = (step-warmup)/(total-warmup)."""
    if step < warmup:
        return linear_warmup(step, peak, warmup)
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * t))


def wsd(step: int, peak: float, total: int, warmup: int, decay: int, floor: float = 0.0) -> float:
    """Warmup-stable-decay: warm up, hold the peak, then fall linearly to floor over the last
    `decay` steps (reaching floor at step total)."""
    if step < warmup:
        return linear_warmup(step, peak, warmup)
    start = total - decay
    if step < start:
        return peak
    return peak + (floor - peak) * min(1.0, (step - start) / decay)


def linear_scaled(base_lr: float, batch: int, base_batch: int) -> float:
    """Linear scaling rule (Goyal et al., 2017): lr grows with the batch."""
    return base_lr * batch / base_batch


def sqrt_scaled(base_lr: float, batch: int, base_batch: int) -> float:
    """Square-root scaling (Krizhevsky 2014; Adam-type optimizers): lr grows with sqrt(batch)."""
    return base_lr * math.sqrt(batch / base_batch)


def torch_cosine_lrs(peak: float, total: int, warmup: int, floor: float = 0.0) -> list[float]:
    """The same warm-up + cosine from torch's own schedulers: LinearLR then CosineAnnealingLR,
    chained by SequentialLR. Returns the learning rate of steps 0..total."""
    import torch

    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=peak)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0,
                                             total_iters=warmup - 1)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=floor)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[warmup])
    lrs = []
    for _ in range(total + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs
