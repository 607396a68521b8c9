"""Data parallelism by hand and with DDP, checked against one process on the global batch.

Every rank holds the whole model and a shard of each global batch; after backward the ranks
average their gradients with one all-reduce, so every replica takes the same step as one
process that saw the whole batch. This script trains the same model three ways (one process,
hand-written all-reduce, DDP with `no_sync` accumulation), shows the token-normalisation bug
of uneven batches and its fix, and checks the scaled learning-rate schedule.

Run:
    python chapters/ch03_data_parallel/train.py                                  # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch03_data_parallel/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch03_data_parallel/train.py --global-batch-size 48
    torchrun --standalone --nproc_per_node=8 chapters/ch03_data_parallel/train.py   # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch03_data_parallel/train.py                                     # two nodes
    srun --ntasks=16 --ntasks-per-node=8 --gpus-per-node=8 python chapters/ch03_data_parallel/train.py
                                                                                 # Slurm, 16 GPUs
The default global batch, 96 = ranks x 2 micro-batches x samples, divides over 1, 2, 3, 4, 8
and 16 ranks.
"""


import copy
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch03_data_parallel import token_loss
from chapters.ch03_data_parallel.data_parallel import (
    all_reduce_gradients,
    max_param_diff,
    micro_batches,
    wrap_ddp,
)
from chapters.ch03_data_parallel.tap import AllReduceTap
from common.checkpoint import save_checkpoint
from common.config import RunConfig, check_global_batch, parse_config, require_at_least_one
from common.data import regression_data
from common.distributed import DistributedSetupError, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Config(RunConfig):
    global_batch_size: int = 96
    """Samples per optimizer step, summed over all ranks and micro-batches (96 divides over 1, 2, 3, 4, 8 and 16 ranks x 2 micro-batches)."""
    grad_accum_steps: int = 2
    """Micro-batches each rank accumulates before the gradients are averaged and applied."""
    base_lr: float = 0.05
    """Learning rate at the base batch size (before the linear scaling rule)."""
    base_batch_size: int = 48
    """Batch size at which base_lr was tuned: lr = base_lr * global_batch_size / base_batch_size."""
    warmup_steps: int = 5
    """Steps of linear warm-up from lr/warmup_steps to the scaled lr."""
    dtype: str = "float64"
    """float64: parity within 1e-12; float32: within 1e-5 (rounding, see the lesson)."""
    d_in: int = 16
    """Input features of the MLP."""
    d_hidden: int = 64
    """Hidden width of the MLP."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        require_at_least_one(self, "global_batch_size", "grad_accum_steps", "base_batch_size", "warmup_steps")


# Parity tolerance per dtype: the ranks compute the same sums as one process in another order.
# Reordering a sum of n terms moves it by at most ~n·u·Σ|terms| (u: unit roundoff, 1.1e-16 in
# float64, 6e-8 in float32); 20 steps x 96 samples x u is 2e-13 in float64 (tolerance 1e-12) and
# 1.2e-4 in float32, where errors of random sign grow like √n: ~3e-6 (tolerance 1e-5).
PARITY_TOLERANCE = {"float64": 1e-12, "float32": 1e-5}


def validate(cfg: Config, world_size: int) -> None:
    """The global batch must split into equal micro-batches: ranks x grad_accum_steps of them."""
    check_global_batch(cfg.global_batch_size, world_size, cfg.grad_accum_steps)


def scaled_lr(step: int, cfg: Config) -> float:
    """Linear scaling rule with linear warm-up (Goyal et al., 2017)."""
    peak = cfg.base_lr * cfg.global_batch_size / cfg.base_batch_size
    return peak * min(1.0, (step + 1) / cfg.warmup_steps)


def make_optimizer(model: nn.Module, cfg: Config):
    opt = torch.optim.SGD(model.parameters(), lr=cfg.base_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: scaled_lr(s, cfg) / cfg.base_lr)
    return opt, sched


def warmup_ramp(cfg: Config) -> torch.Tensor:
    """The schedule the lesson states, built without `scaled_lr`: `warmup_steps` evenly spaced
    rates from peak / warmup_steps up to the peak base_lr · B / B_base, then the peak."""
    peak = cfg.base_lr * cfg.global_batch_size / cfg.base_batch_size
    ramp = torch.linspace(peak / cfg.warmup_steps, peak, cfg.warmup_steps, dtype=torch.float64)
    return torch.cat([ramp, torch.full((max(0, cfg.steps - cfg.warmup_steps),), peak,
                                       dtype=torch.float64)])[:cfg.steps]


def train_single(model: nn.Module, X, Y, cfg: Config) -> list[float]:
    """The reference: one process, the whole global batch in one backward per step."""
    opt, sched = make_optimizer(model, cfg)
    losses = []
    for step in range(cfg.steps):
        loss = F.mse_loss(model(X[step]), Y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def train_hand_dp(model: nn.Module, X, Y, cfg: Config, rank: int, world_size: int) -> dict:
    """Accumulate k micro-batches locally, then one all-reduce per gradient, then step.
    Returns the all-reduce calls and bytes the tap saw, the learning rate and the wall time of
    every step."""
    opt, sched = make_optimizer(model, cfg)
    k, lrs, times = cfg.grad_accum_steps, [], []
    with AllReduceTap() as tap:
        for step in range(cfg.steps):
            with Timer(X.device) as timer:  # synchronises CUDA before reading the clock
                opt.zero_grad()
                for x, y in zip(micro_batches(X[step], rank, world_size, k),
                                micro_batches(Y[step], rank, world_size, k)):
                    (F.mse_loss(model(x), y) / k).backward()  # / k: mean over the k micro-batches
                all_reduce_gradients(model, world_size)
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
            times.append(timer.elapsed)
    return {"all_reduce_calls": tap.calls, "bytes": tap.nbytes, "lrs": lrs, "step_times": times}


def train_ddp(model: nn.Module, X, Y, cfg: Config, info, use_no_sync: bool = True,
              divide_by_k: bool = True) -> dict:
    """DDP with gradient accumulation: `no_sync` on the first k-1 micro-batches skips their
    all-reduce; the k-th backward all-reduces the accumulated gradients. Each micro-batch's
    mean loss is divided by k (`divide_by_k=False` is the classic bug, kept as the negative
    control: DDP averages over ranks, never over micro-batches). Returns the all-reduces the tap
    saw in all (`calls`, `bytes`) and during each micro-batch, and every step's wall time."""
    ddp = wrap_ddp(model, info)
    opt, sched = make_optimizer(ddp, cfg)
    k, calls_per_micro, times = cfg.grad_accum_steps, [], []
    with AllReduceTap() as tap:
        for step in range(cfg.steps):
            with Timer(X.device) as timer:  # the step only: DDP's construction is not timed
                opt.zero_grad()
                pairs = list(zip(micro_batches(X[step], info.rank, info.world_size, k),
                                 micro_batches(Y[step], info.rank, info.world_size, k)))
                scale = k if divide_by_k else 1
                for i, (x, y) in enumerate(pairs):
                    before = tap.calls
                    if i == k - 1 or not use_no_sync:
                        (F.mse_loss(ddp(x), y) / scale).backward()
                    else:
                        with ddp.no_sync():  # forward and backward inside: no all-reduce now
                            (F.mse_loss(ddp(x), y) / scale).backward()
                    calls_per_micro.append(tap.calls - before)
                opt.step()
                sched.step()
            times.append(timer.elapsed)
    return {"calls": tap.calls, "bytes": tap.nbytes, "calls_per_micro": calls_per_micro,
            "step_times": times}


def global_batches(cfg: Config, device: torch.device):
    """The same global batches on every rank (steps × global_batch_size × features)."""
    dtype = DTYPES[cfg.dtype]
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed, dtype=dtype)
    shape = (cfg.steps, cfg.global_batch_size)
    return X.view(*shape, cfg.d_in).to(device), Y.view(*shape, 1).to(device)


def time_figure(rec: RunRecorder, name: str, seconds: list[float]) -> None:
    """Median step time with its min-max over the steps (a timing: it varies between runs)."""
    ms = [t * 1e3 for t in seconds]
    rec.figure(name, statistics.median(ms), unit="ms", spread=(min(ms), max(ms)))


def main(cfg: Config) -> int:
    try:
        info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    except DistributedSetupError as e:  # e.g. --backend nccl on a CPU: one clear line
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        return 2
    try:
        setup_logging(info.rank, info.world_size)
        per_step = info.world_size * cfg.grad_accum_steps
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        X, Y = global_batches(cfg, info.device)
        model = MLP(cfg.d_in, cfg.d_hidden, 1).to(info.device, DTYPES[cfg.dtype])
        single, hand, ddp_model = (copy.deepcopy(model) for _ in range(3))
        log.info("world %d on %s/%s: global batch %d = %d ranks x %d micro-batches x %d samples",
                 info.world_size, info.device, info.backend, cfg.global_batch_size,
                 info.world_size, cfg.grad_accum_steps, cfg.global_batch_size // per_step)

        losses = train_single(single, X, Y, cfg)  # every rank can afford the reference here
        hand_log = train_hand_dp(hand, X, Y, cfg, info.rank, info.world_size)
        ddp_log = train_ddp(ddp_model, X, Y, cfg, info)
        for step, (loss, lr) in enumerate(zip(losses, hand_log["lrs"])):
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                rec.metrics(step, loss=loss, lr=lr)
                log.info("step %3d  loss %.5f  lr %.4f", step, loss, lr)

        tol = PARITY_TOLERANCE[cfg.dtype]
        rec.check("hand DP == one process (max |dparam|)", "parity",
                  max_param_diff(hand, single), 0.0, tol)
        rec.check("DDP == one process (max |dparam|)", "parity",
                  max_param_diff(ddp_model, single), 0.0, tol)
        rec.check("hand DP == DDP (max |dparam|)", "parity", max_param_diff(hand, ddp_model), 0.0, tol)

        # Counted by AllReduceTap where torch.distributed is called, not by the loops themselves.
        n_tensors = len(list(model.parameters()))
        rec.check("hand DP all-reduce calls = steps x tensors", "count",
                  hand_log["all_reduce_calls"], cfg.steps * n_tensors)
        k = cfg.grad_accum_steps
        inside = [c for i, c in enumerate(ddp_log["calls_per_micro"]) if i % k != k - 1]
        last = [c for i, c in enumerate(ddp_log["calls_per_micro"]) if i % k == k - 1]
        rec.check("DDP all-reduces inside no_sync", "count", sum(inside), 0)
        # The sibling that proves the counter counts: every step all-reduces at least one bucket.
        rec.check("DDP all-reduces on the k-th micro-batch >= steps", "count", sum(last),
                  cfg.steps, compare=">=")
        n_params = sum(p.numel() for p in model.parameters())
        elem = torch.finfo(DTYPES[cfg.dtype]).bits // 8
        rec.check("hand DP bytes all-reduced = steps x params x bytes", "formula",
                  hand_log["bytes"], cfg.steps * n_params * elem)
        rec.check("DDP bytes all-reduced = steps x params x bytes", "formula",
                  ddp_log["bytes"], cfg.steps * n_params * elem)
        # The optimizer's rates against the ramp the lesson states, built without scaled_lr.
        lr_err = (torch.tensor(hand_log["lrs"], dtype=torch.float64) - warmup_ramp(cfg)).abs().max()
        rec.check("lr schedule == linear scaling x warm-up", "formula", lr_err.item(), 0.0, 1e-12)

        tok = token_loss.compare(cfg, info)
        rec.check("global-token normalisation == one process", "parity", tok["global"], 0.0, tol)
        # The negative control of the same parity check: the naive mean must fail it.
        rec.check("naive per-batch mean differs from one process", "parity", tok["naive"],
                  tol, compare=">")
        rec.check("token DDP all-reduces inside no_sync", "count", tok["calls_inside_no_sync"], 0)
        rec.check("token DDP all-reduces, k-th micro-batch >= steps", "count",
                  tok["calls_last_micro"], cfg.steps, compare=">=")

        rec.figure("final loss", losses[-1])
        rec.figure("DDP buckets per step", ddp_log["calls"] / cfg.steps)
        time_figure(rec, "hand DP time per step", hand_log["step_times"])
        time_figure(rec, "DDP time per step", ddp_log["step_times"])
        rec.figure("all-reduce calls per step, hand DP", hand_log["all_reduce_calls"] / cfg.steps,
                   expected=n_tensors)
        rec.figure("DDP bytes per step", ddp_log["bytes"] / cfg.steps,
                   expected=n_params * elem, unit="bytes")
        rec.figure("tokens per rank, first step", [c[0] for c in tok["tokens_per_rank"]])
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt", {
                "single": single.state_dict(), "hand": hand.state_dict(), "ddp": ddp_model.state_dict(),
                "losses": torch.tensor(losses), "lrs": torch.tensor(hand_log["lrs"])})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
