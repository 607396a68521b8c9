"""Distributed setup and teardown: who am I, which device, which backend.

Chapters 01 and 02 write this inline, as the lesson; from chapter 03 on every chapter calls
`setup_distributed` / `teardown_distributed` here (same names, same behaviour).

Where the ranks come from, in order:
1. torchrun (or a Kubernetes PyTorchJob): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR/PORT`;
2. Slurm's `srun` starting every rank itself: `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`,
   and the first host of `SLURM_JOB_NODELIST` as the rendezvous address;
3. neither: a world of one process (a real process group of size 1, so collectives still work).

Device and backend: CUDA + NCCL when every local rank has its own GPU, else CPU + gloo;
`device`/`backend` override ("auto" keeps the choice). The device is set *before* the group is
created (NCCL binds a communicator to the current device), the group gets a finite timeout (a
dead peer becomes an error, not a 30-minute hang), and `teardown_distributed` runs in `finally`.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.14 renamed the tensor forms of all-gather and reduce-scatter (all_gather_into_tensor,
# reduce_scatter_tensor); older releases (2.11 on the lent GPU machines) have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class DistInfo:
    """One rank's view of the job. Vocabulary used in every chapter."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str  # "torchrun", "slurm" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class DistributedSetupError(RuntimeError):
    """A launch that cannot work as asked (bad override, missing variable)."""


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise DistributedSetupError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _slurm_tasks_per_node(env: dict[str, str], world_size: int) -> int:
    # SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node; SLURM_TASKS_PER_NODE always,
    # in the compressed form "4(x2),3".
    value = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    m = re.match(r"(\d+)", value)
    return int(m.group(1)) if m else world_size


def read_launch_env(env: dict[str, str] | None = None) -> dict:
    """Rank layout and rendezvous address from torchrun's or Slurm's environment variables.

    Returns a dict with rank, local_rank, world_size, local_world_size, master_addr,
    master_port and launcher. Pure function of `env` (default `os.environ`), so it is testable.
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        return dict(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world_size = int(env["SLURM_NTASKS"])
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        # One port per job, so two jobs sharing a node do not collide.
        port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)
        return dict(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=world_size,
            local_world_size=_slurm_tasks_per_node(env, world_size),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
            master_port=int(port),
            launcher="slurm",
        )
    return dict(rank=0, local_rank=0, world_size=1, local_world_size=1,
                master_addr="127.0.0.1", master_port=0, launcher="single")


def choose_device_and_backend(
    local_rank: int, local_world_size: int, device: str = "auto", backend: str = "auto"
) -> tuple[torch.device, str]:
    """CUDA + NCCL when each local rank has a GPU, else CPU + gloo; explicit choices win."""
    if device == "auto":
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
        device = "cuda" if enough_gpus else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise DistributedSetupError("--device cuda was asked for, but this machine has no CUDA GPU")
        if local_rank >= torch.cuda.device_count():
            raise DistributedSetupError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} GPUs for "
                f"{local_world_size} processes on this node (use fewer processes or --device cpu)")
        dev = torch.device("cuda", local_rank)
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise DistributedSetupError(f"unknown device {device!r}: use auto, cpu or cuda")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise DistributedSetupError("the nccl backend needs CUDA devices: use --backend gloo on CPU")
    if backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise DistributedSetupError(f"unknown backend {backend!r}: use auto, gloo or nccl")
    return dev, backend


def _make_store(launch: dict, timeout: datetime.timedelta) -> dist.Store:
    if launch["launcher"] == "single":
        return dist.HashStore()
    if launch["launcher"] == "slurm":
        # srun started every rank itself: rank 0 hosts the key-value store on the first node.
        store = dist.TCPStore(launch["master_addr"], launch["master_port"], launch["world_size"],
                              is_master=launch["rank"] == 0, timeout=timeout)
    else:
        # torchrun: the env:// rendezvous connects to the store torchrun prepared.
        store, _, _ = next(dist.rendezvous("env://", launch["rank"], launch["world_size"],
                                           timeout=timeout))
    # A torchrun restart reuses the agent's store; fresh key names per restart keep the new
    # group from reading the dead one's keys (pytorch/pytorch#135712, see chapter 13).
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"restart{restart}/", store)


def setup_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Join (or create) the default process group and return this rank's view of it."""
    launch = read_launch_env()
    dev, backend = choose_device_and_backend(
        launch["local_rank"], launch["local_world_size"], device, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before init: NCCL uses the current device
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        store = _make_store(launch, timeout)
        dist.init_process_group(backend, store=store, rank=launch["rank"],
                                world_size=launch["world_size"], timeout=timeout)
    return DistInfo(rank=launch["rank"], local_rank=launch["local_rank"],
                    world_size=launch["world_size"], local_world_size=launch["local_world_size"],
                    device=dev, backend=backend, launcher=launch["launcher"])


def teardown_distributed() -> None:
    """Destroy the default group if there is one (call it in `finally`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port the OS says is free now (for single-machine launches in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
