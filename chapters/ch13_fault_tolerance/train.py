"""Survive a dead rank: periodic atomic checkpoints, a fault injector and torchrun restarts.

Every `--ckpt-every` steps rank 0 writes what all replicas share (model, optimizer, data position,
step, world size) and every rank its own RNG stream, each file atomically; after a barrier rank 0
commits the step in `latest`. A rank killed at `--fail-step` (first attempt only), in the step or
halfway through a save, makes torchrun restart the whole group, which resumes from `latest` and
ends bit-identical to a clean run. The checkpoint does not depend on the world size: an elastic
job that shrinks or grows resumes from it (per-rank streams re-derived after a resize).

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

import io
import math
import os
import signal
import statistics
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
from common.distributed import reduce_number, setup_distributed, teardown_distributed
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
    """Checkpoint folder (default: <out>/ckpt). A run resumes from its `latest` if there is one."""
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


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


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


def noise_seed(cfg: Config, rank: int, step: int = 0) -> int:
    """Seed of a rank's noise stream begun at `step`: at the start of the run, and after a
    resize (the saved per-rank streams belong to a world that no longer exists)."""
    return cfg.seed + 1 + rank + (step << 20)


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Checkpoint interval that minimises saving plus expected lost work, sqrt(2 δ M) (Young
    1974; Daly 2006 adds higher-order terms that matter only when δ is not small against M)."""
    return math.sqrt(2 * save_seconds * mtbf_seconds)


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


def write_file(path: Path, obj: dict, crash=None) -> None:
    """Atomic torch.save (temporary file, fsync, rename). `crash` (the fault injector) is called
    after half the bytes are written: the process dies with a half-written .tmp file."""
    def write(f) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        f.write(data[:len(data) // 2])
        if crash is not None:
            f.flush()
            crash()
        f.write(data[len(data) // 2:])

    atomic_write(path, write)


def save_state(ckpt_dir: Path, step: int, shared: dict, rng: dict, rank: int, crash=None) -> None:
    """Two phases, independent of the world size. Phase 1: rank 0 writes what every replica
    holds alike (model, optimizer, data position, step, world size) once, every rank its own RNG
    stream, each file atomically. Phase 2, after a barrier: rank 0 commits the step in `latest`.
    A crash before the commit leaves the previous complete checkpoint in charge."""
    folder = ckpt_dir / f"step{step:06d}"
    if rank == 0:
        write_file(folder / "state.pt", shared, crash)
    write_file(folder / f"rng{rank}.pt", rng, crash)
    dist.barrier()
    if rank == 0:
        atomic_write(ckpt_dir / "latest", lambda f: f.write(str(step).encode()))


def load_state(ckpt_dir: Path, rank: int, world_size: int) -> dict | None:
    """The last committed checkpoint, or None for a fresh start. Its `rng` is this rank's saved
    stream when the world size is the one that saved it, else None (a resize: rank r of the new
    world has no stream of its own in the checkpoint)."""
    latest = ckpt_dir / "latest"
    if not latest.exists():
        return None
    folder = ckpt_dir / f"step{int(latest.read_text()):06d}"
    state = load_checkpoint(folder / "state.pt")
    same_world = state["world_size"] == world_size
    state["rng"] = load_checkpoint(folder / f"rng{rank}.pt") if same_world else None
    return state


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
    seed_everything(noise_seed(cfg, info.rank))  # each rank its own noise stream
    start, cursor = 0, 0
    state = load_state(ckpt_dir, info.rank, info.world_size)
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
                    "model": model.state_dict(), "optimizer": [b.clone() for b in buffers]},
                    capture_rng_state(), info.rank,
                    crash=(lambda s=step + 1: die(cfg, info.rank, s)) if crash else None)
            save_s.append(t.elapsed)
    return {"model": model, "start": start, "losses": losses, "save_s": save_s}


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
            # A step fault loses the steps since the last save; a save fault that save as well.
            last_ckpt = (cfg.fail_step - (cfg.fail_in == "save")) // cfg.ckpt_every * cfg.ckpt_every
            rec.check("resumed from the last committed checkpoint", "count", result["start"], last_ckpt)
        # How often to save: Young/Daly with this run's save time and a job MTBF of 24 h (1 000
        # nodes of MTBF 1 000 days). A formula output, not a measurement of anything failing.
        saves = [reduce_number(t, "max") for t in result["save_s"]]  # each save: its slowest rank
        save = statistics.median(saves) if saves else 0.0
        rec.figure("checkpoint save, median (slowest rank)", round(save * 1e3, 2), unit="ms",
                   spread=(round(min(saves) * 1e3, 2), round(max(saves) * 1e3, 2)) if saves else None)
        rec.figure("Young/Daly interval for that save at M = 24 h (formula)",
                   round(young_daly_interval(save, 24 * 3600), 1), unit="s")
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt", {
                "model": result["model"].state_dict(), "restarts": restarts, "start": result["start"]})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
