"""nn.DataParallel, counted: ONE process drives every device. Each forward scatters the batch,
replicates the module onto every device, runs the replicas in threads and gathers the outputs
on device 0; the backward sums every replica's gradients back onto device 0's parameters.

    python chapters/ch02_single_node/dataparallel.py                  # every GPU if 2+, else CPU
    python chapters/ch02_single_node/dataparallel.py --devices 4      # 4 GPUs, or 4 simulated

With two GPUs or more (`--device auto`, or `--device cuda`, which refuses fewer; either refuses
`--devices` beyond the GPUs) the model is wrapped in torch's own nn.DataParallel, and the same
global batch is then trained by DDP (spawn.py, one process per GPU) for the timing comparison.
Without two GPUs torch's DataParallel does not replicate, so on the CPU the script runs torch's
own DataParallel.forward, scatter, replicate and gather (not copies of them) over simulated
devices: SimulatedDataParallel (simulated_devices.py) replaces only the autograd Functions that
move tensors between devices (Scatter, Gather, Broadcast) and parallel_apply (torch's needs an
accelerator). Either way MechanismTap (counting.py) counts, at those four calls and at both ends
of the backward, what was copied and summed, and the run checks the counts against their closed
forms and the parameters against one process on the whole batch. Start it with plain `python`: it is one process by design
(under torchrun every rank would run its own DataParallel job).
"""
# launch: python   (./course run 02 dataparallel starts this script with python, not torchrun)

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from chapters.ch02_single_node.counting import (
    CHECKED,
    MechanismTap,
    expected_per_step,
    measured_per_step,
    n_params,
)
from chapters.ch02_single_node.simulated_devices import SimulatedDataParallel
from chapters.ch02_single_node.task import (
    PARITY_TOLERANCE,
    TaskConfig,
    build_data,
    build_model,
    build_optimizer,
    global_batch_indices,
    max_param_diff,
    reference_state,
    train_step,
)
from common.checkpoint import save_checkpoint
from common.config import parse_config
from common.distributed import DistInfo
from common.log import log, setup_logging
from common.results import RunRecorder


@dataclass
class Config(TaskConfig):
    """dataparallel.py's options: the shared task's plus DataParallel's devices."""

    devices: int = 0
    """DataParallel's devices: 0 = every GPU (2 or more, --device auto or cuda), else 2 simulated
    CPU devices."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.devices == 1 or self.devices < 0:
            raise ValueError(f"--devices must be 0 (all) or at least 2, got {self.devices} (with "
                             "one device DataParallel just calls the module)")


def validate(cfg: Config, world_size: int) -> None:
    """One process by design; its world is its devices (what torchrun says is ignored, as for
    spawn.py). Real DataParallel needs two GPUs: `--device cuda` with fewer is refused here,
    before anything starts (so `./course gpu-check` reports it n/a on a one-GPU machine), and
    so is `--devices N` beyond the GPUs that `--device auto` would use (2 or more GPUs)."""
    gpus = torch.cuda.device_count()
    if cfg.device == "cuda" or (cfg.device == "auto" and gpus >= 2):
        wanted = cfg.devices or gpus
        if gpus < 2 or wanted > gpus:
            raise ValueError(f"--device {cfg.device}: nn.DataParallel needs {max(wanted, 2)} GPUs "
                             f"and torch sees {gpus}; --device cpu simulates the devices")


def data_parallel_devices(cfg: Config) -> tuple[str, int]:
    """('cuda', n) for torch's DataParallel over n GPUs, or ('cpu', n) for n simulated devices.
    `--device auto` takes the GPUs when there are two or more."""
    gpus = torch.cuda.device_count()
    if cfg.device == "cuda" or (cfg.device == "auto" and gpus >= 2):
        return "cuda", cfg.devices or gpus
    return "cpu", cfg.devices or 2


def wrap_data_parallel(model: nn.Module, kind: str, n: int) -> nn.DataParallel:
    """torch's DataParallel over n GPUs, or the simulated one over n CPU devices."""
    if kind == "cuda":
        return nn.DataParallel(model, device_ids=list(range(n)))
    return SimulatedDataParallel(model, n)


def synchronize(kind: str, n: int) -> None:
    """Wait for every device's queued work (a no-op on the CPU). Waiting for cuda:0 alone
    would do here (its NCCL reduce cannot finish before every replica's backward has, and the
    optimizer step runs on it), but every device is cheaper to argue about."""
    if kind == "cuda":
        for d in range(n):
            torch.cuda.synchronize(d)


def train_data_parallel(cfg: Config, kind: str, n: int, dp_class=None, count: bool = True,
                        batch_on_host: bool = True):
    """cfg.steps SGD steps of the shared task with the model wrapped in DataParallel over n
    devices (`dp_class(model, n)` instead, for the tests' broken variants; n = 1 and
    `dp_class=None`: the bare model on device 0). The batch stays on the host, where
    DataParallel scatters it from (what the closed forms count), or with `batch_on_host=False`
    lives on device 0, as DDP's lives on its device (the timed runs); the targets are on device
    0, where the output is gathered. Each step is timed between synchronisations of every
    device. With `count` a MechanismTap counts every forward. Returns (model, tap or None,
    losses, step seconds)."""
    src = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    X, Y = build_data(cfg, torch.device("cpu") if batch_on_host else src)
    model = build_model(cfg, src)
    if dp_class is not None:
        dp = dp_class(model, n)
    else:
        dp = wrap_data_parallel(model, kind, n) if n > 1 else model
    tap = MechanismTap(dp) if count else None
    opt = build_optimizer(model, cfg)
    losses, seconds = [], []
    # A simulated device is a thread, as a GPU is one device: no intra-op threads besides
    # (on a busy 2-core machine they wait for each other at every operation).
    threads = torch.get_num_threads()
    if kind == "cpu":
        torch.set_num_threads(1)
    try:
        for step in range(cfg.steps):
            idx = global_batch_indices(step, cfg.global_batch_size, cfg.n_samples)
            synchronize(kind, n)
            t0 = time.perf_counter()
            loss = train_step(dp, opt, X[idx], Y[idx].to(src))
            synchronize(kind, n)
            seconds.append(time.perf_counter() - t0)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return model, tap, losses, seconds


def ddp_step_time(cfg: Config, n: int, out: Path, device: str = "cuda") -> float | None:
    """DDP on the same task, batch and n GPUs, one process each (spawn.py's run): its median
    step time in ms, or None if it failed."""
    from chapters.ch02_single_node import spawn

    task = {f.name: getattr(cfg, f.name) for f in fields(TaskConfig)}
    ddp = spawn.Config(**{**task, "out": str(out), "device": device, "nprocs": n})
    if spawn.main(ddp) != 0:
        return None
    summary = json.loads((out / "summary.json").read_text())
    return summary["figures"]["step time (median)"]["measured"]


def _ms(seconds: list[float]) -> tuple[float, tuple[float, float]]:
    return statistics.median(seconds) * 1e3, (min(seconds) * 1e3, max(seconds) * 1e3)


def train(cfg: Config, script_file: str = __file__) -> int:
    setup_logging()
    kind, n = data_parallel_devices(cfg)
    src = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=src,
                    backend="none", launcher="single")
    rec = RunRecorder(cfg, script_file, info)
    what = f"torch's nn.DataParallel over {n} GPUs" if kind == "cuda" else \
        f"torch's DataParallel.forward over {n} simulated CPU devices"
    log.info("%s, one process (pid %d)", what, os.getpid())
    model, tap, losses, counted_seconds = train_data_parallel(cfg, kind, n)
    save_checkpoint(rec.out / "final_params.pt", model.state_dict())
    # Timed without the tap (it synchronises every device around each call, compares the
    # copies with the parameters and sums the replicas' gradients again), with the batch on
    # device 0 as DDP's is on its device; and one device alone on the same global batch.
    seconds = train_data_parallel(cfg, kind, n, count=False, batch_on_host=False)[3]
    alone = train_data_parallel(cfg, kind, 1, count=False, batch_on_host=False)[3]
    for step, loss in enumerate(losses):
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            log.info("step %3d  loss %.6f", step, loss)
            r = tap.records[step]
            rec.metrics(step, loss=loss, lr=cfg.lr, replicas=r.replicas,
                        copied_param_bytes=r.copied_param_bytes, chunk_rows=r.chunk_rows)
    itemsize = next(model.parameters()).element_size()
    expected = expected_per_step(cfg, n, itemsize)
    measured = [measured_per_step(r) for r in tap.records]
    rec.figure("final loss", measured=losses[-1], unit="MSE")
    rec.figure("parameters P", measured=sum(p.numel() for p in model.parameters()),
               expected=n_params(cfg), unit="elements")
    rec.figure("rows per device, step 0", measured=tap.records[0].chunk_rows, unit="rows")
    rec.figure("replica devices, step 0", measured=tap.records[0].replica_devices, unit="",
               table=False)
    rec.figure("per step, measured", measured=measured, table=False)
    rec.figure("device 0 grad - sum of replicas' (max)",
               measured=max(r.grad_sum_error for r in tap.records), unit="")
    median, spread = _ms(seconds)
    rec.figure("step time, DataParallel (median)", measured=median, unit="ms", spread=spread)
    rec.figure("step time, one device (median)", measured=_ms(alone)[0], unit="ms",
               spread=_ms(alone)[1])
    # The share of a counted step spent in scatter, replicate and gather (each timed between
    # device synchronisations), the tap's own bookkeeping taken out of the step's time.
    overhead = [sum(r.seconds[p] for p in ("scatter", "replicate", "gather")) / (s - r.tap_seconds)
                for r, s in zip(tap.records, counted_seconds)]
    rec.figure("scatter+replicate+gather / step", measured=statistics.median(overhead) * 100,
               unit="%", spread=(min(overhead) * 100, max(overhead) * 100))
    reference = reference_state(cfg, src)
    if kind == "cuda":
        ddp = ddp_step_time(cfg, n, rec.out / "ddp")
        rec.figure(f"step time, DDP on {n} GPUs (median)", measured=ddp, unit="ms")
        if ddp is not None:
            rec.check("DataParallel step slower than DDP's", "timing", measured=median,
                      expected=ddp, compare=">")
    else:
        rec.figure("DataParallel vs DDP on GPUs", measured="not measured (CPU)", unit="")
    steps = len(tap.records)
    for key, name in CHECKED.items():
        rec.check(f"{name} ({steps} steps)", "count", measured=sum(m[key] for m in measured),
                  expected=steps * expected[key])
    rec.check("DataParallel == one process on the batch", "parity",
              measured=max_param_diff(model.state_dict(), reference), expected=0.0,
              tolerance=PARITY_TOLERANCE[cfg.dtype])
    return rec.finish()


def main(cfg: Config) -> int:
    try:
        validate(cfg, 1)
    except ValueError as e:  # one clear line (parse_config already refused this on the CLI)
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        return 2
    return train(cfg)


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
