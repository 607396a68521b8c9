"""One process, one device, the whole global batch: the reference that the two DDP scripts of
chapter 02 (spawn.py, train.py) must reproduce. It is train.py without the distributed lines.

    python chapters/ch02_single_node/single.py                   # CPU, or the first GPU if any
    python chapters/ch02_single_node/single.py --device cuda     # insist on a GPU

One process only, by design: for torchrun (2 CPU processes, 8 GPUs, several nodes, Slurm) run
train.py (`torchrun --standalone --nproc_per_node=2 chapters/ch02_single_node/train.py`); for
mp.spawn run spawn.py. All three write final_params.pt, and with the same --seed and
--global-batch-size they end with the same parameters.
"""
# launch: python   (./course run 02 single starts this script with python, not torchrun)

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from chapters.ch02_single_node.task import (
    TaskConfig,
    build_data,
    build_model,
    build_optimizer,
    global_batch_indices,
    train_step,
)
from common.checkpoint import save_checkpoint
from common.config import parse_config
from common.distributed import (
    DistInfo,
    DistributedSetupError,
    choose_device_and_backend,
)
from common.log import log, setup_logging
from common.results import RunRecorder
from common.timing import Timer


@dataclass
class Config(TaskConfig):
    """single.py takes the shared task options only."""


def validate(cfg: Config, world_size: int) -> None:
    """One process by design: started by torchrun, every rank would train alone on the whole
    batch and write the same file."""
    if world_size != 1:
        raise ValueError("single.py is one process by design; for several processes run train.py "
                         "under torchrun or spawn.py")


def one_process(device: str = "auto") -> DistInfo:
    """This process's view of a 'job' of one: rank 0 of 1, on the first GPU if there is one
    (the device choice chapter 01 teaches, common.distributed's, for one local rank)."""
    dev, _ = choose_device_and_backend(0, 1, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=dev,
                    backend="none", launcher="single")


def train(cfg: Config, info: DistInfo, script_file: str = __file__) -> int:
    """The recipe: build, train for cfg.steps, record, save."""
    setup_logging(info.rank, info.world_size)
    rec = RunRecorder(cfg, script_file, info)
    X, Y = build_data(cfg, info.device)
    model = build_model(cfg, info.device)
    opt = build_optimizer(model, cfg)
    step_times = []
    for step in range(cfg.steps):
        idx = global_batch_indices(step, cfg.global_batch_size, cfg.n_samples)
        with Timer(info.device) as timer:
            loss = train_step(model, opt, X[idx], Y[idx])
        step_times.append(timer.elapsed)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            log.info("step %3d  loss %.6f", step, loss.item())
            rec.metrics(step, loss=loss, lr=cfg.lr)
    final = model.state_dict()
    save_checkpoint(rec.out / "final_params.pt", final)
    rec.figure("final loss", measured=loss.item(), unit="MSE")
    rec.figure("step time (median)", measured=statistics.median(step_times) * 1e3, unit="ms",
               spread=(min(step_times) * 1e3, max(step_times) * 1e3))
    return rec.finish()


def main(cfg: Config) -> int:
    try:
        info = one_process(cfg.device)
    except DistributedSetupError as e:  # one clear line, not a traceback
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        return 2
    return train(cfg, info)


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
