"""The classic NCCL broadcast test: one large bf16 tensor broadcast many times from one rank.

The timed loop sits between a barrier (everyone starts together) and a device synchronise (the
GPU has really finished); the slowest rank's time, taken with an all-reduce MAX, is the
collective's time. Afterwards every rank checks that it holds exactly what the source sent.

Run:
    python chapters/ch07_communication/broadcast_test.py                          # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch07_communication/broadcast_test.py
    torchrun --standalone --nproc_per_node=8 chapters/ch07_communication/broadcast_test.py \\
        --size-mib 1024 --steps 100                                               # 8 GPUs, NCCL
    NCCL_DEBUG=INFO torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 chapters/ch07_communication/broadcast_test.py --size-mib 1024
    srun --nodes=2 --ntasks-per-node=8 python chapters/ch07_communication/broadcast_test.py
"""

import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chapters.ch07_communication.cost_model import alg_bandwidth, bus_bandwidth
from common.config import RunConfig, parse_config
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.timing import synchronize


@dataclass
class Config(RunConfig):
    steps: int = 10
    """Timed broadcasts (the classic test uses 100 or more on GPUs)."""
    size_mib: float = 16.0
    """Size of the bf16 tensor in MiB."""
    src: int = 0
    """Rank that broadcasts."""
    warmup: int = 2
    """Untimed broadcasts before the timed ones."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.size_mib <= 0:
            raise ValueError(f"--size-mib must be positive, got {self.size_mib}")
        if self.src < 0 or self.warmup < 0:
            raise ValueError("--src and --warmup must not be negative")


def validate(cfg: Config, world_size: int) -> None:
    """The source must be a rank of the world."""
    if cfg.src >= world_size:
        raise ValueError(f"--src {cfg.src} is not a rank of a world of {world_size}")


def pattern(numel: int, device) -> torch.Tensor:
    """What the source sends: small integers, exact in bf16 (8 bits of mantissa hold 0..255)."""
    return (torch.arange(numel, device=device) % 251).to(torch.bfloat16)


def timed_broadcasts(x: torch.Tensor, src: int, steps: int, device) -> float:
    """Seconds for `steps` broadcasts on this rank: barrier, loop, synchronise."""
    dist.barrier()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        dist.broadcast(x, src=src)
    synchronize(device)  # NCCL returns at once; the GPU may still be copying
    return time.perf_counter() - t0


def slowest(seconds: float) -> float:
    """The collective is as slow as its slowest rank: the maximum of the ranks' times."""
    return reduce_number(seconds, "max")


def count_mismatches(x: torch.Tensor, device) -> int:
    """Elements, summed over all ranks, that differ from what the source sent."""
    return reduce_number(int((x != pattern(x.numel(), device)).sum().item()), "sum")


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        numel = int(cfg.size_mib * 2**20) // 2
        x = pattern(numel, info.device) if info.rank == cfg.src else \
            torch.zeros(numel, dtype=torch.bfloat16, device=info.device)
        for _ in range(cfg.warmup):
            dist.broadcast(x, src=cfg.src)
        if info.rank != cfg.src:
            x.zero_()  # the timed broadcasts, not the warm-up, must deliver the data
        seconds = slowest(timed_broadcasts(x, cfg.src, cfg.steps, info.device))
        per_call, size = seconds / cfg.steps, numel * 2
        algbw = alg_bandwidth(size, per_call)
        busbw = bus_bandwidth("broadcast", size, per_call, info.world_size)
        log.info("broadcast of %d bf16 (%.1f MiB) from rank %d to %d ranks, %d times",
                 numel, size / 2**20, cfg.src, info.world_size, cfg.steps)
        log.info("%12s %12s %12s %12s", "size(B)", "time(us)", "algbw(GB/s)", "busbw(GB/s)")
        log.info("%12d %12.1f %12.4f %12.4f", size, per_call * 1e6, algbw, busbw)
        rec.metrics(0, size=size, time_us=per_call * 1e6, algbw=algbw, busbw=busbw)
        rec.figure("broadcast time per call (slowest rank)", per_call * 1e6, unit="us")
        rec.figure("broadcast algbw", algbw, unit="GB/s")
        rec.figure("broadcast busbw (= algbw: factor 1)", busbw, unit="GB/s")
        rec.check("elements differing from the source, all ranks", "count",
                  count_mismatches(x, info.device), 0)
        # The counter counts: a buffer that was never broadcast differs on every rank but the
        # source, in every element the pattern does not leave at zero.
        never = x.clone() if info.rank == cfg.src else torch.zeros_like(x)
        nonzero = int((pattern(numel, info.device) != 0).sum().item())
        rec.check("control: elements differing in a buffer never broadcast", "count",
                  count_mismatches(never, info.device), (info.world_size - 1) * nonzero)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
