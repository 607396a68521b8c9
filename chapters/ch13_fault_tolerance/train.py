"""Survive a dead rank: periodic atomic checkpoints, a fault injector and torchrun restarts.

Every `--ckpt-every` steps each rank writes model, optimizer, RNG and data position atomically and
rank 0 then commits the step in `latest`; a rank killed at `--fail-step` (first attempt only) makes
torchrun restart the whole group, which resumes from `latest` and ends bit-identical to a clean run.

Run:
    python chapters/ch13_fault_tolerance/train.py                                 # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch13_fault_tolerance/train.py   # no fault
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        chapters/ch13_fault_tolerance/train.py --fail-rank 1 --fail-step 7         # kill rank 1, restart
    torchrun --standalone --nproc_per_node=8 --max-restarts=3 chapters/ch13_fault_tolerance/train.py \\
        --fail-rank 3 --fail-step 7 --fail-how sigkill                             # 8 GPUs, NCCL
    torchrun --nnodes=1:2 --nproc_per_node=8 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=job13 chapters/ch13_fault_tolerance/train.py   # elastic nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch13_fault_tolerance/train.py   # Slurm (requeue resumes)
"""

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.checkpoint import atomic_write, load_checkpoint, save_checkpoint
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import capture_rng_state, restore_rng_state, seed_everything

STATE_PARTS = ("model", "optimizer", "rng", "data")


@dataclass
class Config(RunConfig):
    ckpt_every: int = 5
    """Write a checkpoint after every this many steps."""
    ckpt_dir: str = ""
    """Checkpoint folder (default: <out>/ckpt). A run resumes from its `latest` if there is one."""
    fail_rank: int = -1
    """Rank that dies at --fail-step on the first attempt (-1: no fault)."""
    fail_step: int = -1
    """Step at which --fail-rank dies, before its all-reduce (-1: no fault)."""
    fail_how: Literal["exit", "sigkill"] = "exit"
    """How the rank dies: os._exit(13) or SIGKILL (no Python cleanup at all)."""
    restore: tuple[str, ...] = STATE_PARTS
    """What a resume restores; leave parts out to see the run diverge (negative control)."""
    batch_size: int = 8
    """Samples per rank per step."""
    n_samples: int = 96
    """Size of the dataset (epochs are reshuffled, so the data position matters)."""
    lr: float = 0.05
    """Learning rate of SGD with momentum."""
    momentum: float = 0.9
    """Momentum of SGD (its buffers are the optimizer state a resume must restore)."""
    noise: float = 0.1
    """Std of Gaussian input noise drawn from each rank's RNG (the RNG state a resume must restore)."""
    step_seconds: float = 0.0
    """Sleep this long every step: time to kill a node by hand in the elastic demo."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ckpt_every < 1:
            raise ValueError(f"--ckpt-every must be at least 1, got {self.ckpt_every}")
        if (self.fail_rank < 0) != (self.fail_step < 0):
            raise ValueError("--fail-rank and --fail-step go together: set both or neither")
        if self.fail_step >= self.steps:
            raise ValueError(f"--fail-step {self.fail_step} is never reached in --steps {self.steps}")
        unknown = set(self.restore) - set(STATE_PARTS)
        if unknown or "model" not in self.restore:
            raise ValueError(f"--restore takes 'model' and any of {STATE_PARTS[1:]}, not {self.restore}")


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def maybe_inject_fault(cfg: Config, rank: int, step: int) -> None:
    """Kill this rank at the chosen step, on the first attempt only (the restart must succeed)."""
    if rank != cfg.fail_rank or step != cfg.fail_step or restart_count() > 0:
        return
    log.warning("rank %d: injected fault at step %d (%s)", rank, step, cfg.fail_how)
    sys.stdout.flush()
    if cfg.fail_how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(13)  # no finally, no destroy_process_group: like a crash


def batch_at(X, Y, cursor: int, rank: int, world_size: int, cfg: Config):
    """This rank's batch at data position `cursor` (samples consumed by the whole job so far);
    each epoch is a fresh permutation seeded by its number, so a position fixes the batch."""
    positions = cursor + rank * cfg.batch_size + torch.arange(cfg.batch_size)
    epochs = positions // cfg.n_samples
    perms = {int(e): torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
        cfg.seed * 1000 + int(e))) for e in epochs.unique()}
    idx = torch.stack([perms[int(e)][int(p)] for e, p in zip(epochs, positions % cfg.n_samples)])
    return X[idx], Y[idx]


def all_reduce_mean_(tensors: list[torch.Tensor], world_size: int) -> None:
    for t in tensors:
        dist.all_reduce(t)
        t /= world_size


def sgd_momentum_step(params, grads, buffers, cfg: Config) -> None:
    """torch.optim.SGD's update (dampening 0); `buffers` is the optimizer state."""
    with torch.no_grad():
        for p, g, b in zip(params, grads, buffers):
            b.mul_(cfg.momentum).add_(g)
            p.sub_(cfg.lr * b)


def save_state(ckpt_dir: Path, step: int, state: dict, rank: int) -> None:
    """Every rank writes its file atomically; only after a barrier does rank 0 commit the step
    in `latest`, so a crash mid-save leaves the previous complete checkpoint in charge."""
    save_checkpoint(ckpt_dir / f"step{step:06d}" / f"rank{rank}.pt", state)
    dist.barrier()
    if rank == 0:
        atomic_write(ckpt_dir / "latest", lambda f: f.write(str(step).encode()))


def load_state(ckpt_dir: Path, rank: int) -> dict | None:
    """The last committed checkpoint of this rank, or None for a fresh start."""
    latest = ckpt_dir / "latest"
    if not latest.exists():
        return None
    step = int(latest.read_text())
    return load_checkpoint(ckpt_dir / f"step{step:06d}" / f"rank{rank}.pt")


def train(cfg: Config, info, ckpt_dir: Path, rec=None, stop_at: int | None = None) -> dict:
    """The training loop with checkpoint/resume. `stop_at` ends it early without saving (a
    crash, for in-process experiments)."""
    dtype = torch.float64  # parity to the bit: resuming must change nothing
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=dtype)
    X, Y = X.to(info.device), Y.to(info.device)
    seed_everything(cfg.seed)  # same initial model on every rank
    model = MLP(8, 32, 1).to(info.device, dtype)
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    seed_everything(cfg.seed + 1 + info.rank)  # each rank its own noise stream
    start, cursor = 0, 0
    state = load_state(ckpt_dir, info.rank)
    if state is not None:
        start = state["step"]
        model.load_state_dict(state["model"])
        if "optimizer" in cfg.restore:
            for b, s in zip(buffers, state["optimizer"]):
                b.copy_(s)
        if "rng" in cfg.restore:
            restore_rng_state(state["rng"])
        if "data" in cfg.restore:
            cursor = state["cursor"]
        log.info("resumed from step %d (restart %d), restoring %s", start, restart_count(),
                 ", ".join(cfg.restore))
    losses = []
    for step in range(start, cfg.steps):
        if step == stop_at:
            break
        x, y = batch_at(X, Y, cursor, info.rank, info.world_size, cfg)
        cursor += cfg.batch_size * info.world_size
        x = x + cfg.noise * torch.randn_like(x)
        loss = F.mse_loss(model(x), y)
        grads = list(torch.autograd.grad(loss, params))
        maybe_inject_fault(cfg, info.rank, step)
        all_reduce_mean_(grads, info.world_size)
        sgd_momentum_step(params, grads, buffers, cfg)
        losses.append(loss.item())
        time.sleep(cfg.step_seconds)
        if rec is not None and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            rec.metrics(step, loss=loss.item(), lr=cfg.lr, restart=restart_count(),
                        world=info.world_size)
            log.info("step %3d  loss %.5f (rank 0's shard)", step, loss.item())
        if (step + 1) % cfg.ckpt_every == 0 or step == cfg.steps - 1:
            save_state(ckpt_dir, step + 1, {
                "step": step + 1, "cursor": cursor, "model": model.state_dict(),
                "optimizer": [b.clone() for b in buffers], "rng": capture_rng_state()}, info.rank)
    return {"model": model, "start": start, "losses": losses}


def replica_spread(model) -> float:
    """Largest difference of any parameter between ranks (0 when the replicas agree)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).max().item()


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        if cfg.fail_rank >= info.world_size:
            raise SystemExit(f"error: --fail-rank {cfg.fail_rank} does not exist in a world of "
                             f"{info.world_size}")
        rec = RunRecorder(cfg, __file__, info)
        ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else rec.out / "ckpt"
        log.info("world %d on %s/%s, attempt %d, checkpoints in %s", info.world_size, info.device,
                 info.backend, restart_count(), ckpt_dir)
        result = train(cfg, info, ckpt_dir, rec)

        restarts = restart_count()
        rec.figure("restarts (TORCHELASTIC_RESTART_COUNT)", restarts)
        rec.figure("resumed from step", result["start"])
        rec.figure("final loss (rank 0's shard)", result["losses"][-1] if result["losses"] else None)
        rec.check("replicas identical (max |dparam| across ranks)", "parity",
                  replica_spread(result["model"]), 0.0)
        if cfg.fail_rank >= 0 and restarts > 0:
            last_ckpt = cfg.fail_step // cfg.ckpt_every * cfg.ckpt_every
            rec.check("resumed from the last committed checkpoint", "count", result["start"], last_ckpt)
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt", {
                "model": result["model"].state_dict(), "restarts": restarts, "start": result["start"]})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
