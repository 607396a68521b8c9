"""DDP started by torch.multiprocessing.spawn instead of torchrun: this script starts its own
processes, hands each its rank as an argument, and sets the rendezvous address itself. The
training is train.py's, line for line; only the launcher differs.

    python chapters/ch02_single_node/spawn.py --nprocs 2                 # 2 processes, CPU (gloo)
    python chapters/ch02_single_node/spawn.py --nprocs 8 --device cuda   # 8 GPUs, one node (NCCL)
    python chapters/ch02_single_node/spawn.py --nprocs 1                 # world of one

Start it with plain `python`, never with torchrun (it would spawn nprocs processes per torchrun
rank). mp.spawn starts processes on this machine only: for torchrun, several nodes or Slurm use
train.py (`torchrun --standalone --nproc_per_node=2 chapters/ch02_single_node/train.py`; its
docstring has the multi-node and `srun` commands).
"""
# launch: python   (./course run 02 spawn starts this script with python, not torchrun)

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chapters.ch02_single_node.task import TaskConfig, check_batch_divides
from chapters.ch02_single_node.train import train
from common.config import parse_config
from common.distributed import (
    DistInfo,
    DistributedSetupError,
    choose_device_and_backend,
    free_port,
    teardown_distributed,
)
from common.log import log, setup_logging, shown_path
from common.results import default_out_dir


@dataclass
class Config(TaskConfig):
    """spawn.py's options: the shared task's plus how many processes to start."""

    nprocs: int = 2
    """Processes to start on this machine (one per GPU on a GPU machine)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nprocs < 1:
            raise ValueError(f"--nprocs must be at least 1, got {self.nprocs}")


def validate(cfg: Config, world_size: int) -> None:
    """This script starts its own ranks: its world is --nprocs (what torchrun says is ignored)."""
    check_batch_divides(cfg.global_batch_size, cfg.nprocs)


def set_rendezvous_address() -> str:
    """Where rank 0 will host the process group's key-value store: this machine, on a port the
    OS says is free now (a fixed 29500 collides with any other job on the machine). The
    spawned processes inherit these variables; init_method='env://' reads them."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


def setup_distributed(rank: int, world_size: int, device: str = "auto", backend: str = "auto",
                      timeout_s: float = 300.0) -> DistInfo:
    """Join the group as `rank` of `world_size`: the rank comes from mp.spawn, not from the
    environment. One machine, so the local rank is the rank."""
    dev, backend = choose_device_and_backend(rank, world_size, device, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # BEFORE init: 'the current device' of NCCL calls (ch01)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, rank, world_size, world_size, dev, backend, "mp.spawn")


def run_rank(rank: int, cfg: Config) -> None:
    """What every spawned process runs; mp.spawn passes the rank as the first argument."""
    # Each process gets its share of the cores (torchrun would set OMP_NUM_THREADS=1 instead).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.nprocs))
    info = setup_distributed(rank, cfg.nprocs, cfg.device, cfg.backend, cfg.timeout)
    try:
        status = train(cfg, info, script_file=__file__)
    finally:
        teardown_distributed()
    if status:
        sys.exit(status)  # the parent's mp.spawn raises ProcessExitedException


def raised_in_child(e: mp.ProcessRaisedException) -> str:
    """The rank and its exception, in one line: mp.spawn hands the parent the child's whole
    traceback as text, whose last line is the exception itself."""
    lines = [line.strip() for line in e.msg.splitlines() if line.strip()]
    return f"rank {e.error_index} raised {lines[-1] if lines else 'an exception'}"


def save_traceback(e: mp.ProcessRaisedException, out: str) -> str:
    """Keep the child's full traceback in the run's folder (or say where it could not go)."""
    path = (Path(out) if out else default_out_dir(__file__)) / f"traceback.rank{e.error_index}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(e.msg.lstrip())
    except OSError as err:
        return f"not saved ({err.strerror})"
    return shown_path(path)


def main(cfg: Config) -> int:
    setup_logging()
    try:  # the device choice every child will make, checked once here: one line, not N tracebacks
        choose_device_and_backend(0, cfg.nprocs, cfg.device, cfg.backend)
    except DistributedSetupError as e:
        print(f"spawn.py: error: {e}", file=sys.stderr)
        return 2
    address = set_rendezvous_address()
    log.info("spawning %d processes, rendezvous at %s", cfg.nprocs, address)
    # When one rank raises, mp.spawn terminates the others and logs a warning for each one still
    # alive (a race with how fast they notice the broken group): our own line below says the
    # same once, so its logger shows errors only.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        # The worker must be importable by name: spawned processes re-import this file as a
        # module (its main guard keeps them from spawning again) and look run_rank up in it.
        mp.spawn(run_rank, args=(cfg,), nprocs=cfg.nprocs, join=True)
    except mp.ProcessRaisedException as e:  # mp.spawn stopped the other ranks already
        print(f"spawn.py: error: {raised_in_child(e)}", file=sys.stderr)
        log.info("rank %d's traceback: %s", e.error_index, save_traceback(e, cfg.out))
        return 1
    except mp.ProcessExitedException as e:
        print(f"spawn.py: error: rank {e.error_index} exited with status {e.exit_code}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
