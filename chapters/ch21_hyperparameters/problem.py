"""The problem every part of chapter 21 samples: linear regression on a Gaussian stream,
x ~ N(0, diag(scales^2)), y = x.w* + noise, with features whose variances span `--condition`;
and its closed forms: the point on the path from 0 to w* where the population loss is the
target, and both noise scales and their four parts at any weights (Isserlis' theorem).
"""

from __future__ import annotations

import functools
import math

import torch


def feature_scales(cfg) -> torch.Tensor:
    """Standard deviations of the features, log-spaced so that variances span `condition`."""
    return _scales(cfg.condition, cfg.d)


def teacher(cfg) -> torch.Tensor:
    """The true weights w* (a function of the seed: --seed changes the problem too)."""
    return _teacher(cfg.seed, cfg.d)


@functools.cache  # computed once per problem: the scaling experiment samples millions of times
def _scales(condition: float, d: int) -> torch.Tensor:
    return torch.logspace(0, -0.5 * math.log10(condition), d, dtype=torch.float64)


@functools.cache
def _teacher(seed: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 12345)
    return torch.randn(d, dtype=torch.float64, generator=g)


def sample(cfg, n: int, g: torch.Generator):
    """n fresh samples of the stream: x ~ N(0, diag(scales^2)), y = x.w* + noise."""
    x = torch.randn(n, cfg.d, dtype=torch.float64, generator=g) * feature_scales(cfg)
    y = x @ teacher(cfg) + cfg.label_noise * torch.randn(n, dtype=torch.float64, generator=g)
    return x, y


def loss_and_grad(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean squared error of the linear model and its gradient 2/n X^T (Xw - y)."""
    r = x @ w - y
    return (r @ r).item() / len(y), 2 * x.T @ r / len(y)


def target_point(cfg) -> torch.Tensor:
    """The weights on the straight path from 0 to w* where the population loss is the target:
    w = f w*, with (1 - f)^2 w*^T V w* = target - sigma^2."""
    wstar, var = teacher(cfg), feature_scales(cfg) ** 2
    excess0 = (wstar**2 * var).sum().item()
    return (1 - math.sqrt((cfg.target_loss - cfg.label_noise**2) / excess0)) * wstar


def closed_form_noise_scales(cfg, w: torch.Tensor) -> dict:
    """B_simple = tr(Sigma)/|G|^2 and B_noise = tr(H Sigma)/(G^T H G) at `w`, exactly, and
    their four parts, for x ~ N(0, V), V = diag(v), y = x.w* + N(0, sigma^2), per-example loss
    (x.w - y)^2. With e = w - w* and L = e^T V e + sigma^2 (the population loss): G = 2Ve,
    H = 2V, and by Isserlis' theorem Sigma = 4(L V + V e e^T V). Hence |G|^2 = 4 e^T V^2 e,
    tr(Sigma) = 4(L tr V + e^T V^2 e), G^T H G = 8 e^T V^3 e, tr(H Sigma) = 8(L tr V^2 +
    e^T V^3 e), B_simple = 1 + L tr(V) / (e^T V^2 e) and B_noise = 1 + L tr(V^2) / (e^T V^3 e)."""
    v, e = feature_scales(cfg) ** 2, w - teacher(cfg)
    loss = (e * e * v).sum().item() + cfg.label_noise**2
    ev2, ev3 = (e * e * v**2).sum().item(), (e * e * v**3).sum().item()
    return {"b_simple": 1 + loss * v.sum().item() / ev2,
            "b_noise": 1 + loss * (v**2).sum().item() / ev3,
            "g2": 4 * ev2, "trace": 4 * (loss * v.sum().item() + ev2),
            "g2_h": 8 * ev3, "trace_h": 8 * (loss * (v**2).sum().item() + ev3),
            "loss": loss}
