"""DDP launched by torchrun: one process per device, each training on its shard of every global
batch while DistributedDataParallel averages the gradients, so all ranks end with the parameters
single.py reaches alone. It is single.py plus the distributed lines (see the lesson's diff).

    python chapters/ch02_single_node/train.py                                   # world of one
    torchrun --standalone --nproc_per_node=2 chapters/ch02_single_node/train.py # 2 processes, CPU
    torchrun --standalone --nproc_per_node=8 chapters/ch02_single_node/train.py # 8 GPUs, one node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch02_single_node/train.py                                      # on each of 2 nodes
    srun --nodes=2 --ntasks-per-node=1 bash -c 'torchrun --nnodes=$SLURM_NNODES \\
        --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 \\
        chapters/ch02_single_node/train.py'                                     # Slurm, 2 nodes

The same training started by mp.spawn instead of torchrun: spawn.py.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch02_single_node.task import (
    PARITY_TOLERANCE,
    SHARD_CHECK_STEPS,
    TaskConfig,
    build_data,
    build_model,
    build_optimizer,
    check_batch_divides,
    global_batch_indices,
    max_param_diff,
    mean_over_ranks,
    misplaced_rows,
    reference_state,
    replica_spread,
    rows_held,
    shard_for_rank,
    train_step,
)
from common.checkpoint import save_checkpoint
from common.config import parse_config
from common.distributed import (
    DistInfo,
    DistributedSetupError,
    choose_device_and_backend,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.results import RunRecorder
from common.timing import Timer


@dataclass
class Config(TaskConfig):
    """train.py takes the shared task options; torchrun decides the world size."""


def validate(cfg: Config, world_size: int) -> None:
    """Equal shards or no DDP: the global batch must split evenly over the ranks."""
    check_batch_divides(cfg.global_batch_size, world_size)


def setup_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Join the job torchrun started, or make a world of one, and return this rank's view."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or a PyTorchJob) set these
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        launcher = "torchrun"
    elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:  # srun started the ranks
        raise DistributedSetupError(
            "srun started this process directly; run `srun ... torchrun ... train.py` (one torchrun "
            "per node) or chapter 01's train.py, which reads Slurm's variables")
    else:  # plain `python train.py`: a real group of one, so the same code runs
        rank, local_rank, world_size, local_world_size, launcher = 0, 0, 1, 1, "single"
    # Chapter 01's device choice (common.distributed's): cuda:local_rank when each local rank has
    # a GPU, an error when GPUs were asked for and none is visible, else the CPU; the backend
    # follows the device.
    dev, backend = choose_device_and_backend(local_rank, local_world_size, device, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # BEFORE init: 'the current device' of NCCL calls (ch01)
    timeout = datetime.timedelta(seconds=timeout_s)  # a dead peer becomes an error, not a hang
    if launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:  # env://: MASTER_ADDR and MASTER_PORT point at the store torchrun prepared
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timeout)
    return DistInfo(rank, local_rank, world_size, local_world_size, dev, backend, launcher)


def wrap_ddp(model: nn.Module, info: DistInfo) -> DDP:
    """Wrap the local replica in DDP. Construction broadcasts rank 0's parameters and buffers
    to every rank; afterwards each backward() all-reduces the gradients in buckets."""
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids)


def train(cfg: Config, info: DistInfo, script_file: str = __file__) -> int:
    """The recipe: build, train for cfg.steps, record, save."""
    setup_logging(info.rank, info.world_size)
    rec = RunRecorder(cfg, script_file, info)
    X, Y = build_data(cfg, info.device)
    model = wrap_ddp(build_model(cfg, info.device), info)
    opt = build_optimizer(model, cfg)
    step_times, misplaced, distinct = [], 0, 0
    checked = min(cfg.steps, SHARD_CHECK_STEPS)
    for step in range(cfg.steps):
        batch = global_batch_indices(step, cfg.global_batch_size, cfg.n_samples)
        idx = shard_for_rank(batch, info.rank, info.world_size)
        if step < checked:  # the ranks' shards together must be this step's global batch
            held = rows_held(idx, cfg.n_samples, info.device)
            misplaced += misplaced_rows(held, batch)
            distinct += int((held > 0).sum())
        with Timer(info.device) as timer:
            loss = train_step(model, opt, X[idx], Y[idx])
        step_times.append(timer.elapsed)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            loss = mean_over_ranks(loss, info.world_size)  # a collective: every rank gets here
            log.info("step %3d  loss %.6f", step, loss.item())
            rec.metrics(step, loss=loss, lr=cfg.lr)
    final = model.module.state_dict()  # the plain model's keys, as single.py saves them
    if info.is_main:
        save_checkpoint(rec.out / "final_params.pt", final)
    rec.figure("final loss", measured=loss.item(), unit="MSE")
    rec.figure("step time (median)", measured=statistics.median(step_times) * 1e3, unit="ms",
               spread=(min(step_times) * 1e3, max(step_times) * 1e3))
    rec.check(f"rows the shards miss, repeat or add ({checked} steps)", "count",
              measured=misplaced, expected=0)
    # The sibling that proves the merged counts count: a rank's own shard alone is B / W rows.
    rec.check(f"distinct rows the ranks hold ({checked} steps)", "count", measured=distinct,
              expected=checked * cfg.global_batch_size)
    rec.check("replicas identical on every rank", "parity",
              measured=replica_spread(model, info.device), expected=0.0, tolerance=0.0)
    rec.check("DDP == one process on the global batch", "parity",
              measured=max_param_diff(final, reference_state(cfg, info.device)), expected=0.0,
              tolerance=PARITY_TOLERANCE[cfg.dtype])
    return rec.finish()


def main(cfg: Config) -> int:
    try:
        info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    except DistributedSetupError as e:  # one clear line, not a traceback
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        return 2
    try:
        return train(cfg, info)
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
