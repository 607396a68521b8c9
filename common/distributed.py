"""Distributed setup and teardown: who am I, which device, which backend.

Taught in chapter 01: its `hello.py` writes the core inline (read `RANK`/`WORLD_SIZE`/`LOCAL_RANK`,
set the device, create the group, destroy it in `finally`), and its `train.py` calls the full
version here, which the lesson walks through. Chapter 02 writes torchrun's and mp.spawn's setup
inline with `choose_device_and_backend` and `teardown_distributed` from here; from chapter 03 on
every chapter calls `setup_distributed` / `teardown_distributed`.

Where the ranks come from, in order:
1. torchrun (or a Kubernetes PyTorchJob or Volcano Job, or srun with enroot's pyxis hook):
   `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR/PORT` (an indexed Job's `JOB_COMPLETION_INDEX`
   stands for `RANK`). The local world is `LOCAL_WORLD_SIZE` (torchrun sets it); without it,
   srun's tasks per node when `SLURM_PROCID` is set, one process (the pod's) when `LOCAL_RANK` is
   missing too, else every rank on this node;
2. Slurm's `srun` starting every rank itself: `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`,
   and the first host of `SLURM_JOB_NODELIST` as the rendezvous address;
3. neither: a world of one process (a real process group of size 1, so collectives still work).

Device and backend: CUDA + NCCL when every local rank has its own GPU, else CPU + gloo;
`device`/`backend` override ("auto" keeps the choice). The device is set *before* the group is
created (NCCL binds a communicator to the current device), the group gets a finite timeout (a
dead peer becomes an error, not a 30-minute hang), and `teardown_distributed` runs in `finally`.

The small collectives the checks use (`reduce_number`, `gather_numbers`, `broadcast_from_rank0`,
...) live in `common.collectives` and are importable from here too.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import re
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Re-exported: chapters and tests import these number and parameter collectives from here.
from common.collectives import (  # noqa: F401
    all_gather_single,
    broadcast_from_rank0,
    broadcast_number,
    comm_device,
    gather_numbers,
    reduce_number,
    reduce_scatter_single,
    trainable_params,
)


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
    # A Kubernetes indexed Job gives each pod only its index (chapter 23): with WORLD_SIZE and
    # MASTER_ADDR set in the manifest, the index is the rank.
    rank = env.get("RANK", env.get("JOB_COMPLETION_INDEX"))
    if rank is not None and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        # torchrun sets LOCAL_RANK and LOCAL_WORLD_SIZE. Under srun, enroot's pytorch hook (pyxis
        # containers) sets RANK and LOCAL_RANK from SLURM_* but no LOCAL_WORLD_SIZE: srun's tasks
        # per node. A launcher that sets neither (a PyTorchJob or Volcano pod running `python
        # script.py`, an indexed Job) starts one process per pod: local rank 0 of 1.
        if "LOCAL_WORLD_SIZE" in env:
            local_world_size = int(env["LOCAL_WORLD_SIZE"])
        elif "SLURM_PROCID" in env:
            local_world_size = _slurm_tasks_per_node(env, world_size)
        else:
            local_world_size = world_size if "LOCAL_RANK" in env else 1
        return dict(
            rank=int(rank),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=world_size,
            local_world_size=local_world_size,
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


def _slurm_gpus_allocated(env) -> bool:
    """Did Slurm give this job GPUs (--gpus, --gpus-per-node, --gpus-per-task, --gres=gpu)?"""
    return any(env.get(k, "") not in ("", "0") for k in
               ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_PER_TASK"))


def choose_device_and_backend(
    local_rank: int, local_world_size: int, device: str = "auto", backend: str = "auto",
    gpu_count: int | None = None, env: dict[str, str] | None = None,
) -> tuple[torch.device, str]:
    """CUDA + NCCL when each local rank has a GPU, else CPU + gloo; explicit choices win
    (taught in chapter 01).

    - One GPU per local rank: rank r uses `cuda:r`.
    - `srun` with one GPU bound to each task (`--gpus-per-task=1`): every task sees one GPU,
      `cuda:0`, its own (and, where Slurm confines devices, not its neighbours': NCCL then has no
      NVLink between tasks, so the course's commands ask for `--gpus-per-node`; chapter 22).
    - GPUs asked for (`--device cuda`, or Slurm allocated them) but none visible: an error, not a
      silent run on the CPU.
    - Fewer GPUs than local ranks: an error under `auto`; with `--device cuda --backend gloo` the
      ranks share the GPUs (by torch's source, gloo stages CUDA tensors through host memory for
      all-reduce, broadcast, all-gather and reduce-scatter, the last as an all-reduce of the whole
      input; send/recv have no CUDA path; NCCL refuses two ranks on one GPU).
    `gpu_count` and `env` default to this machine's; tests pass their own.
    """
    gpus = torch.cuda.device_count() if gpu_count is None else gpu_count
    env = os.environ if env is None else env
    # srun started this rank itself (perhaps in a pyxis container whose enroot hook set RANK):
    # no torchrun, which would have set LOCAL_WORLD_SIZE
    slurm_task = "SLURM_PROCID" in env and "LOCAL_WORLD_SIZE" not in env
    if device not in ("auto", "cpu", "cuda"):
        raise DistributedSetupError(f"unknown device {device!r}: use auto, cpu or cuda")
    if backend not in ("auto", "gloo", "nccl", "mpi", "ucc", "xccl"):
        raise DistributedSetupError(f"unknown backend {backend!r}: use auto, gloo or nccl")
    if device != "cpu" and gpus == 0 and (device == "cuda" or _slurm_gpus_allocated(env)):
        asked = "--device cuda" if device == "cuda" else "Slurm allocated GPUs to this job"
        raise DistributedSetupError(
            f"{asked}, but torch sees no CUDA GPU (a CPU-only build of torch, or "
            f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')!r}); use --device cpu to run on the CPU")
    if device == "cpu" or (device == "auto" and gpus == 0):
        dev = torch.device("cpu")
    elif gpus >= local_world_size:
        dev = torch.device("cuda", local_rank)
    elif gpus == 1 and slurm_task:
        dev = torch.device("cuda", 0)  # Slurm bound one GPU to each task: each sees its own cuda:0
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
    # With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every rendezvous round gets a fresh store
    # (torchrun then tells the workers TORCHELASTIC_USE_AGENT_STORE=False): nothing stale to avoid.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        return store
    # Otherwise a torchrun restart reuses the agent's store; fresh key names per restart keep the
    # new group from reading the dead one's keys (pytorch/pytorch#135712, see chapter 13). A node
    # joining re-forms the group without counting a restart, so the world size is in the name too.
    # The restart count is each agent's own, so a node that joins after a failure disagrees with
    # the survivors: elastic jobs that change membership need the variable above (chapter 13).
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"restart{restart}/world{launch['world_size']}/", store)


def _collect_before_exit() -> None:
    # A DDP module sits in a reference cycle that holds its reducer, and the reducer holds the
    # gloo process group. Left to interpreter shutdown, that group is destroyed after its C++
    # threads' owners are gone and the rank dies with "terminate called without an active
    # exception" (SIGABRT) although every check passed: seen in 2 of 14 two-rank runs here.
    # Collecting the cycles at exit, while the interpreter is intact, frees it in order: 0 of 14.
    gc.collect()


_exit_hook_registered = False


def setup_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Join (or create) the default process group and return this rank's view of it."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_collect_before_exit)
        _exit_hook_registered = True
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
    """Destroy the default group if there is one (call it in `finally`).

    `destroy_process_group` does not always free the group: while DDP or FSDP2 still reference it,
    or once `torch._dynamo` is imported (optimizers, DDP and FlopCounterMode import it), gloo's
    worker threads live on, and one may still be releasing the last collective's tensors. A
    process that exits at that moment aborts after all its work is done ("terminate called
    without an active exception", pytorch/pytorch#190489; chapter 01's pitfalls). Collecting
    reference cycles and giving the workers 50 ms to go idle avoids it."""
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        dist.destroy_process_group()
        gc.collect()
        if backend == "gloo":
            time.sleep(0.05)


def free_port() -> int:
    """A TCP port the OS says is free now (for single-machine launches in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
