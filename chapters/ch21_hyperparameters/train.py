"""Schedules, the gradient noise scale from data parallelism's own norms, and batch-size scaling.

Data parallelism already holds two gradients of different batch sizes: every micro-batch's
local gradient (small batch) and the all-reduced one (the global batch). Their squared norms
give unbiased estimates of |G|^2 and tr(Sigma), whose ratio is the gradient noise scale
B_simple (McCandlish et al., 2018): the batch size beyond which a bigger batch stops cutting
the number of steps; in the Hessian's metric the same two norms give B_noise. This script
checks the learning-rate schedules against their formulas, the distributed noise-scale
estimator against per-example gradients, both noise scales and their four parts against their
closed forms for this Gaussian problem, and measures steps to a target loss against the batch
size.

Run:
    python chapters/ch21_hyperparameters/train.py                                  # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch21_hyperparameters/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch21_hyperparameters/train.py
    torchrun --standalone --nproc_per_node=8 chapters/ch21_hyperparameters/train.py   # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch21_hyperparameters/train.py                                     # two nodes
    srun --ntasks=16 --ntasks-per-node=8 --gpus-per-node=8 python chapters/ch21_hyperparameters/train.py
                                                                                   # Slurm, 16 GPUs
The default global batch, 48 micro-batches of one sample, divides over 1, 2, 3, 4, 8 and 16 ranks.
"""

import sys
from dataclasses import dataclass

import torch

from chapters.ch21_hyperparameters import checks
from chapters.ch21_hyperparameters.gns import (
    dp_step_norms,
    exact_noise_scale,
    noise_scale,
    per_example_grads,
)
from chapters.ch21_hyperparameters.problem import closed_form_noise_scales, sample
from chapters.ch21_hyperparameters.scaling import batch_scaling
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import gather_numbers, setup_distributed, teardown_distributed
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
    noise_batches: int = 800
    """Global batches at the target point over which the measured noise scales are averaged."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "global_batch_size", "micro_batch_size", "d", "max_steps",
                             "noise_batches")
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


def noise_scale_along_a_run(rec: RunRecorder, cfg: Config, info) -> None:
    """A short data-parallel SGD run from w = 0 that measures B_simple at every step from the
    norms it has anyway; with micro-batches of one sample, checked against the per-example
    statistic of the same batch at each step."""
    g = torch.Generator().manual_seed(cfg.seed)  # the same global batches on every rank
    w = torch.zeros(cfg.d, dtype=torch.float64)
    B, m = cfg.global_batch_size, cfg.micro_batch_size
    ema = {"g2": 0.0, "trace": 0.0}
    worst, worst_biased = 0.0, 0.0
    for step in range(cfg.steps):
        x, y = sample(cfg, B, g)
        n = dp_step_norms(w.to(info.device), x.to(info.device), y.to(info.device), cfg,
                          info.rank, info.world_size)
        est = noise_scale(n.small_sq, n.big_sq, m, B)
        if m == 1:  # micro-batches of one sample: the estimator is the per-example statistic
            exact = exact_noise_scale(per_example_grads(w, x, y))
            worst = max(worst, abs(est["b_simple"] / exact["b_simple"] - 1))
            biased = exact["trace"] / n.big_sq  # |G_B|^2 alone as |G|^2: biased by tr/B
            worst_biased = max(worst_biased, abs(biased / exact["b_simple"] - 1))
        for key in ema:
            ema[key] = 0.9 * ema[key] + 0.1 * est[key]
        rec.metrics(step, loss=n.loss, b_simple=est["b_simple"], lr=cfg.lr)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            log.info("step %3d  loss %.4f  B_simple %.1f", step, n.loss, est["b_simple"])
        w = w - cfg.lr * n.grad
    if m == 1:
        rec.check("B_simple from DP norms == per-example exact (rel.)", "parity", worst, 0.0,
                  GNS_TOLERANCE)
        rec.check("big-batch norm alone differs (biased, control)", "parity", worst_biased,
                  GNS_TOLERANCE, compare=">")
    # agreement: every rank computed the same estimate from the same reduced numbers
    spread = max(gather_numbers(ema["trace"] / ema["g2"])) - min(gather_numbers(ema["trace"] / ema["g2"]))
    rec.check("ranks agree on B_simple", "parity", spread, 0.0)
    rec.figure("B_simple along the run (EMA of both estimates)", ema["trace"] / ema["g2"])
    rec.figure("B_simple at the run's final weights (closed form)",
               closed_form_noise_scales(cfg, w)["b_simple"])


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        checks.check_schedules(rec)
        noise_scale_along_a_run(rec, cfg, info)  # 1. the estimator, step by step
        closed = checks.check_noise_scales(rec, cfg, info)  # 2. at the target point: closed forms
        rec.figure("B_simple at target (closed form)", closed["b_simple"])
        rec.figure("B_noise at target (closed form)", closed["b_noise"])
        batch_scaling(rec, cfg, info, closed)  # 3. steps to target against batch size
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
