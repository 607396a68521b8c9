"""Profile a DDP training step and read where its time goes: compute, communication (and how
much of it is exposed, hidden by no compute), idle; and how much memory the step allocates.

torch.profiler records one rank's steps as a Chrome trace; the breakdown is computed from the
trace's own events (unions of op and collective intervals) and checked against a second,
independent computation; the communication time is compared with a separately timed run of the
same all-reduces; MFU is the FLOPs formula over the step time and the device's peak (the
datasheet's on a known GPU, a measured matmul on a CPU). `--compile` adds torch.compile of the DDP
model (inductor: tens of seconds on CPU) checked against eager.

Run:
    python chapters/ch15_profiling/train.py                                      # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch15_profiling/train.py
    torchrun --standalone --nproc_per_node=2 chapters/ch15_profiling/train.py --compile
    torchrun --standalone --nproc_per_node=8 chapters/ch15_profiling/train.py --d-hidden 4096  # GPUs
    torchrun --standalone --nproc_per_node=8 --no-python \\
        nsys profile -t cuda,nvtx,osrt --capture-range=cudaProfilerApi --capture-range-end=stop \\
        -o ch15_rank%q{RANK} --force-overwrite true \\
        python chapters/ch15_profiling/train.py --d-hidden 4096 --nsys        # Nsight Systems, one report per rank
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch15_profiling/train.py                                         # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch15_profiling/train.py   # Slurm
"""

import contextlib
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from chapters.ch01_overview.flops import count_flops, mlp_step_flops  # taught in chapter 01
from chapters.ch15_profiling import compiled
from chapters.ch15_profiling.trace_breakdown import (
    breakdown,
    load_events,
    memory_by_step,
    sweep_breakdown,
)
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import library_output, log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer, benchmark, mfu, peak_flops


@dataclass
class Config(RunConfig):
    steps: int = 10
    """Timed training steps (after two warm-up steps) for the step time behind MFU."""
    profile_steps: int = 3
    """Steps traced by torch.profiler into <out>/trace.json.gz (rank 0's view)."""
    batch_size: int = 32
    """Samples per rank per step."""
    d_in: int = 64
    """Input features of the MLP."""
    d_hidden: int = 256
    """Hidden width of the MLP."""
    n_layers: int = 3
    """Linear layers of the MLP."""
    lr: float = 0.01
    """Learning rate of plain SGD."""
    bucket_cap_mb: float = 25.0
    """DDP's bucket size in MiB (25 is DDP's default; below ~0.3 the model's gradients need several buckets)."""
    matmul_size: int = 512
    """n of the n×n fp32 matmul measured as the peak on a device without a datasheet figure (a CPU)."""
    compile: bool = False
    """Also train the DDP model through torch.compile and compare it with eager (slow on CPU)."""
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    """torch.compile backend: inductor generates code (C++ on CPU, Triton on GPU); aot_eager does not."""
    nsys: bool = False
    """Run under Nsight Systems: bracket the timed steps with cudaProfilerStart/Stop (for nsys --capture-range=cudaProfilerApi) and skip torch.profiler, which competes with nsys for CUPTI."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.profile_steps <= 20:
            raise ValueError(f"--profile-steps must be between 1 and 20, got {self.profile_steps}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
        require_at_least_one(self, "batch_size", "d_in", "d_hidden", "n_layers", "matmul_size")


def validate(cfg: Config, world_size: int) -> None:
    """Nothing here depends on the world size: the batch is per rank, DDP takes any world."""


@contextlib.contextmanager
def annotate(name: str, device: torch.device):
    """A named range: in the profiler trace always, and as an NVTX range for Nsight Systems
    on CUDA (on CPU there is no NVTX consumer, so record_function alone carries the name)."""
    with record_function(name):
        if device.type == "cuda":
            with torch.cuda.nvtx.range(name):
                yield
        else:
            yield


def recording_allreduce_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce, remembering each bucket's size (the collectives to re-time)."""
    state["numels"].append(bucket.buffer().numel())
    return default_hooks.allreduce_hook(None, bucket)


def train_step(ddp: DDP, x, y, lr: float, device: torch.device) -> torch.Tensor:
    """One SGD step, each phase a named range."""
    with annotate("train_step", device):
        with annotate("forward", device):
            loss = F.mse_loss(ddp(x), y)
        with annotate("backward", device):
            ddp.zero_grad(set_to_none=True)
            loss.backward()  # DDP's bucket all-reduces fire in here
        with annotate("optimizer", device), torch.no_grad():
            for p in ddp.parameters():
                p -= lr * p.grad
    return loss.detach()


@contextlib.contextmanager
def cuda_memory_history(device: torch.device, path):
    """On CUDA, record every allocation and free (with stacks) and dump a snapshot to `path`, to
    drop on https://pytorch.org/memory_viz (one file per rank). Nothing on a CPU (the caching
    allocator is CUDA's)."""
    if device.type != "cuda":
        yield None
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield path
    finally:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


def profile_steps(ddp: DDP, x, y, cfg: Config, info, path) -> None:
    """Trace `cfg.profile_steps` steps, memory included. A barrier before each step (outside its
    range) lines the ranks up, so less of the all-reduce time in the trace is waiting for a late
    peer (not none: a rank descheduled during its backward still arrives late)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    # the profiler's own C++ log lines (kineto) go to the library log, not the console
    with library_output(), profile(activities=activities, profile_memory=True) as prof:
        for _ in range(cfg.profile_steps):
            dist.barrier()
            train_step(ddp, x, y, cfg.lr, info.device)
    if info.is_main:
        with library_output():
            prof.export_chrome_trace(str(path))  # open in ui.perfetto.dev or chrome://tracing


def time_collectives(numels: list[int], info, repeats: int) -> float:
    """Median seconds per step of the same all-reduces DDP ran (one per bucket), timed on their
    own, each repeat after a barrier so no rank waits for a late peer inside the timed part. The
    Timer synchronises the device on both sides: NCCL's all-reduces return at launch, and are
    timed to completion, not to their launch."""
    bufs = [torch.randn(n, device=info.device) for n in numels]
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        with Timer(info.device) as t:
            for b in bufs:
                dist.all_reduce(b)
        if i:
            times.append(t.elapsed)
    return statistics.median(times)


def record_trace(rec: RunRecorder, cfg: Config, info, path, buckets_per_step: int, step_numels,
                 timed: float, n_params: int) -> None:
    """Rank 0: the breakdown read from its trace, checked against the independent sweep, the
    collective count and the step's memory."""
    events = load_events(path)
    timeline = "gpu" if info.device.type == "cuda" else "cpu"
    b = breakdown(events, timeline=timeline)
    n = max(b["steps"], 1)
    rec.check("steps in the trace", "count", b["steps"], cfg.profile_steps)
    rec.figure("trace timeline", timeline)
    for part in ("compute", "comm", "exposed_comm", "overlapped_comm", "idle"):
        rec.figure(f"{part.replace('_', ' ')} per step (trace)", b[f"{part}_us"] / n / 1e3, unit="ms")
    rec.figure("all-reduce per step (timed alone)", timed * 1e3, unit="ms")
    rec.figure("bucket sizes", step_numels, unit="elements")
    rec.check("all-reduce calls in the trace = buckets x steps", "count",
              b["collective_calls"], buckets_per_step * cfg.profile_steps)
    sweep = sweep_breakdown(events, timeline=timeline)
    worst = max(abs(b[k] - sweep[k]) / max(sweep["span_us"], 1e-9) for k in sweep)
    # Both sum the same float64 timestamps in different orders: ~1e-16 relative per addition.
    rec.check("breakdown: intervals == segment sweep", "formula",
              worst, 0.0, 1e-9)
    ratio = b["comm_us"] / n / 1e6 / max(timed, 1e-9)
    rec.check("trace comm / timed all-reduces (within 3x)", "timing", ratio, [1 / 3, 3.0],
              compare="between")

    device_type = 1 if info.device.type == "cuda" else 0
    mem = memory_by_step(events, device_type=device_type)
    grad_bytes = 4 * n_params  # float32 gradients, freed by zero_grad(set_to_none=True) each step
    steady = mem[1:] or mem  # the first step misses the frees of blocks allocated before profiling
    rec.figure("step peak above its start", max(m["peak"] - m["start"] for m in steady) / 2**10,
               unit="KiB")
    rec.figure("gradients (4 bytes x params)", grad_bytes / 2**10, unit="KiB")
    # Every step frees its gradients (set_to_none) and backward allocates them all again.
    rec.check("bytes allocated in a step >= gradient bytes", "formula",
              min(m["allocated"] for m in mem), grad_bytes, compare=">=")
    if len(mem) >= 3:
        rec.check("memory growth from one step to the next", "count", mem[-1]["end"] - mem[-2]["end"], 0)


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        model = MLP(cfg.d_in, cfg.d_hidden, 1, cfg.n_layers).to(info.device)
        X, Y = regression_data(cfg.batch_size * 2, cfg.d_in, seed=cfg.seed + info.rank)
        X, Y = X.to(info.device).chunk(2), Y.to(info.device).chunk(2)
        ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                  bucket_cap_mb=cfg.bucket_cap_mb)
        buckets = {"numels": []}
        ddp.register_comm_hook(buckets, recording_allreduce_hook)
        threads = torch.get_num_threads()  # torchrun sets OMP_NUM_THREADS=1 per rank
        n_params = sum(p.numel() for p in model.parameters())
        log.info("world %d on %s/%s, %d threads per rank", info.world_size, info.device,
                 info.backend, threads)

        # 1. The step time and the FLOPs formula (chapter 01): MFU.
        losses = []
        nsys_range = (torch.cuda.profiler.profile() if cfg.nsys and info.device.type == "cuda"
                      else contextlib.nullcontext())
        with nsys_range:  # cudaProfilerStart/Stop: what nsys --capture-range=cudaProfilerApi waits for
            stats = benchmark(lambda: losses.append(train_step(ddp, X[0], Y[0], cfg.lr, info.device)),
                              warmup=2, repeats=cfg.steps, device=info.device)
        for i, loss in enumerate(losses):
            if i % cfg.log_every == 0 or i == len(losses) - 1:
                rec.metrics(i, loss=loss, lr=cfg.lr)
        dims = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layers - 1) + [1]
        flops = mlp_step_flops(dims, cfg.batch_size)
        buckets["numels"].clear()  # one more step, counted: DDP rebuilt its buckets after step 1
        counted = count_flops(lambda: train_step(ddp, X[0], Y[0], cfg.lr, info.device))
        step_numels = list(buckets["numels"])
        buckets_per_step = len(step_numels)
        rec.check("step FLOPs counted = 6·B·Σ in·out − 2·B·in₀·out₀", "formula", counted, flops)
        peak, source = peak_flops(info.device, torch.float32, cfg.matmul_size)  # same threads as the step
        util = mfu(flops, stats.median, peak)
        log.info("step %s", stats)
        log.info("peak %.3g FLOP/s (%s); MFU %.4f", peak, source, util)
        rec.figure("model FLOPs per step per rank", flops, unit="FLOP")
        rec.figure("step time, median", stats.median * 1e3, unit="ms")
        rec.figure("step time, min-max", [round(stats.min * 1e3, 3), round(stats.max * 1e3, 3)], unit="ms")
        rec.figure("peak FLOP/s for MFU", peak, unit="FLOP/s")
        rec.figure("peak source", source)
        rec.figure("threads per rank", threads)
        rec.figure("MFU", util)
        rec.check("MFU in (0, 1]", "timing", util, [1e-12, 1.0], compare="between")

        # 2. The profiler trace, the breakdown read from it, and the step's memory.
        if cfg.nsys:
            rec.figure("trace breakdown", "n/a: --nsys (torch.profiler off)")
        else:
            path = rec.out / "trace.json.gz"
            snapshot = rec.out / f"memory_snapshot_rank{info.rank}.pickle"
            with cuda_memory_history(info.device, snapshot) as snap:
                profile_steps(ddp, X[0], Y[0], cfg, info, path)
            rec.figure("CUDA memory snapshot", str(snap) if snap else "n/a on CPU")
            rec.figure("CUDA max memory allocated",
                       torch.cuda.max_memory_allocated(info.device) / 2**20 if info.device.type == "cuda"
                       else "n/a on CPU", unit="MiB")
            timed = time_collectives(step_numels, info, repeats=cfg.steps)
            if info.is_main:
                record_trace(rec, cfg, info, path, buckets_per_step, step_numels, timed, n_params)

        if cfg.compile:
            compiled.compile_check(model, X, Y, cfg, info, rec)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
