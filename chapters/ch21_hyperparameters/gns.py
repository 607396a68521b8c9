"""The gradient noise scale from data parallelism's own norms (McCandlish et al., 2018): every
micro-batch's local gradient is the small batch, the all-reduced one the big batch, and their
squared norms give unbiased estimates of |G|^2 and tr(Sigma) (`noise_scale`); `dp_step_norms`
is one data-parallel step that keeps both norms (also in a Hessian's metric); the per-example
statistic (`exact_noise_scale` on `per_example_grads`) is the exact reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def per_example_grads(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One gradient per sample with torch.func (vmap of grad): the exact reference."""
    from torch.func import grad, vmap

    def one(wi, xi, yi):
        return (xi @ wi - yi) ** 2

    return vmap(grad(one), in_dims=(None, 0, 0))(w, x, y)


def noise_scale(small_sq: float, big_sq: float, b_small: int, b_big: int) -> dict:
    """McCandlish et al. (2018), appendix A: from E|G_b|^2 = |G|^2 + tr(Sigma)/b at two sizes,
    |G|^2 = (B|G_B|^2 - b|G_b|^2)/(B - b), tr(Sigma) = (|G_b|^2 - |G_B|^2)/(1/b - 1/B)."""
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    tr = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return {"g2": g2, "trace": tr, "b_simple": tr / g2}


def exact_noise_scale(grads: torch.Tensor) -> dict:
    """From per-example gradients g_i: the unbiased |G|^2 = |mean g|^2 - tr(Sigma)/B and
    tr(Sigma) = sum |g_i - mean g|^2 / (B-1)."""
    n = len(grads)
    mean = grads.mean(0)
    tr = ((grads - mean) ** 2).sum().item() / (n - 1)
    g2 = (mean @ mean).item() - tr / n
    return {"g2": g2, "trace": tr, "b_simple": tr / g2}


@dataclass
class StepNorms:
    """One data-parallel step: the all-reduced gradient, the mean loss, and the squared norms
    the estimator needs at the two batch sizes, plain and in the metric `h` (a diagonal
    Hessian, where one is given): |g|^2 averaged over every micro-batch of every rank, and the
    all-reduced gradient's."""

    grad: torch.Tensor
    loss: float
    small_sq: float
    big_sq: float
    small_h: float = float("nan")
    big_h: float = float("nan")


def dp_step_norms(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, cfg, rank: int,
                  world: int, h: torch.Tensor | None = None) -> StepNorms:
    """One data-parallel step's gradient and the norms the estimator needs: the mean of the
    micro-batches' squared norms (agreed over ranks) and the all-reduced gradient's; with `h`
    also both in the metric g^T diag(h) g."""
    shard = len(y) // world
    xs, ys = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
    m = cfg.micro_batch_size
    k = shard // m
    # The k micro-batches' gradients 2/m X_j^T (X_j w - y_j), all at once (what k backward
    # passes of gradient accumulation would give one by one), and the norm each already has.
    xs, ys = xs[:k * m].reshape(k, m, -1), ys[:k * m].reshape(k, m)
    r = xs @ w - ys
    g = 2 * torch.einsum("kmd,km->kd", xs, r) / m
    sums = torch.stack([(g * g).sum(), (g * g * h).sum() if h is not None else g.new_zeros(()),
                        (r * r).mean(1).sum()])  # |g|^2, g^T diag(h) g, loss: summed over j
    big = g.mean(0)
    if dist.is_initialized():
        dist.all_reduce(big)  # the all-reduce data parallelism does anyway
        dist.all_reduce(sums)  # three numbers more
    big, (small_sum, small_h, loss_sum) = (big / world).cpu(), sums.tolist()
    return StepNorms(big, loss_sum / (world * k), small_sum / (world * k), (big @ big).item(),
                     small_h / (world * k) if h is not None else float("nan"),
                     (big @ (h.cpu() * big)).item() if h is not None else float("nan"))
