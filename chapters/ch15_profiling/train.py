"""Profile a DDP training step and read where its time goes: compute, communication, idle.

torch.profiler records one rank's steps as a Chrome trace; the breakdown is computed from the
trace's own events (unions of op and collective intervals), the communication time is compared
with a separately timed run of the same all-reduces, and MFU is the FLOPs formula over the step
time and the matmul peak measured with the ranks' thread count. `--compile` adds torch.compile
of the DDP model (inductor: tens of seconds on CPU) checked against eager.

Run:
    python chapters/ch15_profiling/train.py                                      # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch15_profiling/train.py
    torchrun --standalone --nproc_per_node=2 chapters/ch15_profiling/train.py --compile
    torchrun --standalone --nproc_per_node=8 chapters/ch15_profiling/train.py --d-hidden 4096  # GPUs
    nsys profile -t cuda,nvtx,osrt -o ch15 --capture-range=cudaProfilerApi \\
        torchrun --standalone --nproc_per_node=8 chapters/ch15_profiling/train.py    # Nsight Systems
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch15_profiling/train.py                                         # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch15_profiling/train.py   # Slurm
"""

import contextlib
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from chapters.ch01_overview.train import count_flops, mlp_step_flops  # taught in chapter 01
from chapters.ch15_profiling import compiled
from chapters.ch15_profiling.trace_breakdown import breakdown, load_trace
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import benchmark, matmul_peak_flops, mfu


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
    matmul_size: int = 512
    """n of the n×n fp32 matmul whose FLOP/s is the achievable peak (MFU's denominator)."""
    compile: bool = False
    """Also train the DDP model through torch.compile and compare it with eager (slow on CPU)."""
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    """torch.compile backend: inductor generates code (C++ on CPU, Triton on GPU); aot_eager does not."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.profile_steps <= 20:
            raise ValueError(f"--profile-steps must be between 1 and 20, got {self.profile_steps}")
        require_at_least_one(self, "batch_size", "d_in", "d_hidden", "n_layers", "matmul_size")


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


def profile_steps(ddp: DDP, x, y, cfg: Config, info, path) -> None:
    """Trace `cfg.profile_steps` steps. A barrier before each step (outside its range) lines the
    ranks up, so the all-reduce time in the trace is transfer, not waiting for a late peer."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(cfg.profile_steps):
            dist.barrier()
            train_step(ddp, x, y, cfg.lr, info.device)
    if info.is_main:
        prof.export_chrome_trace(str(path))  # open in ui.perfetto.dev or chrome://tracing


def time_collectives(numels: list[int], info, repeats: int) -> float:
    """Seconds per step of the same all-reduces DDP ran (one per bucket), timed on their own."""
    bufs = [torch.randn(n, device=info.device) for n in numels]

    def one_step():
        dist.barrier()
        for b in bufs:
            dist.all_reduce(b)
    barrier_only = benchmark(dist.barrier, warmup=1, repeats=repeats, device=info.device).median
    return benchmark(one_step, warmup=1, repeats=repeats, device=info.device).median - barrier_only


def compile_check(model, X, Y, cfg: Config, info, rec: RunRecorder) -> None:
    """torch.compile on the DDP model (DDPOptimizer splits the graph at bucket boundaries)
    against eager DDP from the same weights, and Dynamo's graph-break report of the model."""
    report = compiled.graph_breaks(model, X[0])
    rec.check("graph breaks in the model's forward", "count", report["breaks"], 0)
    demo = compiled.graph_breaks(compiled.item_in_forward(model), X[0])
    rec.figure("graph breaks with .item() in forward", demo["breaks"], expected=1)
    ids = [info.device.index] if info.device.type == "cuda" else None
    diff = compiled.compiled_vs_eager(model, X, Y, cfg.lr, cfg.compile_backend,
                                      wrap=lambda m: DDP(m, device_ids=ids))
    log.info("torch.compile (%s) vs eager DDP: %s", cfg.compile_backend, diff)
    # float32: kernel fusion reorders additions, a few ulps per step (see the lesson)
    rec.check("compiled DDP == eager DDP (max |dparam|)", "parity", diff["max_param_diff"], 0.0, 1e-5)


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        model = MLP(cfg.d_in, cfg.d_hidden, 1, cfg.n_layers).to(info.device)
        X, Y = regression_data(cfg.batch_size * 2, cfg.d_in, seed=cfg.seed + info.rank)
        X, Y = X.to(info.device).chunk(2), Y.to(info.device).chunk(2)
        ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
        buckets = {"numels": []}
        ddp.register_comm_hook(buckets, recording_allreduce_hook)
        threads = torch.get_num_threads()  # torchrun sets OMP_NUM_THREADS=1 per rank
        log.info("world %d on %s/%s, %d threads per rank", info.world_size, info.device,
                 info.backend, threads)

        # 1. The step time and the FLOPs formula (chapter 01): MFU.
        losses = []
        stats = benchmark(lambda: losses.append(train_step(ddp, X[0], Y[0], cfg.lr, info.device)),
                          warmup=2, repeats=cfg.steps, device=info.device)
        for i, loss in enumerate(losses):
            if i % cfg.log_every == 0 or i == len(losses) - 1:
                rec.metrics(i, loss=loss, lr=cfg.lr)
        buckets_per_step = len(buckets["numels"]) // len(losses)
        step_numels = buckets["numels"][:buckets_per_step]
        dims = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layers - 1) + [1]
        flops = mlp_step_flops(dims, cfg.batch_size)
        counted = count_flops(lambda: train_step(ddp, X[0], Y[0], cfg.lr, info.device))
        rec.check("step FLOPs counted = 6·B·Σ in·out − 2·B·in₀·out₀", "formula", counted, flops)
        peak = matmul_peak_flops(cfg.matmul_size, device=info.device)  # same thread count as the step
        util = mfu(flops, stats.median, peak)
        log.info("step %s; peak %.3g FLOP/s; MFU %.4f", stats, peak, util)
        rec.figure("model FLOPs per step per rank", flops, unit="FLOP")
        rec.figure("step time, median", stats.median * 1e3, unit="ms")
        rec.figure("matmul peak, same threads", peak, unit="FLOP/s")
        rec.figure("threads per rank", threads)
        rec.figure("MFU", util)
        rec.check("MFU in (0, 1]", "timing", util, [1e-12, 1.0], compare="between")

        # 2. The profiler trace and the breakdown read from it.
        path = rec.out / "trace.json.gz"
        profile_steps(ddp, X[0], Y[0], cfg, info, path)
        timed = time_collectives(step_numels, info, repeats=cfg.steps)
        if info.is_main:
            b = breakdown(load_trace(path))
            n = b["steps"]
            for part in ("compute", "comm", "idle"):
                rec.figure(f"{part} per step (trace)", b[f"{part}_us"] / n / 1e3, unit="ms")
            rec.figure("all-reduce per step (timed alone)", timed * 1e3, unit="ms")
            rec.figure("bucket sizes", step_numels, unit="elements")
            rec.check("steps in the trace", "count", n, cfg.profile_steps)
            rec.check("all-reduce calls in the trace = buckets x steps", "count",
                      b["collective_calls"], buckets_per_step * cfg.profile_steps)
            rec.check("compute + comm + idle = step span", "formula",
                      b["compute_us"] + b["comm_us"] + b["idle_us"], b["span_us"], 1e-9, relative=True)
            ratio = b["comm_us"] / n / 1e6 / max(timed, 1e-9)
            rec.check("trace comm / timed all-reduces (within 3x)", "timing", ratio, [1 / 3, 3.0],
                      compare="between")

        if cfg.compile:
            compile_check(model, X, Y, cfg, info, rec)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
