"""Hello, distributed: every rank reports who it is, the ranks add up one number together, and
one timed training step of a small model is turned into a projection of how long a real model
would take to train (6·N·D FLOPs at a measured or an assumed rate).

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

import datetime
import gc
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from chapters.ch01_overview import calculators as calc
from common.checkpoint import atomic_write
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import DistInfo, DistributedSetupError, first_slurm_host, reduce_number
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


def read_launch(env=None) -> dict:
    """Who started this process, read from the launcher's environment variables (`env`
    defaults to `os.environ`; a test passes its own):
    torchrun (or a Kubernetes PyTorchJob) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
    and MASTER_ADDR/PORT; Slurm's `srun` starting every rank itself sets SLURM_PROCID,
    SLURM_NTASKS, SLURM_LOCALID and the node list; neither means a world of one."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        return dict(rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", 0)),
                    world_size=world_size,
                    local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
                    launcher="torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world_size = int(env["SLURM_NTASKS"])
        # SLURM_TASKS_PER_NODE reads like "8(x2)": the first number is this node's count.
        per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE")
                            or env.get("SLURM_TASKS_PER_NODE", "") or str(world_size))
        return dict(rank=int(env["SLURM_PROCID"]), local_rank=int(env.get("SLURM_LOCALID", 0)),
                    world_size=world_size,
                    local_world_size=int(per_node.group()) if per_node else world_size,
                    launcher="slurm")
    return dict(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher="single")


def choose_device(local_rank: int, local_world_size: int, device: str = "auto",
                  backend: str = "auto", gpu_count: int | None = None, env=None):
    """CUDA + NCCL when every local rank has a GPU of its own, else CPU + gloo; overrides win.

    - as many GPUs as local ranks (or more): local rank r uses cuda:r;
    - `srun` bound one GPU to each task (`--gpus-per-task=1`): each task sees one GPU, cuda:0;
    - GPUs asked for (`--device cuda`, or Slurm allocated some) but none visible: an error, never
      a silent run on the CPU;
    - fewer GPUs than local ranks: an error, unless `--device cuda --backend gloo` shares them
      (by torch's source, gloo stages CUDA tensors through host memory for all-reduce,
      broadcast, all-gather and reduce-scatter, the last as an all-reduce of the whole input;
      send/recv have no CUDA path; NCCL refuses two ranks on one GPU).
    From chapter 03 on, `common.distributed.choose_device_and_backend` decides the same way
    (a test checks that the two agree)."""
    gpus = torch.cuda.device_count() if gpu_count is None else gpu_count
    env = os.environ if env is None else env
    if device not in ("auto", "cpu", "cuda"):
        raise DistributedSetupError(f"unknown device {device!r}: use auto, cpu or cuda")
    if backend not in ("auto", "gloo", "nccl", "mpi", "ucc", "xccl"):
        raise DistributedSetupError(f"unknown backend {backend!r}: use auto, gloo or nccl")
    slurm_gpus = any(env.get(k, "") not in ("", "0") for k in (
        "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_PER_TASK"))
    if device != "cpu" and gpus == 0 and (device == "cuda" or slurm_gpus):
        asked = "--device cuda" if device == "cuda" else "Slurm allocated GPUs to this job"
        raise DistributedSetupError(
            f"{asked}, but torch sees no CUDA GPU (a CPU-only build of torch, or "
            f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')!r}); use --device cpu to run on the CPU")
    srun_task = "SLURM_PROCID" in env and "RANK" not in env  # srun started this rank itself
    if device == "cpu" or (device == "auto" and gpus == 0):
        dev = torch.device("cpu")
    elif gpus >= local_world_size:
        dev = torch.device("cuda", local_rank)
    elif gpus == 1 and srun_task:
        dev = torch.device("cuda", 0)  # one GPU bound to each task: its cuda:0 is its own
    elif device == "cuda" and backend == "gloo":
        dev = torch.device("cuda", local_rank % gpus)  # ranks share GPUs, which gloo allows
    else:
        raise DistributedSetupError(
            f"{local_world_size} processes on this node but {gpus} GPU(s): start one process per "
            f"GPU (--nproc_per_node={gpus}), or share them with --device cuda --backend gloo "
            f"(collectives only, no send/recv), or run on the CPU with --device cpu")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise DistributedSetupError("the nccl backend needs CUDA devices: use --backend gloo on CPU")
    return dev, backend


def setup_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Join the job torchrun or srun started, or make a world of one; return this rank's view."""
    launch = read_launch()
    rank, world_size = launch["rank"], launch["world_size"]
    dev, backend = choose_device(launch["local_rank"], launch["local_world_size"], device, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # BEFORE init: barrier, object collectives use this device
    timeout = datetime.timedelta(seconds=timeout_s)  # a dead peer becomes an error, not a hang
    if not dist.is_initialized():
        if launch["launcher"] == "torchrun":  # env://: MASTER_ADDR/PORT name torchrun's store
            dist.init_process_group(backend, init_method="env://", rank=rank,
                                    world_size=world_size, timeout=timeout)
        else:
            if launch["launcher"] == "slurm":  # rank 0 hosts the key-value store on the first node
                env = os.environ
                host = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST")
                                                                or env.get("SLURM_NODELIST", "127.0.0.1"))
                port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)
                store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
            else:  # plain `python train.py`: a real group of one, so collectives still work
                store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
    return DistInfo(rank, launch["local_rank"], world_size, launch["local_world_size"], dev,
                    backend, launch["launcher"])


def teardown_distributed() -> None:
    """Destroy the default group if there is one (call it in `finally`).

    `destroy_process_group` does not always free the group: once `torch._dynamo` is imported
    (optimizers, DDP and FlopCounterMode import it) something keeps a reference, so gloo's worker
    threads live on, and one may still be releasing the last collective's tensors. A process that
    exits at that moment aborts after all its work is done ("terminate called without an active
    exception", pytorch/pytorch#190489). Collecting reference cycles and giving the workers 50 ms
    to go idle avoids it, as `common.distributed.teardown_distributed` does."""
    if dist.is_initialized():
        backend = dist.get_backend()
        dist.destroy_process_group()
        gc.collect()
        if backend == "gloo":
            time.sleep(0.05)


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


def mlp_step_flops(dims: list[int], batch: int) -> int:
    """Matmul FLOPs of one training step of a linear-layer MLP, as FlopCounterMode counts them:
    2·B·in·out per layer forward, the same again for the weight gradient and for the input
    gradient, except the first layer, whose input needs no gradient: 6·B·Σ in·out − 2·B·in₀·out₀.
    (Bias adds, ReLUs and the optimizer's element-wise updates are not counted.)"""
    pairs = list(zip(dims, dims[1:]))
    return 6 * batch * sum(a * b for a, b in pairs) - 2 * batch * pairs[0][0] * pairs[0][1]


def count_flops(fn) -> int:
    """FLOPs of the matmul-like ops `fn()` runs, as torch.utils.flop_counter counts them."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


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
