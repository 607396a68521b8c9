"""Collectives by hand beside torch.distributed, and a benchmark that prints like nccl-tests.

Ring all-reduce (reduce-scatter + all-gather), tree all-reduce, ring all-gather and
reduce-scatter, written with send/recv, are checked against the library for lengths that do
not divide by the world size, and the bytes each rank sends are counted against 2(n−1)/n·S.
Then every collective is timed over message sizes, with algorithm and bus bandwidth per size
and an α–β model fitted to the measurements.

Run:
    python chapters/ch07_communication/train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch07_communication/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch07_communication/train.py
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

from chapters.ch07_communication.collectives import (
    P2P,
    expected_bytes_sent,
    library_all_gather,
    library_reduce_scatter,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_all_reduce,
)
from chapters.ch07_communication.cost_model import (
    alg_bandwidth,
    bus_bandwidth,
    fit_latency_bandwidth,
    predicted_time,
    ring_alpha_beta,
)
from common.config import RunConfig, parse_config
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.timing import benchmark

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
CHECK_LENGTHS = (1, 5, 12, 1001)  # 1 and 5 leave empty / uneven chunks on 2–4 ranks
HAND_ALL_REDUCE = {"ring": ring_all_reduce, "tree": tree_all_reduce, "naive": naive_all_reduce}


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


def rank_data(numel: int, dtype: torch.dtype, rank: int, seed: int, device) -> torch.Tensor:
    """Each rank's own deterministic input: integers (exact sums) or float64 normals."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=dtype).to(device)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype).to(device)


def global_max(value: float, device) -> float:
    """The largest value over all ranks (a check passes only if it passes everywhere)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a − b| (0 for empty tensors; inf if the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    return (a - b).abs().max().item() if a.numel() else 0.0


def hand_vs_library(comm: P2P, numel: int, dtype: torch.dtype, seed: int, device) -> dict:
    """|hand − library| for every hand collective on one length, max over elements."""
    n, r = comm.world_size, comm.rank
    x = rank_data(numel, dtype, r, seed, device)
    lib = x.clone()
    dist.all_reduce(lib)
    diffs = {f"{name} all-reduce": max_abs_diff(fn(x, comm), lib) for name, fn in HAND_ALL_REDUCE.items()}
    # every rank calls every collective, even one whose chunk is empty: skipping it hangs the ring
    diffs["ring reduce-scatter"] = max_abs_diff(ring_reduce_scatter(x, comm), lib.tensor_split(n)[r])
    # all-gather of uneven shards: the library needs equal ones, so pad to the longest and cut
    sizes = [len(c) for c in x.tensor_split(n)]
    shard = x.tensor_split(n)[r]
    padded = torch.zeros(max(sizes), dtype=dtype, device=device)
    padded[: len(shard)] = shard
    gathered = torch.empty(n * max(sizes), dtype=dtype, device=device)
    library_all_gather(gathered, padded)
    lib_ag = torch.cat([g[:s] for g, s in zip(gathered.view(n, -1), sizes)])
    diffs["ring all-gather"] = max_abs_diff(ring_all_gather(shard, comm, sizes), lib_ag)
    if numel % n == 0:  # the library's own reduce-scatter needs equal chunks
        out = torch.empty(numel // n, dtype=dtype, device=device)
        library_reduce_scatter(out, x.clone())
        diffs["ring reduce-scatter"] = max(diffs["ring reduce-scatter"],
                                           max_abs_diff(ring_reduce_scatter(x, comm), out))
    return diffs


def counted_bytes(algorithm: str, numel: int, device) -> list[int]:
    """Bytes each rank's P2P counter saw during one hand all-reduce of `numel` float32s."""
    comm = P2P()
    HAND_ALL_REDUCE[algorithm](torch.ones(numel, device=device), comm)
    per_rank = torch.zeros(comm.world_size, dtype=torch.int64, device=device)
    per_rank[comm.rank] = comm.bytes_sent
    dist.all_reduce(per_rank)
    return per_rank.tolist()


def message_sizes(cfg: Config) -> list[int]:
    sizes, s = [], cfg.min_bytes
    while s <= cfg.max_bytes:
        sizes.append(s)
        s *= cfg.factor
    return sizes


def collective_calls(op: str, size: int, dtype: torch.dtype, comm: P2P, device) -> tuple[int, dict]:
    """(bytes S as nccl-tests counts it, {implementation: zero-argument call}) for one op."""
    n, elem = comm.world_size, torch.finfo(dtype).bits // 8
    per_rank = max(1, size // elem // n)  # all-gather, reduce-scatter, all-to-all: n shards
    if op == "all_reduce":
        x = torch.zeros(max(1, size // elem), dtype=dtype, device=device)
        calls = {"torch": lambda: dist.all_reduce(x)}
        calls.update({name: (lambda f=f: f(x, comm)) for name, f in HAND_ALL_REDUCE.items()})
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


def slowest_median(fn, cfg: Config, device) -> float:
    """Median seconds per call on this rank (warm-up, repeats), then the slowest rank's."""
    dist.barrier()
    stats = benchmark(fn, warmup=cfg.warmup, repeats=cfg.steps, device=device)
    return global_max(stats.median, device)


def run_benchmark(cfg: Config, comm: P2P, device) -> list[dict]:
    n, rows = comm.world_size, []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        log.info("\n# %s   %s, %d ranks   busbw = algbw x %s", op, cfg.dtype, n,
                 {"all_reduce": "2(n-1)/n", "broadcast": "1"}.get(op, "(n-1)/n"))
        log.info("# %12s %12s %7s %12s %12s %12s", "size(B)", "count", "impl", "time(us)",
                 "algbw(GB/s)", "busbw(GB/s)")
        for size in message_sizes(cfg):
            nbytes, calls = collective_calls(op, size, DTYPES[cfg.dtype], comm, device)
            for impl, fn in calls.items():
                t = slowest_median(fn, cfg, device)
                row = dict(op=op, impl=impl, size=nbytes, count=nbytes * 8 // torch.finfo(DTYPES[cfg.dtype]).bits,
                           time_us=t * 1e6, algbw=alg_bandwidth(nbytes, t), busbw=bus_bandwidth(op, nbytes, t, n))
                rows.append(row)
                log.info("  %12d %12d %7s %12.1f %12.4f %12.4f", row["size"], row["count"], impl,
                         row["time_us"], row["algbw"], row["busbw"])
    return rows


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        comm, n = P2P(), info.world_size
        log.info("world %d on %s/%s", n, info.device, info.backend)

        # 1. The hand collectives equal the library's: integers exactly, float64 to 1e-12.
        for dtype, tol in ((torch.int64, 0.0), (torch.float64, 1e-12)):
            worst: dict[str, float] = {}
            for numel in CHECK_LENGTHS:
                for name, d in hand_vs_library(comm, numel, dtype, cfg.seed, info.device).items():
                    worst[name] = max(worst.get(name, 0.0), d)
            for name, d in worst.items():
                rec.check(f"{name} == torch ({str(dtype)[6:]})", "parity",
                          global_max(d, info.device), 0.0, tol)

        # 2. Bytes on the wire, counted on every rank, against the formulas.
        for numel in (12 * 1024, 12 * 1024 + 1):  # divides by 2, 3, 4; then does not
            sent = counted_bytes("ring", numel, info.device)
            rec.check(f"ring all-reduce bytes sent per rank, {numel} float32", "count", sent,
                      [expected_bytes_sent("ring", numel, n, r, 4) for r in range(n)])
        rec.figure("ring bytes per rank / S (12288 float32)", sent[0] / (4 * numel),
                   expected=2 * (n - 1) / n)
        naive = counted_bytes("naive", 12 * 1024, info.device)
        rec.figure("naive bytes sent by rank 0 / S", naive[0] / (4 * 12 * 1024), expected=n - 1)

        # 3. The benchmark, nccl-tests style, and the α–β model fitted to it.
        rows = run_benchmark(cfg, comm, info.device)
        for i, row in enumerate(rows):
            rec.metrics(i, **row)
        fits = {}
        log.info("\nα–β fit of t = a + b·S per all-reduce implementation:")
        for impl in ("torch", "ring", "tree", "naive"):
            pts = [(r["size"], r["time_us"] * 1e-6) for r in rows if r["op"] == "all_reduce" and r["impl"] == impl]
            a, b = fit_latency_bandwidth(*zip(*pts))
            fits[impl] = (a, b)
            log.info("  %-6s a = %8.1f us   1/b = %7.3f GB/s", impl, a * 1e6, 1e-9 / b if b > 0 else float("inf"))
        big = max(r["size"] for r in rows if r["op"] == "all_reduce")
        largest = {r["impl"]: r for r in rows if r["op"] == "all_reduce" and r["size"] == big}
        if n > 1:
            alpha, beta = ring_alpha_beta(*fits["ring"], n)
            log.info("  hand ring read as 2(n-1)·α + 2(n-1)/n·S·β:  α = %.1f us, 1/β = %.3f GB/s",
                     alpha * 1e6, 1e-9 / beta if beta > 0 else float("inf"))
            rec.figure("ring α (fitted)", alpha * 1e6, unit="us")
            rec.figure("ring 1/β (fitted)", 1e-9 / beta if beta > 0 else float("inf"), unit="GB/s")
            rec.figure(f"ring all-reduce time at {big} B", largest["ring"]["time_us"],
                       expected=predicted_time("ring", big, n, alpha, beta) * 1e6, unit="us")
        for impl, row in largest.items():
            rec.figure(f"all-reduce busbw at {big} B, {impl}", row["busbw"], unit="GB/s")
        if n > 1:  # timing: reported, never fatal
            rec.check("hand ring busbw / torch busbw (largest size)", "timing",
                      largest["ring"]["busbw"] / largest["torch"]["busbw"], 1.0, 0.5, relative=True)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
