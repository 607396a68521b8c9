"""Chapter 01's full run, after hello.py: every rank reports who it is, the ranks add up one
number together, and one timed training step of a small model is turned into a projection of how
long a real model would take to train (6·N·D FLOPs at a measured or an assumed rate).

    python chapters/ch01_overview/train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch01_overview/train.py # 2 processes, CPU
    torchrun --standalone --nproc_per_node=8 chapters/ch01_overview/train.py # 8 GPUs, one node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch01_overview/train.py                                      # on each of 2 nodes
    srun --nodes=2 --ntasks-per-node=1 bash -c 'torchrun --nnodes=$SLURM_NNODES \\
        --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 \\
        chapters/ch01_overview/train.py'                                     # Slurm, 2 nodes
    srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 python chapters/ch01_overview/train.py
                                                   # Slurm starting every rank, 8 GPUs per node

Project another run: --project-params 70e9 --project-tokens 2e12 --project-devices 1024.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch01_overview import calculators as calc
from chapters.ch01_overview.flops import count_flops, mlp_step_flops
from common.checkpoint import atomic_write
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import (  # hello.py's setup in full: torchrun, srun or one process
    DistInfo,
    DistributedSetupError,
    reduce_number,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.models import MLP, count_params
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import benchmark, peak_flops


@dataclass
class Config(RunConfig):
    batch_size: int = 128
    """Samples in each rank's training step."""
    d_in: int = 128
    """Input width of the MLP whose training step is counted and timed."""
    d_hidden: int = 256
    """Hidden width of the MLP."""
    d_out: int = 8
    """Output width of the MLP."""
    n_layers: int = 4
    """Linear layers (with bias) in the MLP."""
    lr: float = 1e-3
    """Learning rate of Adam."""
    warmup: int = 2
    """Untimed steps before the --steps timed ones."""
    matmul_size: int = 1024
    """n of the n×n fp32 matmul timed as MFU's denominator where no datasheet peak is known (a CPU)."""
    project_params: float = 7e9
    """Parameters N of the model whose training is projected."""
    project_tokens: float = 1e12
    """Training tokens D of the projected run."""
    project_devices: int = 8
    """Devices of the projected run."""
    peak_flops: float = 989e12
    """Assumed peak FLOP/s per device for the projection (H100 SXM, bf16 dense: 989e12)."""
    mfu: float = 0.4
    """Assumed model FLOPs utilisation (fraction of peak achieved) for the projection."""
    device_memory_gb: float = 80.0
    """Memory per device in decimal GB (1e9 bytes), to count devices that hold the state."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("batch_size", "d_in", "d_hidden", "d_out", "n_layers", "matmul_size",
                     "project_devices"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("lr", "project_params", "project_tokens", "peak_flops", "device_memory_gb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be at least 0, got {self.warmup}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu is a fraction of peak in (0, 1], got {self.mfu}")


def rank_view(info: DistInfo) -> dict:
    """What this process knows about its place in the job."""
    return dict(rank=info.rank, local_rank=info.local_rank, world_size=info.world_size,
                backend=info.backend, device=str(info.device), host=socket.gethostname(),
                pid=os.getpid(), threads=torch.get_num_threads())


def gather_views(view: dict) -> list[dict]:
    """Every rank's view on every rank, in rank order (one collective: all ranks call it)."""
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, view)
    return views


def views_table(views: list[dict]) -> str:
    keys = list(views[0])
    rows = [keys] + [[str(v[k]) for k in keys] for v in views]
    widths = [max(len(r[i]) for r in rows) for i in range(len(keys))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def all_reduce_sum(device: torch.device) -> tuple[float, float, float]:
    """Each rank contributes rank+1; after a SUM all-reduce every rank holds 1+2+…+n = n(n+1)/2.
    Returns (this rank's contribution, the all-reduced value, n(n+1)/2)."""
    n = dist.get_world_size()
    t = torch.tensor([dist.get_rank() + 1.0], dtype=torch.float64, device=device)
    local = t.item()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return local, t.item(), n * (n + 1) / 2


def mlp_dims(cfg: Config) -> list[int]:
    return [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layers - 1) + [cfg.d_out]


def train_step(model, opt, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def slowest(seconds: float) -> float:
    """The largest value over ranks: a synchronous job runs at its slowest rank's pace.
    (`reduce_number` puts the number on the device the backend needs: CUDA under NCCL.)"""
    return reduce_number(seconds, "max")


def record_projection(rec: RunRecorder, cfg: Config, achieved_flops: float) -> None:
    """Memory, FLOPs and days for the projected model. Formula outputs go in the `expected`
    column (nothing measured them); the days at this run's rate rest on a measurement."""
    N, D, n = cfg.project_params, cfg.project_tokens, cfg.project_devices
    state = calc.training_state_bytes(N, "mixed_adam")

    def formula(name: str, value, unit: str) -> None:
        rec.figure(name, "-", expected=value, unit=unit)

    formula("projected: bf16 weights", calc.to_gb(calc.training_state_bytes(N, "bf16_inference")), "GB")
    formula("projected: mixed-precision Adam state", calc.to_gb(state), "GB")
    formula(f"projected: devices to hold it ({cfg.device_memory_gb:g} GB each)",
            calc.devices_to_hold(N, cfg.device_memory_gb, "mixed_adam"), "devices")
    formula("projected: training FLOPs 6·N·D", calc.training_flops(N, D), "FLOP")
    measured = calc.time_to_train_s(N, D, n, achieved_flops, mfu=1.0)
    assumed = calc.time_to_train_s(N, D, n, cfg.peak_flops, cfg.mfu)
    rec.figure(f"projected: days on {n} devices at this run's rate", calc.days(measured), unit="days")
    formula(f"projected: days on {n} devices at {cfg.peak_flops:.3g} FLOP/s × MFU {cfg.mfu:g}",
            calc.days(assumed), "days")


def validate(cfg: Config, world_size: int) -> None:
    """Nothing here depends on the world size: every rank times its own --batch-size samples,
    so any world from 1 up is valid."""


def main(cfg: Config) -> int:
    try:
        info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    except DistributedSetupError as e:  # one clear line, not a traceback
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        return 2
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)

        # 1. Who am I? Every rank's view, gathered in rank order and printed once.
        views = gather_views(rank_view(info))
        log.info("%s\n", views_table(views))
        rec.check("rank views cover ranks 0..n-1", "count",
                  measured=[v["rank"] for v in views], expected=list(range(info.world_size)))
        if info.is_main:
            atomic_write(rec.out / "ranks.json", lambda f: f.write(json.dumps(views, indent=1).encode()))

        # 2. One all-reduce: the ranks add up their numbers.
        _, total, expected = all_reduce_sum(info.device)
        rec.check("all-reduce SUM of rank+1 = n(n+1)/2", "count", measured=total, expected=expected)

        # 3. One training step of a small model: count its FLOPs, then time it.
        seed_everything(cfg.seed)  # the same initial model on every rank
        model = MLP(cfg.d_in, cfg.d_hidden, cfg.d_out, cfg.n_layers).to(info.device)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        x, y = (t.to(info.device) for t in regression_data(
            cfg.batch_size, cfg.d_in, cfg.d_out, seed=cfg.seed + info.rank))  # each rank its data
        losses = []

        def step_fn():
            losses.append(train_step(model, opt, x, y))

        counted = count_flops(step_fn)
        dims, N, B = mlp_dims(cfg), count_params(model), cfg.batch_size
        rec.check("step FLOPs = 6·B·Σ in·out − 2·B·in₀·out₀", "formula",
                  measured=counted, expected=mlp_step_flops(dims, B), tolerance=0)
        rec.figure("step FLOPs counted vs plain 6·N·B", counted, expected=6 * N * B, unit="FLOP")

        stats = benchmark(step_fn, warmup=cfg.warmup, repeats=cfg.steps, device=info.device)
        for i, loss in enumerate(losses, 1):
            if i % cfg.log_every == 0 or i == len(losses):
                rec.metrics(i, loss=loss, lr=cfg.lr)
        step_s = slowest(stats.median)
        # The range of every rank's timed steps, as the spread beside the median (timings vary).
        fastest_step, slowest_step = reduce_number(stats.min, "min"), reduce_number(stats.max, "max")
        achieved = counted / step_s
        # MFU's denominator: the datasheet peak on a known GPU (as PaLM defines MFU); on a CPU a
        # measured n×n matmul at this rank's thread count, a noisy stand-in (not a peak).
        peak, source = peak_flops(info.device, torch.float32, cfg.matmul_size)
        peak = reduce_number(peak, "max")  # one denominator for every rank: the best one measured
        log.info("step: %s on rank 0; slowest rank's median %.2f ms", stats, step_s * 1e3)
        log.info("peak FLOP/s: %.3e (%s)", peak, source)
        rec.figure("step time, median (slowest rank)", step_s * 1e3, unit="ms",
                   spread=(fastest_step * 1e3, slowest_step * 1e3))
        rec.figure("achieved FLOP/s per rank", achieved, unit="FLOP/s")
        rec.figure("peak FLOP/s per rank", peak, unit="FLOP/s")
        rec.figure("peak FLOP/s is", "datasheet" if source.startswith("datasheet") else "measured matmul")
        rec.figure("MFU (achieved / peak)", achieved / peak, table=False)  # the check shows it
        rec.check("MFU <= 1", "timing", measured=achieved / peak, expected=1.0, compare="<=")

        # 4. What that means for a real model.
        record_projection(rec, cfg, achieved)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
