"""Counting a training step's FLOPs, chapter 01's technique: the formula for a linear-layer MLP,
and the count `torch.utils.flop_counter.FlopCounterMode` makes, which train.py checks against it
at tolerance 0. Chapter 15 measures MFU with the same two functions.
"""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode


def mlp_step_flops(dims: list[int], batch: int) -> int:
    """Matmul FLOPs of one training step of a linear-layer MLP, as FlopCounterMode counts them:
    2·B·in·out per layer forward, the same again for the weight gradient and for the input
    gradient, except the first layer, whose input needs no gradient: 6·B·Σ in·out − 2·B·in₀·out₀.
    (Bias adds, ReLUs and the optimizer's element-wise updates are not counted.)"""
    pairs = list(zip(dims, dims[1:]))
    return 6 * batch * sum(a * b for a, b in pairs) - 2 * batch * pairs[0][0] * pairs[0][1]


def count_flops(fn) -> int:
    """FLOPs of the matmul-like ops `fn()` runs, as torch.utils.flop_counter counts them."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
