"""A dynamic loss scaler written by hand, and a trace of its decisions beside
`torch.amp.GradScaler`'s on the same sequence of overflows.

Helper module of chapter 10 (no main guard); `train.py`, `checks.py` and the tests import it.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn


class DynamicLossScaler:
    """GradScaler's algorithm in twenty lines.

    Multiply the loss by `scale` before backward; before the optimizer step divide the
    gradients by `scale` and look for inf/NaN. Found one: skip the step and multiply the scale
    by `backoff_factor`. Else step, and after `growth_interval` clean steps in a row multiply
    the scale by `growth_factor`. `skip_on_inf=False` and `backoff_factor=1` are the broken
    variants the tests must reject.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, skip_on_inf: bool = True):
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval, self.skip_on_inf, self.good_steps = growth_interval, skip_on_inf, 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params) -> bool:
        """Divide every gradient by the scale (in fp32, as GradScaler); True if any is inf/NaN."""
        inv = torch.tensor(1.0 / self.scale, dtype=torch.float64).float()
        found_inf = False
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv.to(p.grad.device))
                found_inf |= not bool(torch.isfinite(p.grad).all())
        return found_inf

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            self.scale = grown if math.isfinite(grown) else self.scale
            self.good_steps = 0

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, step unless a gradient overflowed, update the scale. Returns 'skipped'."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        found_inf = self.unscale_(params)
        skipped = found_inf and self.skip_on_inf
        if not skipped:
            optimizer.step()
        self.update(found_inf)
        return skipped


def scaler_trace(model: nn.Module, X: torch.Tensor, Y: torch.Tensor, scaler, inf_steps: set[int],
                 lr: float = 0.05, autocast_dtype: torch.dtype = torch.float16) -> dict:
    """Train `model` (a copy) with `scaler` (a DynamicLossScaler or a torch.amp.GradScaler),
    writing an inf into one gradient at `inf_steps`. Returns the scale used at every step,
    the steps whose parameters did not move (skipped) and whether they stayed finite."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    torch_scaler = isinstance(scaler, torch.amp.GradScaler)
    scales, skipped = [], []
    for step in range(len(X)):
        scales.append(scaler.get_scale() if torch_scaler else scaler.scale)
        opt.zero_grad()
        with torch.autocast(X.device.type, dtype=autocast_dtype):
            loss = torch.nn.functional.mse_loss(model(X[step]).float(), Y[step])
        (scaler.scale(loss) if torch_scaler else scaler.scale_loss(loss)).backward()
        if step in inf_steps:
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # an overflow, on purpose
        before = [p.detach().clone() for p in model.parameters()]
        if torch_scaler:
            scaler.step(opt)
            scaler.update()
        else:
            scaler.step(opt)
        if all(torch.equal(b, p) for b, p in zip(before, model.parameters())):
            skipped.append(step)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"scales": scales, "skipped": skipped, "finite": finite}
