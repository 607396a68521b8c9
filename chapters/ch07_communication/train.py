"""Collectives by hand beside torch.distributed, and a benchmark that prints like nccl-tests.

Ring all-reduce (reduce-scatter + all-gather), tree, naive and hierarchical (two levels of
subgroups) all-reduce, ring all-gather and reduce-scatter, written with send/recv, are checked
against the library for lengths that do not divide by the world size, and the bytes each rank
sends are counted against the formulas (2(n−1)/n·S for the ring, per level for the hierarchy).
Then every collective is timed over message sizes, with algorithm and bus bandwidth per size
and an α–β model fitted to the measurements. Send/recv on GPUs need NCCL. The collectives are
in collectives.py, the parity and byte checks in checks.py, the α–β arithmetic in cost_model.py.

Run:
    python chapters/ch07_communication/train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch07_communication/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch07_communication/train.py
    torchrun --standalone --nproc_per_node=4 chapters/ch07_communication/train.py --max-bytes 2097152
    torchrun --standalone --nproc_per_node=2 chapters/ch07_communication/train.py --max-bytes 67108864
    torchrun --standalone --nproc_per_node=8 chapters/ch07_communication/train.py \\
        --max-bytes 1073741824 --factor 2 --steps 20                              # 8 GPUs, NCCL
    NCCL_DEBUG=INFO torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 chapters/ch07_communication/train.py           # two nodes
    srun --nodes=2 --ntasks-per-node=8 python chapters/ch07_communication/train.py   # Slurm
"""

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chapters.ch07_communication.checks import check_bytes, check_parity
from chapters.ch07_communication.collectives import (
    P2P,
    Levels,
    hand_all_reduces,
    library_all_gather,
    library_reduce_scatter,
    node_levels,
    ring_all_gather,
    ring_reduce_scatter,
)
from chapters.ch07_communication.cost_model import (
    alg_bandwidth,
    bus_bandwidth,
    fit_latency_bandwidth,
    predicted_time,
    ring_alpha_beta,
)
from common.config import RunConfig, parse_config
from common.distributed import (
    read_launch_env,
    reduce_number,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.results import RunRecorder
from common.timing import benchmark

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
ALGORITHMS = ("ring", "tree", "naive", "hier")  # the hand-written all-reduces


@dataclass
class Config(RunConfig):
    steps: int = 10
    """Timed repeats per message size and implementation (the slowest rank's median is reported)."""
    warmup: int = 2
    """Untimed calls before the timed repeats (connections, allocations)."""
    min_bytes: int = 8
    """Smallest message size in bytes (nccl-tests -b)."""
    max_bytes: int = 8 * 2**20
    """Largest message size in bytes (nccl-tests -e); 67108864 or more for real bandwidth."""
    factor: int = 4
    """Each message size is this many times the previous one (nccl-tests -f)."""
    dtype: str = "float32"
    """Element type of the benchmark's messages: float32, bfloat16 or float64."""
    ranks_per_node: int = 0
    """Ranks per node of the hierarchical all-reduce; 0: the launch's ranks per node when the job spans several nodes, else nodes of 2 ranks simulated on one machine (1 when the world is odd)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if not 1 <= self.min_bytes <= self.max_bytes:
            raise ValueError("--min-bytes must be at least 1 and at most --max-bytes")
        if self.factor < 2:
            raise ValueError(f"--factor must be at least 2, got {self.factor}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must not be negative, got {self.warmup}")
        if self.ranks_per_node < 0:
            raise ValueError(f"--ranks-per-node must not be negative, got {self.ranks_per_node}")


def validate(cfg: Config, world_size: int) -> None:
    """What depends on the world size: the nodes must tile it, and send/recv need NCCL on GPUs."""
    if cfg.ranks_per_node and world_size % cfg.ranks_per_node:
        raise ValueError(f"--ranks-per-node {cfg.ranks_per_node} must divide the world size "
                         f"{world_size}")
    on_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if world_size > 1 and on_gpu and cfg.backend == "gloo":
        raise ValueError("the hand-written collectives use send/recv, which gloo cannot do on "
                         "CUDA tensors: use --backend nccl on GPUs (or --device cpu)")


def ranks_per_node(cfg: Config, world_size: int, local_world_size: int) -> int:
    """The hierarchy's node size: as asked; else the real node when there are several; else
    simulated nodes of 2 ranks (so 4 CPU processes show two levels), or 1 for an odd world."""
    if cfg.ranks_per_node:
        return cfg.ranks_per_node
    if local_world_size < world_size:
        return local_world_size
    return 2 if world_size % 2 == 0 else 1


def message_sizes(cfg: Config) -> list[int]:
    sizes, s = [], cfg.min_bytes
    while s <= cfg.max_bytes:
        sizes.append(s)
        s *= cfg.factor
    return sizes


def collective_calls(op: str, size: int, dtype: torch.dtype, comm: P2P, levels: Levels,
                     device) -> tuple[int, dict]:
    """(bytes S as nccl-tests counts it, {implementation: zero-argument call}) for one op."""
    n, elem = comm.world_size, torch.finfo(dtype).bits // 8
    per_rank = max(1, size // elem // n)  # all-gather, reduce-scatter, all-to-all: n shards
    if op == "all_reduce":
        x = torch.zeros(max(1, size // elem), dtype=dtype, device=device)
        calls = {"torch": lambda: dist.all_reduce(x)}
        calls.update({name: (lambda f=f: f(x)) for name, f in hand_all_reduces(comm, levels).items()})
        return x.numel() * elem, calls
    big = torch.zeros(n * per_rank, dtype=dtype, device=device)
    small = torch.zeros(per_rank, dtype=dtype, device=device)
    if op == "all_gather":
        return big.numel() * elem, {"torch": lambda: library_all_gather(big, small),
                                    "ring": lambda: ring_all_gather(small, comm)}
    if op == "reduce_scatter":
        return big.numel() * elem, {"torch": lambda: library_reduce_scatter(small, big),
                                    "ring": lambda: ring_reduce_scatter(big, comm)}
    if op == "broadcast":
        x = torch.zeros(max(1, size // elem), dtype=dtype, device=device)
        return x.numel() * elem, {"torch": lambda: dist.broadcast(x, src=0)}
    other = torch.empty_like(big)
    return big.numel() * elem, {"torch": lambda: dist.all_to_all_single(other, big)}


def slowest_timing(fn, cfg: Config, device) -> tuple[float, float, float]:
    """(median, min, max) seconds per call, each the slowest rank's: warm-up, then repeats;
    `benchmark` synchronises the GPU after every call, so an NCCL collective is timed to its
    end, not its launch. A collective is as slow as its last rank."""
    dist.barrier()
    stats = benchmark(fn, warmup=cfg.warmup, repeats=cfg.steps, device=device)
    return tuple(reduce_number(v, "max") for v in (stats.median, stats.min, stats.max))


def run_benchmark(cfg: Config, comm: P2P, levels: Levels, device) -> list[dict]:
    n, rows = comm.world_size, []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        log.info("\n# %s   %s, %d ranks   busbw = algbw x %s", op, cfg.dtype, n,
                 {"all_reduce": "2(n-1)/n", "broadcast": "1"}.get(op, "(n-1)/n"))
        log.info("# %11s %10s %5s %10s %21s %11s %11s", "size(B)", "count", "impl", "time(us)",
                 "min-max(us)", "algbw(GB/s)", "busbw(GB/s)")
        for size in message_sizes(cfg):
            nbytes, calls = collective_calls(op, size, DTYPES[cfg.dtype], comm, levels, device)
            for impl, fn in calls.items():
                t, t_min, t_max = slowest_timing(fn, cfg, device)
                row = dict(op=op, impl=impl, size=nbytes, count=nbytes * 8 // torch.finfo(DTYPES[cfg.dtype]).bits,
                           time_us=t * 1e6, min_us=t_min * 1e6, max_us=t_max * 1e6,
                           algbw=alg_bandwidth(nbytes, t), busbw=bus_bandwidth(op, nbytes, t, n))
                rows.append(row)
                log.info("  %11d %10d %5s %10.1f %10.1f-%-10.1f %11.4f %11.4f", row["size"], row["count"],
                         impl, row["time_us"], row["min_us"], row["max_us"], row["algbw"], row["busbw"])
    return rows


def report_fits(rec: RunRecorder, rows: list[dict], n: int) -> None:
    """3. The α–β model fitted to the benchmark; the ring's time at the largest size predicted
    from a fit to the *other* sizes (a prediction, not the fit read back at its own point)."""
    log.info("\nα–β fit of t = a + b·S per all-reduce implementation:")
    fits = {}
    for impl in ("torch", *ALGORITHMS):
        pts = [(r["size"], r["time_us"] * 1e-6) for r in rows if r["op"] == "all_reduce" and r["impl"] == impl]
        a, b = fit_latency_bandwidth(*zip(*pts)) if len(pts) > 1 else (pts[0][1], 0.0)
        fits[impl] = (a, b)
        log.info("  %-6s a = %8.1f us   1/b = %7.3f GB/s", impl, a * 1e6, 1e-9 / b if b > 0 else float("inf"))
    big = max(r["size"] for r in rows if r["op"] == "all_reduce")
    largest = {r["impl"]: r for r in rows if r["op"] == "all_reduce" and r["size"] == big}
    if n > 1:
        alpha, beta = ring_alpha_beta(*fits["ring"], n)
        log.info("  hand ring read as 2(n-1)·α + 2(n-1)/n·S·β:  α = %.1f us, 1/β = %.3f GB/s",
                 alpha * 1e6, 1e-9 / beta if beta > 0 else float("inf"))
        rec.figure("ring α (fitted, all sizes)", alpha * 1e6, unit="us")
        rec.figure("ring 1/β (fitted, all sizes)", 1e-9 / beta if beta > 0 else float("inf"), unit="GB/s")
        held = [(r["size"], r["time_us"] * 1e-6) for r in rows
                if r["op"] == "all_reduce" and r["impl"] == "ring" and r["size"] < big]
        if len(held) >= 2:
            a, b = ring_alpha_beta(*fit_latency_bandwidth(*zip(*held)), n)
            predicted = predicted_time("ring", big, n, a, b) * 1e6
            rec.figure(f"ring time at {big} B (expected: fit to smaller sizes)",
                       largest["ring"]["time_us"], expected=predicted, unit="us")
            rec.check(f"ring time at {big} B / prediction from smaller sizes", "timing",
                      largest["ring"]["time_us"] / predicted, [0.5, 2.0], compare="between")
    for impl, row in largest.items():
        rec.figure(f"all-reduce busbw at {big} B, {impl}", row["busbw"], unit="GB/s")
    if n == 2:
        log.info("  n = 2: tree and naive send the same two messages (S up, S down); any gap")
        log.info("  between their times is noise. Run 4 or more ranks to see them differ.")
    if n > 1:  # timing: reported, never fatal
        rec.check("hand ring busbw / torch busbw (largest size)", "timing",
                  largest["ring"]["busbw"] / largest["torch"]["busbw"], [0.5, 1.5], compare="between")


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        n = info.world_size
        g = ranks_per_node(cfg, n, read_launch_env()["local_world_size"])
        comm, levels = P2P(), node_levels(g)
        log.info("world %d on %s/%s; hierarchy: %d node(s) of %d rank(s)%s", n, info.device,
                 info.backend, n // g, g, "" if cfg.ranks_per_node or info.local_world_size < n
                 else " (simulated on one machine)")
        check_parity(rec, comm, levels, cfg, info.device)
        check_bytes(rec, comm, levels, info.device)
        rows = run_benchmark(cfg, comm, levels, info.device)
        for i, row in enumerate(rows):
            rec.metrics(i, **row)
        report_fits(rec, rows, n)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
