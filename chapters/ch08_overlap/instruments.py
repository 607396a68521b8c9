"""Chapter 08's measuring instruments: a sleep in backward that stands in for accelerator
compute (`--backward-sleep-ms`), and the timer of the communication left exposed after backward.
"""

from __future__ import annotations

import time

import torch

from common.models import TinyGPT
from common.timing import synchronize


class SleepInBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps, then passes the gradient on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


def add_backward_sleep(model: TinyGPT, ms: float) -> None:
    """Make the backward through each block's input sleep `ms` milliseconds: the block's own
    gradients are ready by then, so buckets launched from them can travel meanwhile."""
    if ms > 0:
        for block in model.blocks:
            block.register_forward_pre_hook(lambda _m, args: (SleepInBackward.apply(args[0], ms / 1e3),))


class ExposedTimer:
    """Times the sync after backward. Its start waits for the *compute stream* only (backward's
    kernels), not for the whole device: `torch.cuda.synchronize()` (what `common.timing.Timer`
    does) would also wait for the all-reduces already running on NCCL's stream, and hide exactly
    the communication that overlap leaves exposed. Its end synchronises the whole device. On the
    CPU both are no-ops and it is a plain clock."""

    def __init__(self, device: torch.device):
        self.device, self.elapsed = device, 0.0

    def __enter__(self) -> ExposedTimer:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.elapsed = time.perf_counter() - self._t0
