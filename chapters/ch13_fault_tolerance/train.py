"""Survive a dead rank: periodic atomic checkpoints, a fault injector and torchrun restarts.

Every `--ckpt-every` steps rank 0 writes what all replicas share (model, optimizer, data position,
step, world size, run id, shapes) and every rank its own RNG stream, each file atomically; once
every rank's file is written, rank 0 commits the step: `manifest.json` (every file's size and
SHA-256), then `latest`. A rank killed at `--fail-step` (first attempt only), in the step or
halfway through a save, makes torchrun restart the whole group, which resumes from the newest
checkpoint that verifies and ends bit-identical to a clean run. A damaged checkpoint (flipped
bytes, a truncated or missing file, a torn manifest) is skipped in one line for the previous one
and kept aside, never deleted; another run's checkpoint is refused in one line. The checkpoint
does not depend on the world size: an elastic job that shrinks or grows resumes from it (per-rank
streams re-derived after a resize). One run at a time: global rank 0 locks `--out` and
`--ckpt-dir` (`common.config.parse_config`).

Run:
    python chapters/ch13_fault_tolerance/train.py                                 # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch13_fault_tolerance/train.py   # no fault
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        chapters/ch13_fault_tolerance/train.py --fail-rank 1 --fail-step 7         # kill rank 1, restart
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        chapters/ch13_fault_tolerance/train.py --fail-rank 1 --fail-step 10 --fail-in save   # dies mid-save
    torchrun --standalone --nproc_per_node=8 --max-restarts=3 chapters/ch13_fault_tolerance/train.py \\
        --fail-rank 3 --fail-step 7 --fail-how sigkill                             # 8 GPUs, NCCL
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc_per_node=8 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=job13 \\
        chapters/ch13_fault_tolerance/train.py --out /shared/run13     # elastic nodes, shared --out
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch13_fault_tolerance/train.py \\
        --out /shared/run13                                 # Slurm (a requeued job resumes)
"""

# The checkpoint and its verified resume are in checkpoints.py; what keeps the run resumable at any
# world size (data position, noise streams, restart count) in elastic.py; the proofs the run
# records in checks.py. This file: the config, the fault injector, the loop and main().

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from chapters.ch13_fault_tolerance.checkpoints import load_state, save_state
from chapters.ch13_fault_tolerance.checks import record_checks
from chapters.ch13_fault_tolerance.elastic import (
    all_reduce_mean_,
    batch_at,
    noise_seed,
    restart_count,
    sgd_momentum_step,
)
from common.checkpoint import run_id, save_checkpoint, training_shapes
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import capture_rng_state, restore_rng_state, seed_everything
from common.timing import Timer

STATE_PARTS = ("model", "optimizer", "rng", "data")


@dataclass
class Config(RunConfig):
    ckpt_every: int = 5
    """Write a checkpoint after every this many steps."""
    ckpt_dir: str = ""
    """Checkpoint folder (default: <out>/ckpt), locked by the run. A run resumes from its newest checkpoint that verifies, if it has one."""
    fail_rank: int = -1
    """Rank that dies at --fail-step on the first attempt (-1: no fault)."""
    fail_step: int = -1
    """Step at which --fail-rank dies, before its all-reduce (-1: no fault)."""
    fail_how: Literal["exit", "sigkill"] = "exit"
    """How the rank dies: os._exit(13) or SIGKILL (no Python cleanup at all)."""
    fail_in: Literal["step", "save"] = "step"
    """Where: in step --fail-step before its all-reduce, or halfway through writing the checkpoint of step --fail-step."""
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
        if self.fail_in == "save" and self.fail_step >= 0 and (
                self.fail_step == 0 or self.fail_step % self.ckpt_every):
            raise ValueError(f"--fail-in save needs a --fail-step that is saved: a multiple of "
                             f"--ckpt-every {self.ckpt_every}")
        unknown = set(self.restore) - set(STATE_PARTS)
        if unknown or "model" not in self.restore:
            raise ValueError(f"--restore takes 'model' and any of {STATE_PARTS[1:]}, not {self.restore}")


def validate(cfg: Config, world_size: int) -> None:
    """The rank that is told to fail must exist; everything else works at any world size (the
    batch is per rank, the data position is global)."""
    if cfg.fail_rank >= world_size:
        raise ValueError(f"--fail-rank {cfg.fail_rank} does not exist in a world of {world_size}")


def train(cfg: Config, info, ckpt_dir: Path, rec=None, stop_at: int | None = None) -> dict:
    """The training loop with checkpoint/resume. `stop_at` ends it early without saving (a
    crash, for in-process experiments). The run's id is kept in its `--out` (`rec.out`); called
    without a recorder (a test, the notebook), in the checkpoint folder."""
    dtype = torch.float64  # parity to the bit: resuming must change nothing
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=dtype)
    X, Y = X.to(info.device), Y.to(info.device)
    seed_everything(cfg.seed)  # same initial model on every rank
    model = MLP(8, 32, 1).to(info.device, dtype)
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    seed_everything(noise_seed(cfg, info.rank))  # each rank its own noise stream
    start, cursor = 0, 0
    identity = {"run_id": run_id(rec.out if rec is not None else ckpt_dir),
                "shapes": training_shapes(model)}
    state = load_state(ckpt_dir, info.rank, info.world_size, identity)
    if state is not None:
        start = state["step"]
        model.load_state_dict(state["model"])
        if "optimizer" in cfg.restore:
            for b, s in zip(buffers, state["optimizer"]):
                b.copy_(s)
        if "rng" in cfg.restore and state["rng"] is not None:
            restore_rng_state(state["rng"])
        elif "rng" in cfg.restore:  # a resize: every rank starts a stream of its own, reproducibly
            seed_everything(noise_seed(cfg, info.rank, start))
            log.info("world %d -> %d: noise streams re-derived from (seed, step, rank)",
                     state["world_size"], info.world_size)
        if "data" in cfg.restore:
            cursor = state["cursor"]
        log.info("resumed from step %d (restart %d), restoring %s", start, restart_count(),
                 ", ".join(cfg.restore))
    losses, save_s = [], []
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
            crash = fault_due(cfg, info.rank, step + 1, "save")
            with Timer(info.device) as t:
                save_state(ckpt_dir, step + 1, {
                    "step": step + 1, "cursor": cursor, "world_size": info.world_size,
                    "model": model.state_dict(), "optimizer": [b.clone() for b in buffers],
                    **identity},
                    capture_rng_state(), info.rank,
                    crash=(lambda s=step + 1: die(cfg, info.rank, s)) if crash else None)
            save_s.append(t.elapsed)
    return {"model": model, "start": start, "losses": losses, "save_s": save_s,
            "resumed_from": state["folder"] if state is not None else None}


def fault_due(cfg: Config, rank: int, step: int, where: str) -> bool:
    """Is this the rank, step and place chosen to fail? Only on the first attempt, so that the
    restart can succeed."""
    return (rank == cfg.fail_rank and step == cfg.fail_step and where == cfg.fail_in
            and restart_count() == 0)


def die(cfg: Config, rank: int, step: int) -> None:
    """Die like a crash: no finally, no destroy_process_group."""
    log.warning("rank %d: injected fault at step %d (%s, in the %s)", rank, step, cfg.fail_how,
                cfg.fail_in)
    sys.stdout.flush()
    if cfg.fail_how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(13)


def maybe_inject_fault(cfg: Config, rank: int, step: int) -> None:
    """Kill this rank in the chosen step, on the first attempt only."""
    if fault_due(cfg, rank, step, "step"):
        die(cfg, rank, step)


def main(cfg: Config) -> int:
    # One run per folder: parse_config has global rank 0 lock --out and --ckpt-dir before any
    # process group exists (common.config; a second run is refused there in one line).
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else rec.out / "ckpt"
        log.info("world %d on %s/%s, attempt %d, checkpoints in %s", info.world_size, info.device,
                 info.backend, restart_count(), ckpt_dir)
        result = train(cfg, info, ckpt_dir, rec)
        record_checks(rec, cfg, info, result, ckpt_dir)
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt", {
                "model": result["model"].state_dict(), "restarts": restart_count(),
                "start": result["start"]})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
