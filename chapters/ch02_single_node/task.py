"""The training task all three scripts of chapter 02 share: config, data, model, optimizer, step.

single.py, spawn.py and train.py import these, so the only lines that differ between the
scripts are the distributed ones — the lesson. The functions about distribution are
`shard_for_rank` (which rows of a global batch a rank takes) and the small collectives below
it; the rest would be the same in any single-device training script.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.config import RunConfig
from common.data import regression_data
from common.distributed import reduce_number
from common.models import MLP
from common.seed import seed_everything

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# Parity tolerance per dtype. DDP computes the same sums as one process but in a different
# order (shard-wise, then across ranks), so results agree to rounding: ~1e-16 relative per
# operation in float64, ~1e-7 in float32, accumulated over a few dozen steps.
PARITY_TOLERANCE = {"float64": 1e-12, "float32": 1e-5}
# Steps whose shards train.py checks: one all-reduce of a count per row each, so not every step.
SHARD_CHECK_STEPS = 3


@dataclass
class TaskConfig(RunConfig):
    """Options of the shared task (each script's Config adds its own, if any)."""

    global_batch_size: int = 48
    """Samples per optimizer step, summed over all ranks; each rank takes global_batch_size / world_size of them."""
    n_samples: int = 480
    """Size of the synthetic regression data set; global batches walk through it in order."""
    d_in: int = 16
    """Input features of the data and the MLP."""
    d_hidden: int = 32
    """Hidden width of the MLP."""
    n_layers: int = 3
    """Linear layers in the MLP."""
    lr: float = 0.1
    """Learning rate of SGD."""
    momentum: float = 0.5
    """Momentum of SGD (its state stays identical on every rank, like the parameters)."""
    dtype: Literal["float64", "float32"] = "float64"
    """Parameter and data dtype: float64 makes DDP and one process agree to 1e-12, float32 to 1e-5."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("global_batch_size", "d_in", "d_hidden", "n_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.n_samples < self.global_batch_size:
            raise ValueError(f"--n-samples ({self.n_samples}) must be at least --global-batch-size "
                             f"({self.global_batch_size}), or a batch would hold a sample twice")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")


def check_batch_divides(global_batch_size: int, world_size: int) -> None:
    """Refuse a global batch that cannot be split into equal shards, in one sentence."""
    if world_size < 1 or global_batch_size % world_size:
        raise ValueError(f"--global-batch-size {global_batch_size} cannot be split evenly over "
                         f"{world_size} processes: choose a multiple of {world_size}")


def build_data(cfg: TaskConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set, identical on every rank (it is generated from the seed)."""
    X, Y = regression_data(n=cfg.n_samples, d_in=cfg.d_in, d_out=1, seed=cfg.seed,
                           dtype=DTYPES[cfg.dtype])
    return X.to(device), Y.to(device)


def build_model(cfg: TaskConfig, device: torch.device) -> nn.Module:
    """The MLP, initialised from the seed (on the CPU, so every device starts from the same numbers)."""
    seed_everything(cfg.seed)
    model = MLP(d_in=cfg.d_in, d_hidden=cfg.d_hidden, d_out=1, n_layers=cfg.n_layers)
    return model.to(device=device, dtype=DTYPES[cfg.dtype])


def build_optimizer(model: nn.Module, cfg: TaskConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def global_batch_indices(step: int, global_batch_size: int, n_samples: int) -> torch.Tensor:
    """Rows of the data set in step `step`'s global batch: the next `global_batch_size` rows,
    wrapping around at the end (every script, whatever its world size, sees the same batch)."""
    start = step * global_batch_size
    return torch.arange(start, start + global_batch_size) % n_samples


def shard_for_rank(indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous share of a global batch: rows [rank·b, (rank+1)·b), b = B / world_size.

    Equal shards matter: DDP *averages* gradients over ranks, and the average of per-shard
    mean losses equals the global-batch mean loss only when every shard holds B / world_size rows.
    """
    check_batch_divides(len(indices), world_size)
    per_rank = len(indices) // world_size
    return indices[rank * per_rank:(rank + 1) * per_rank]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               reduction: str = "mean") -> torch.Tensor:
    """One SGD step on (x, y); returns the loss. Under DDP, `backward()` also all-reduces
    (averages) the gradients over ranks, bucket by bucket, while it runs."""
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y, reduction=reduction)
    loss.backward()
    opt.step()
    return loss.detach()


def mean_over_ranks(value: torch.Tensor, world_size: int) -> torch.Tensor:
    """The mean of a per-rank value over all ranks (a collective: every rank must call it).
    SUM then divide, because gloo has no AVG reduction."""
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / world_size


def rows_held(local_indices: torch.Tensor, n_samples: int, device: torch.device) -> torch.Tensor:
    """How many ranks hold each data row this step (a collective): each rank counts its rows in
    a vector over the data set and a SUM all-reduce adds the ranks' vectors. An all-reduce, the
    collective every backend runs on CUDA tensors, gloo sharing one GPU included."""
    held = torch.bincount(local_indices.to(device), minlength=n_samples)
    dist.all_reduce(held, op=dist.ReduceOp.SUM)
    return held


def misplaced_rows(held: torch.Tensor, global_indices: torch.Tensor) -> int:
    """Data rows that the ranks together hold a different number of times than the global batch
    holds them: 0 when the shards partition the batch. A row two ranks share, a row of the batch
    nobody took and a row from outside the batch each count once."""
    wanted = torch.bincount(global_indices.to(held.device), minlength=held.numel())
    return int((held != wanted).sum().item())


def replica_spread(model: nn.Module, device: torch.device) -> float:
    """Largest |θ_rank − θ_0| over ranks and parameters (a collective): 0 when replicas agree."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(device)
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    return reduce_number((mine - rank0).abs().max(), "max")


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state_dicts with the same keys."""
    if a.keys() != b.keys():
        raise KeyError(f"state_dicts differ in keys: {sorted(a)} vs {sorted(b)}")
    return max((a[k].detach().double().cpu() - b[k].detach().double().cpu()).abs().max().item()
               for k in a)


def reference_state(cfg: TaskConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """What one process training on the whole global batch ends with: single.py's loop,
    without its logging. The DDP scripts compare their result with it."""
    X, Y = build_data(cfg, device)
    model = build_model(cfg, device)
    opt = build_optimizer(model, cfg)
    for step in range(cfg.steps):
        idx = global_batch_indices(step, cfg.global_batch_size, cfg.n_samples)
        train_step(model, opt, X[idx], Y[idx])
    return model.state_dict()
