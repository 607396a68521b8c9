"""Load balancing in pipelines: cut the layers where the costs balance, then pick the schedule.

A pipeline runs at the pace of its slowest stage, so stages are cut on measured layer costs,
not layer counts; then the schedule decides how many micro-batches' activations each rank holds
(GPipe: m, 1F1B: at most p) and how large the bubble is (interleaving v chunks per rank divides
it by about v). This script measures a skewed model's per-block costs, partitions it uniformly
and optimally, runs GPipe, 1F1B and interleaved 1F1B through `torch.distributed.pipelining`
(each checked against the unsplit model), counts live activations and bubbles, and times them.

Pipeline parallelism needs at least two ranks: a world of one is refused in one line that gives
the torchrun command.

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch17_pipeline_balance/train.py   # 2 CPU ranks (gloo)
    torchrun --standalone --nproc_per_node=4 chapters/ch17_pipeline_balance/train.py --micro-batches 16
    torchrun --standalone --nproc_per_node=4 chapters/ch17_pipeline_balance/train.py \\
        --d-model 1024 --widths 1024 1024 1024 1024 1024 1024 8192 16384 --time-micro-batch-size 128  # 4 GPUs
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch17_pipeline_balance/train.py                                          # two nodes
    srun --ntasks=4 --ntasks-per-node=2 python chapters/ch17_pipeline_balance/train.py  # Slurm
"""

import copy
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from chapters.ch04_model_parallel.checks import stage_diff
from chapters.ch04_model_parallel.schedule import gpipe_order, one_f_one_b_order, simulate
from chapters.ch17_pipeline_balance import checks
from chapters.ch17_pipeline_balance.partition import (
    balanced_partition,
    stage_costs,
    uniform_partition,
)
from chapters.ch17_pipeline_balance.schedules import interleaved_order, torch_order
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import regression_data
from common.distributed import (
    comm_device,
    gather_numbers,
    reduce_number,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import benchmark, synchronize

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}
RUN_TWO = "torchrun --standalone --nproc_per_node=2 chapters/ch17_pipeline_balance/train.py"


@dataclass
class Config(RunConfig):
    micro_batch_size: int = 4
    """Samples per micro-batch of the float64 parity step (a step's batch is m of them)."""
    micro_batches: int = 0
    """Micro-batches m per step, a multiple of the ranks (interleaved 1F1B); 0: twice the ranks."""
    d_model: int = 32
    """Width of the activations between blocks (and of the input and target)."""
    widths: tuple[int, ...] = ()
    """Inner width w of each block d->w->d (its cost grows with w); empty: 4 blocks per rank, all 32 but the last two, 256 and 512."""
    chunks: int = 2
    """Model chunks (virtual stages) per rank for interleaved 1F1B."""
    time_micro_batch_size: int = 256
    """Samples per micro-batch of the float32 wall-clock measurements (and of the block costs)."""
    time_repeats: int = 5
    """Timed steps per measurement (median and min-max reported, after one warm-up)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "micro_batch_size", "d_model", "chunks", "time_micro_batch_size",
                             "time_repeats")
        if self.micro_batches < 0:
            raise ValueError("--micro-batches must be at least 0 (0: twice the ranks)")
        if any(w < 1 for w in self.widths):
            raise ValueError("--widths must all be at least 1")
        if self.device == "cuda" and self.backend == "gloo":
            raise ValueError("the stages send CUDA tensors point to point, which gloo cannot carry "
                             "(its send/recv have no CUDA path, unlike its collectives): use NCCL, "
                             "one GPU per rank")


def n_micro_batches(cfg: Config, world_size: int) -> int:
    """The micro-batch count m of this run: --micro-batches, or twice the ranks."""
    return cfg.micro_batches or 2 * world_size


def model_widths(cfg: Config, world_size: int) -> tuple[int, ...]:
    """The block widths: --widths, or the default skewed model, 4 blocks per rank (8 on two
    ranks: six narrow blocks, then two 8x and 16x wider ones, like an LM head at the end)."""
    return cfg.widths or (32,) * (4 * world_size - 2) + (256, 512)


def validate(cfg: Config, world_size: int) -> None:
    """Refuse, in one sentence, a world that cannot run every schedule of this script."""
    if world_size < 2:
        raise ValueError(f"pipeline parallelism needs at least 2 ranks: {RUN_TWO}")
    m, n_blocks = n_micro_batches(cfg, world_size), len(model_widths(cfg, world_size))
    if m % world_size:
        raise ValueError(f"interleaved 1F1B (Megatron's order) needs --micro-batches ({m}) to be a "
                         f"multiple of the {world_size} ranks")
    if n_blocks < world_size * cfg.chunks:
        raise ValueError(f"{n_blocks} blocks cannot fill {world_size} ranks x {cfg.chunks} chunks")


def build_blocks(widths, d_model: int, seed: int, dtype=torch.float64) -> nn.Sequential:
    """The skewed model: blocks d→w_i→d of very different costs (think: an LM head at the end)."""
    seed_everything(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d_model, w), nn.ReLU(), nn.Linear(w, d_model))
                           for w in widths]).to(dtype)


def block_flops(widths, d_model: int) -> list[float]:
    """Forward + backward FLOPs per sample of each block: 3 × 2 matmuls × 2·d·w."""
    return [3 * 2 * 2 * d_model * w for w in widths]


def measure_block_costs(blocks: nn.Sequential, batch: int, info) -> list[float]:
    """Each block's forward + backward time in ms (median), measured on rank 0, shared by all
    (ranks that cut the model differently would deadlock)."""
    costs = torch.zeros(len(blocks), dtype=torch.float64, device=comm_device())  # NCCL: CUDA only
    if info.is_main:
        for i, block in enumerate(blocks):
            x = torch.randn(batch, block[0].in_features, device=info.device, requires_grad=True)
            costs[i] = benchmark(lambda b=block, x=x: b(x).sum().backward(), warmup=1, repeats=5,
                                 device=info.device).median * 1e3
    dist.broadcast(costs, src=0)
    return costs.tolist()


def local_stage_ids(rank: int, world: int, chunks: int) -> list[int]:
    """Rank r holds stages r, r+p, r+2p, ...: the interleaved (looped) placement."""
    return [rank + c * world for c in range(chunks)]


def build_schedule(blocks: nn.Sequential, bounds: list[int], kind: str, info, n_micro: int,
                   scale_grads: bool = True):
    """PipelineStages for this rank's stages of `bounds`, and the schedule `kind` over them
    (`scale_grads=False` drops the schedule's 1/m: the negative control)."""
    n_stages = len(bounds) - 1
    ids = local_stage_ids(info.rank, info.world_size, n_stages // info.world_size)
    mods = [nn.Sequential(*blocks[bounds[s]:bounds[s + 1]]) for s in ids]
    stages = [PipelineStage(mod, s, n_stages, info.device) for mod, s in zip(mods, ids)]
    cls = SCHEDULES[kind]
    schedule = cls(stages if kind == "Interleaved1F1B" else stages[0], n_micro, loss_fn=F.mse_loss,
                   scale_grads=scale_grads)
    return schedule, stages, nn.ModuleList(mods)


def pipeline_step(schedule, x, y, info) -> float:
    """One step: rank 0 feeds the batch, the rank holding the last stage gets the losses; every
    rank returns the step's mean loss."""
    losses: list[torch.Tensor] = []
    schedule.step(x if info.rank == 0 else None, target=y, losses=losses)
    value = torch.stack(losses).mean().item() if losses else 0.0
    return reduce_number(value, "sum")  # exactly one rank holds the losses


def simulated_step(kind: str, costs: list[float], bounds: list[int], n_ranks: int, n_micro: int) -> float:
    """The step time the simulator predicts from per-block costs (forward + backward, split 1:2)
    with free communication: a lower bound for the wall clock."""
    per_stage = stage_costs(costs, bounds)
    n_chunks = (len(bounds) - 1) // n_ranks
    order = {"GPipe": lambda: gpipe_order(n_ranks, n_micro),
             "1F1B": lambda: one_f_one_b_order(n_ranks, n_micro),
             "Interleaved1F1B": lambda: interleaved_order(n_ranks, n_micro, n_chunks)}[kind]()
    events = simulate(order, [c / 3 for c in per_stage], [2 * c / 3 for c in per_stage])
    return max(e.end for e in events)


def time_schedule(cfg: Config, widths, bounds: list[int], kind: str, info) -> tuple[float, float, float]:
    """Wall-clock ms of one float32 step of `kind` on partition `bounds`: (median, min, max)."""
    blocks = build_blocks(widths, cfg.d_model, cfg.seed, torch.float32).to(info.device)
    m = n_micro_batches(cfg, info.world_size)
    schedule, _, _ = build_schedule(blocks, bounds, kind, info, m)
    x = torch.randn(m * cfg.time_micro_batch_size, cfg.d_model, device=info.device)
    times = []
    for _ in range(cfg.time_repeats + 1):
        dist.barrier()
        synchronize(info.device)
        t0 = time.perf_counter()
        pipeline_step(schedule, x, x, info)
        synchronize(info.device)
        times.append((time.perf_counter() - t0) * 1e3)
    timed = sorted(times[1:])
    return timed[len(timed) // 2], timed[0], timed[-1]


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        p, v = info.world_size, cfg.chunks
        m, widths = n_micro_batches(cfg, p), model_widths(cfg, p)

        # 1. Partition: uniform vs balanced on measured costs (and on counted FLOPs).
        measured = measure_block_costs(build_blocks(widths, cfg.d_model, cfg.seed, torch.float32).to(info.device),
                                       cfg.time_micro_batch_size, info)
        flops = block_flops(widths, cfg.d_model)
        uniform, balanced = uniform_partition(len(flops), p), balanced_partition(measured, p)
        log.info("%d blocks, %d ranks, m = %d micro-batches, v = %d chunks per rank", len(widths), p, m, v)
        log.info("block costs (ms): %s", " ".join(f"{c:.3f}" for c in measured))
        log.info("uniform partition %s, balanced %s", uniform, balanced)
        checks.record_partition(rec, measured, flops, uniform, balanced, p, m)

        # 2. The three schedules through torch.distributed.pipelining, against the unsplit model.
        blocks = build_blocks(widths, cfg.d_model, cfg.seed).to(info.device)
        X, Y = regression_data(m * cfg.micro_batch_size, cfg.d_model, cfg.d_model, seed=cfg.seed,
                               dtype=torch.float64)
        X, Y = X.to(info.device), Y.to(info.device)
        reference = copy.deepcopy(blocks)
        ref_loss = F.mse_loss(reference(X), Y)
        ref_loss.backward()
        peaks, orders, grads = {}, {}, {}
        runs = [(kind, kind, True) for kind in SCHEDULES] + [("control: 1F1B without 1/m", "1F1B", False)]
        for name, kind, scale_grads in runs:
            n_stages = p * v if kind == "Interleaved1F1B" else p
            bounds = balanced_partition(measured, n_stages)
            model = copy.deepcopy(blocks)
            schedule, stages, mods = build_schedule(model, bounds, kind, info, m, scale_grads)
            live = {"live": 0, "peak": 0}  # one count per rank, over all its stages (chunks)
            for stage in stages:
                checks.count_live_activations(stage, live)
            loss = pipeline_step(schedule, X, Y, info)
            diff = stage_diff(model, mods, reference)
            if scale_grads:
                rec.check(f"{kind}: loss == unsplit", "parity", abs(loss - ref_loss.item()), 0.0, 1e-12)
                rec.check(f"{kind}: grads == unsplit (max |dgrad|)", "parity", diff, 0.0, 1e-12)
                # a chunk holds 1/v of a rank's layers: count live activations in whole stages
                peaks[kind] = gather_numbers(live["peak"] / len(stages))
            else:  # the negative control: the same check must see gradients m times too large
                rec.check(f"{name}: grads != unsplit (max |dgrad|)", "parity", diff, 1e-12, compare=">")
            mine = {id(q) for q in mods.parameters()}
            grads[name] = {n: q.grad.detach().cpu() for n, q in model.named_parameters() if id(q) in mine}
            if hasattr(schedule, "pipeline_order"):
                orders[kind] = torch_order(schedule, p)

        # 3. Counted: activations in flight (the stages' real calls) and bubbles (simulated timelines).
        bubbles = checks.record_counted(rec, peaks, orders, p, m, v)

        # 4. Wall clock, reported beside the step the simulator predicts from the measured block
        #    costs with free communication (the gap is messages and the schedule's own work).
        for kind in SCHEDULES:
            n_stages = p * v if kind == "Interleaved1F1B" else p
            bounds = balanced_partition(measured, n_stages)
            median, low, high = time_schedule(cfg, widths, bounds, kind, info)
            rec.figure(f"{kind} step, balanced", median, simulated_step(kind, measured, bounds, p, m), unit="ms",
                       spread=(low, high))
            rec.figure(f"{kind} bubble (counted)", float(bubbles[kind]))
        median, low, high = time_schedule(cfg, widths, uniform, "1F1B", info)
        rec.figure("1F1B step, uniform", median, simulated_step("1F1B", measured, uniform, p, m), unit="ms",
                   spread=(low, high))
        rec.check("1F1B wall clock: balanced < uniform", "timing",
                  rec.figures["1F1B step, balanced"]["measured"], median, compare="<")
        rec.metrics(0, loss=ref_loss.item(), lr=0.0)
        checks.save_grads(rec, grads, info)  # for the tests
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
