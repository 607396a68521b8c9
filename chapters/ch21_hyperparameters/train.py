"""Schedules, the gradient noise scale from data parallelism's own norms, and batch-size scaling.

Data parallelism already holds two gradients of different batch sizes: every micro-batch's
local gradient (small batch) and the all-reduced one (the global batch). Their squared norms
give unbiased estimates of |G|^2 and tr(Sigma), whose ratio is the gradient noise scale
B_simple (McCandlish et al., 2018): the batch size beyond which a bigger batch stops cutting
the number of steps. This script checks the learning-rate schedules against their formulas,
the distributed noise-scale estimator against per-example gradients, and measures steps to a
target loss against the batch size.

Run:
    python chapters/ch21_hyperparameters/train.py                                  # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch21_hyperparameters/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch21_hyperparameters/train.py
    torchrun --standalone --nproc_per_node=8 chapters/ch21_hyperparameters/train.py   # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch21_hyperparameters/train.py                                     # two nodes
    srun --ntasks=16 --ntasks-per-node=8 --gpus-per-task=1 python chapters/ch21_hyperparameters/train.py
                                                                                   # Slurm, 16 GPUs
The default global batch, 48 micro-batches of one sample, divides over 1, 2, 3, 4, 8 and 16 ranks.
"""

import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chapters.ch21_hyperparameters import schedules as S
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import (
    gather_numbers,
    reduce_number,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything


@dataclass
class Config(RunConfig):
    global_batch_size: int = 48
    """Samples per step over all ranks (48 divides over 1, 2, 3, 4, 8 and 16 ranks)."""
    micro_batch_size: int = 1
    """Samples per micro-batch, the 'small batch' of the noise-scale estimator (1: per-example, exact)."""
    d: int = 16
    """Features of the linear-regression problem."""
    condition: float = 30.0
    """Ratio of the largest to the smallest feature variance (the problem's conditioning)."""
    label_noise: float = 0.5
    """Standard deviation of the label noise: the loss floor is its square."""
    lr: float = 0.05
    """Learning rate of the data-parallel SGD run that measures the noise scale."""
    target_loss: float = 0.5
    """Loss (mean squared error, floor label_noise^2) the batch-size experiment must reach."""
    max_steps: int = 3000
    """Steps after which a batch-size run counts as never reaching the target."""
    batch_sizes: str = "1,2,4,8,16,32,64,128,256,512"
    """Batch sizes of the scaling experiment, comma-separated."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "global_batch_size", "micro_batch_size", "d", "max_steps")
        if not self.condition >= 1:
            raise ValueError(f"--condition must be >= 1, not {self.condition}")
        if self.target_loss <= self.label_noise**2:
            raise ValueError(f"--target-loss must exceed the loss floor label_noise^2 = {self.label_noise**2:g}")
        if not all(b.strip().isdigit() and int(b) > 0 for b in self.batch_sizes.split(",")):
            raise ValueError(f"--batch-sizes must be positive integers separated by commas, not {self.batch_sizes!r}")


# The estimator and the per-example reference compute the same sums of squares in another order:
# a few hundred float64 operations on numbers of order one, u = 1.1e-16, relative error ~1e-13.
GNS_TOLERANCE = 1e-10  # relative


def validate(cfg: Config, world_size: int) -> None:
    """Every rank holds an equal number of whole micro-batches, and there are at least two."""
    per = world_size * cfg.micro_batch_size
    if cfg.global_batch_size % per:
        raise ValueError(f"--global-batch-size {cfg.global_batch_size} must divide into {world_size} ranks "
                         f"x micro-batches of {cfg.micro_batch_size}; use a multiple of {per}")
    if cfg.global_batch_size < 2 * cfg.micro_batch_size:
        raise ValueError("--global-batch-size must hold at least two micro-batches, "
                         "or the small and the big batch are the same")


def feature_scales(cfg: Config) -> torch.Tensor:
    """Standard deviations of the features, log-spaced so that variances span `condition`."""
    return torch.logspace(0, -0.5 * math.log10(cfg.condition), cfg.d, dtype=torch.float64)


def teacher(cfg: Config) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed + 12345)
    return torch.randn(cfg.d, dtype=torch.float64, generator=g)


def sample(cfg: Config, n: int, g: torch.Generator):
    """n fresh samples of the stream: x ~ N(0, diag(scales^2)), y = x.w* + noise."""
    x = torch.randn(n, cfg.d, dtype=torch.float64, generator=g) * feature_scales(cfg)
    y = x @ teacher(cfg) + cfg.label_noise * torch.randn(n, dtype=torch.float64, generator=g)
    return x, y


def loss_and_grad(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean squared error of the linear model and its gradient 2/n X^T (Xw - y)."""
    r = x @ w - y
    return (r @ r).item() / len(y), 2 * x.T @ r / len(y)


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


def dp_step_norms(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, cfg: Config, rank: int,
                  world: int) -> tuple[torch.Tensor, float, float, float]:
    """One data-parallel step's gradient and the two norms the estimator needs: the mean of
    the micro-batches' squared norms (agreed over ranks) and the all-reduced gradient's."""
    shard = len(y) // world
    xs, ys = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
    m = cfg.micro_batch_size
    k = shard // m
    local, small_sum, loss_sum = torch.zeros_like(w), 0.0, 0.0
    for j in range(k):
        loss, g = loss_and_grad(w, xs[j * m:(j + 1) * m], ys[j * m:(j + 1) * m])
        small_sum += (g @ g).item()  # the norm each micro-batch already has
        local += g / k
        loss_sum += loss / k
    big = local.to(w.device)
    if dist.is_initialized():
        dist.all_reduce(big)  # the all-reduce data parallelism does anyway
    big = (big / world).cpu()
    small_sq = reduce_number(small_sum) / (world * k)
    loss = reduce_number(loss_sum) / world
    return big, small_sq, (big @ big).item(), loss


def steps_to_target(cfg: Config, batch: int, lr: float, seed: int) -> int | None:
    """SGD from zero on fresh batches of `batch` samples until the *population* loss
    (exact for this Gaussian problem) reaches the target; None if it never does."""
    g = torch.Generator().manual_seed(seed)
    w, wstar, var = torch.zeros(cfg.d, dtype=torch.float64), teacher(cfg), feature_scales(cfg) ** 2
    for step in range(cfg.max_steps):
        pop = ((w - wstar) ** 2 * var).sum().item() + cfg.label_noise**2
        if pop <= cfg.target_loss:
            return step
        if not math.isfinite(pop) or pop > 1e6:
            return None
        x, y = sample(cfg, batch, g)
        w = w - lr * loss_and_grad(w, x, y)[1]
    return None


LR_GRID = [2.0**-e for e in range(1, 11)]  # 0.5 ... 0.001: the Hessian 2 diag(var) allows lr < 1


def scaling_experiment(cfg: Config, rank: int, world: int) -> dict:
    """Steps to target against batch size, each batch size at its best lr on the grid and at
    the linearly scaled lr of the smallest batch's best. Ranks split the batch sizes."""
    sizes = [int(b) for b in cfg.batch_sizes.split(",")]
    out = {}
    for i, b in enumerate(sizes):
        if i % world != rank:
            continue
        runs = {lr: steps_to_target(cfg, b, lr, cfg.seed + i) for lr in LR_GRID}
        ok = {lr: s for lr, s in runs.items() if s is not None}
        best = min(ok, key=lambda lr: (ok[lr], lr)) if ok else float("nan")
        out[b] = {"best_lr": best, "best_steps": ok.get(best, -1)}
    merged = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(merged, out)  # Python objects: gloo sends them from the CPU
    else:
        merged = [out]
    table = {b: v for part in merged for b, v in part.items()}
    table = dict(sorted(table.items()))
    b0 = sizes[0]
    lin = {b: steps_to_target(cfg, b, S.linear_scaled(table[b0]["best_lr"], b, b0), cfg.seed + i)
           for i, b in enumerate(sizes)} if rank == 0 else {}
    return {"table": table, "linear": lin}


def fit_critical_batch(steps: dict[int, int]) -> tuple[float, float]:
    """Least squares of S = S_min (1 + B_crit/B) in 1/B (McCandlish et al., 2018)."""
    xs = torch.tensor([1 / b for b in steps], dtype=torch.float64)
    ys = torch.tensor([float(s) for s in steps.values()], dtype=torch.float64)
    A = torch.stack([torch.ones_like(xs), xs], 1)
    a, c = torch.linalg.lstsq(A, ys[:, None]).solution.flatten().tolist()
    return a, c / a


def check_schedules(rec: RunRecorder) -> None:
    """Each schedule at chosen steps against its formula worked out by hand."""
    peak, T, w, floor = 1.0, 100, 10, 0.1
    hand = {  # step -> value, worked out from the formulas in the lesson
        "warmup": [(0, 0.1), (4, 0.5), (9, 1.0), (50, 1.0)],
        "cosine": [(0, 0.1), (10, 1.0), (55, 0.55), (100, 0.1)],
        "wsd": [(0, 0.1), (9, 1.0), (80, 1.0), (90, 0.55), (100, 0.1)],
    }
    got = {"warmup": lambda s: S.linear_warmup(s, peak, w),
           "cosine": lambda s: S.cosine(s, peak, T, w, floor),
           "wsd": lambda s: S.wsd(s, peak, T, w, 20, floor)}
    for name, points in hand.items():
        err = max(abs(got[name](s) - v) for s, v in points)
        rec.check(f"{name} == formula at {len(points)} steps", "formula", err, 0.0, 1e-15)
    err = max(abs(S.linear_scaled(0.1, b, 256) - 0.1 * b / 256) for b in (256, 1024, 4096))
    err2 = max(abs(S.sqrt_scaled(0.1, b, 256) - v) for b, v in ((256, 0.1), (1024, 0.2), (4096, 0.4)))
    rec.check("linear and sqrt scaling == formula", "formula", max(err, err2), 0.0, 1e-15)
    torch_lrs = S.torch_cosine_lrs(peak, T, w, floor)
    diff = max(abs(a - S.cosine(s, peak, T, w, floor)) for s, a in enumerate(torch_lrs))
    rec.check("cosine == torch LinearLR+CosineAnnealingLR", "parity", diff, 0.0, 1e-12)
    shifted = max(abs(a - S.cosine(s - 1, peak, T, w, floor)) for s, a in enumerate(torch_lrs) if s)
    rec.check("off-by-one cosine differs from torch (control)", "parity", shifted, 1e-12, compare=">")


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        rank, world = info.rank, info.world_size
        check_schedules(rec)

        # 1. The noise scale from the norms data parallelism has, along a short SGD run.
        g = torch.Generator().manual_seed(cfg.seed)  # the same global batches on every rank
        w = torch.zeros(cfg.d, dtype=torch.float64)
        B, m = cfg.global_batch_size, cfg.micro_batch_size
        ema = {"g2": 0.0, "trace": 0.0}
        worst, worst_biased = 0.0, 0.0
        for step in range(cfg.steps):
            x, y = sample(cfg, B, g)
            grad, small_sq, big_sq, loss = dp_step_norms(w.to(info.device), x.to(info.device),
                                                         y.to(info.device), cfg, rank, world)
            est = noise_scale(small_sq, big_sq, m, B)
            if m == 1:  # micro-batches of one sample: the estimator is the per-example statistic
                exact = exact_noise_scale(per_example_grads(w, x, y))
                worst = max(worst, abs(est["b_simple"] / exact["b_simple"] - 1))
                biased = exact["trace"] / big_sq  # |G_B|^2 alone as |G|^2: biased by tr/B
                worst_biased = max(worst_biased, abs(biased / exact["b_simple"] - 1))
            for key in ema:
                ema[key] = 0.9 * ema[key] + 0.1 * est[key]
            rec.metrics(step, loss=loss, b_simple=est["b_simple"], lr=cfg.lr)
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                log.info("step %3d  loss %.4f  B_simple %.1f", step, loss, est["b_simple"])
            w = w - cfg.lr * grad
        if m == 1:
            rec.check("B_simple from DP norms == per-example exact (rel.)", "parity", worst, 0.0,
                      GNS_TOLERANCE)
            rec.check("big-batch norm alone differs (biased, control)", "parity", worst_biased,
                      GNS_TOLERANCE, compare=">")
        # agreement: every rank computed the same estimate from the same reduced numbers
        spread = max(gather_numbers(ema["trace"] / ema["g2"])) - min(gather_numbers(ema["trace"] / ema["g2"]))
        rec.check("ranks agree on B_simple", "parity", spread, 0.0)
        rec.figure("B_simple (EMA of both estimates)", ema["trace"] / ema["g2"])
        pop = exact_noise_scale(per_example_grads(w, *sample(cfg, 8192, torch.Generator().manual_seed(7))))
        rec.figure("B_simple from 8192 per-example grads, same w", pop["b_simple"])

        # 2. Steps to target loss against batch size.
        exp = scaling_experiment(cfg, rank, world)
        table = exp["table"]
        steps = {b: v["best_steps"] for b, v in table.items() if v["best_steps"] >= 0}
        s_min, b_crit = fit_critical_batch(steps)
        at_target = target_noise_scale(cfg)
        if info.is_main:
            for b, v in table.items():
                log.info("batch %4d  best lr %.4g  steps %5d  linear-scaled steps %s", b, v["best_lr"],
                         v["best_steps"], exp["linear"].get(b))
        sizes = sorted(steps)
        gains = [steps[a] / steps[b] for a, b in zip(sizes, sizes[1:])]
        # Below the knee a doubled batch saves many steps, above it almost none.
        rec.check("doubling the smallest batch: steps gain > 1.3x", "formula", gains[0], 1.3,
                  compare=">")
        rec.check("doubling the largest batch: steps gain < 1.3x", "formula", gains[-1], 1.3,
                  compare="<")
        rec.figure("steps to target per batch size", [steps[b] for b in sizes])
        rec.figure("fitted S_min", s_min)
        rec.figure("fitted B_crit", b_crit, expected=at_target)
        rec.figure("linear-scaled lr: steps per batch size",
                   [exp["linear"].get(b) for b in sizes] if info.is_main else [])
        return rec.finish()
    finally:
        teardown_distributed()


def target_noise_scale(cfg: Config) -> float:
    """B_simple at the point of the path from 0 to w* where the population loss is the target:
    estimated from 8192 per-example gradients (a sample estimate, not the closed form)."""
    wstar, var = teacher(cfg), feature_scales(cfg) ** 2
    excess0 = (wstar**2 * var).sum().item()
    frac = 1 - math.sqrt((cfg.target_loss - cfg.label_noise**2) / excess0)
    w = frac * wstar
    x, y = sample(cfg, 8192, torch.Generator().manual_seed(7))
    return exact_noise_scale(per_example_grads(w, x, y))["b_simple"]


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
