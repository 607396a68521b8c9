"""Load balancing in pipelines: cut the layers where the costs balance, then pick the schedule.

A pipeline runs at the pace of its slowest stage, so stages are cut on measured layer costs,
not layer counts; then the schedule decides how many micro-batches' activations each rank holds
(GPipe: m, 1F1B: at most p) and how large the bubble is (interleaving v chunks per rank divides
it by about v). This script measures a skewed model's per-layer costs, partitions it uniformly
and optimally, runs GPipe, 1F1B and interleaved 1F1B through `torch.distributed.pipelining`
(each checked against the unsplit model), counts live activations and bubbles, and times them.

Pipeline parallelism needs at least two ranks; without torchrun the script prints the command
to use and exits with status 1.

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch17_pipeline_balance/train.py   # 2 CPU ranks (gloo)
    torchrun --standalone --nproc_per_node=4 chapters/ch17_pipeline_balance/train.py --micro-batches 8
    torchrun --standalone --nproc_per_node=4 chapters/ch17_pipeline_balance/train.py \\
        --d-model 1024 --widths 1024 1024 1024 1024 1024 1024 8192 16384 --time-batch 512   # 4 GPUs
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch17_pipeline_balance/train.py                                          # two nodes
    srun --ntasks=4 --ntasks-per-node=2 python chapters/ch17_pipeline_balance/train.py  # Slurm
"""

import copy
import statistics
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

from chapters.ch04_model_parallel.schedule import bubble_fraction, one_f_one_b_order, simulate
from chapters.ch04_model_parallel.train import stage_diff
from chapters.ch17_pipeline_balance.partition import (
    balanced_partition,
    brute_force_partition,
    stage_costs,
    uniform_partition,
)
from chapters.ch17_pipeline_balance.schedules import (
    interleaved_bubble_formula,
    interleaved_order,
    torch_order,
)
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import benchmark

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}


@dataclass
class Config(RunConfig):
    batch_size: int = 16
    """Samples per step."""
    micro_batches: int = 4
    """Micro-batches m per step; a multiple of the number of ranks (interleaved 1F1B)."""
    d_model: int = 32
    """Width of the activations between blocks (and of the input and target)."""
    widths: tuple[int, ...] = (32, 32, 32, 32, 32, 32, 256, 512)
    """Inner width of each block d→w→d: the cost of a block grows with w, so this skews the model."""
    chunks: int = 2
    """Model chunks (virtual stages) per rank for interleaved 1F1B."""
    time_batch: int = 256
    """Batch size of the float32 wall-clock measurements."""
    time_repeats: int = 5
    """Timed steps per measurement (median reported, after one warm-up)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "batch_size", "micro_batches", "d_model", "chunks", "time_batch", "time_repeats")
        if self.batch_size % self.micro_batches or self.time_batch % self.micro_batches:
            raise ValueError(f"--micro-batches {self.micro_batches} does not divide --batch-size "
                             f"{self.batch_size} and --time-batch {self.time_batch} into equal micro-batches")


def layout_error(cfg: Config, world_size: int) -> str | None:
    """Why this world size cannot run every schedule here, in one sentence (None if it can)."""
    if world_size < 2:
        return ("pipeline parallelism needs at least 2 ranks; run: "
                "torchrun --standalone --nproc_per_node=2 chapters/ch17_pipeline_balance/train.py")
    if len(cfg.widths) < world_size * cfg.chunks:
        return f"{len(cfg.widths)} blocks cannot fill {world_size} ranks x {cfg.chunks} chunks"
    if cfg.micro_batches % world_size:
        return f"interleaved 1F1B needs --micro-batches ({cfg.micro_batches}) to be a multiple of {world_size} ranks"
    return None


def build_blocks(cfg: Config, dtype=torch.float64) -> nn.Sequential:
    """The skewed model: blocks d→w_i→d of very different costs (think: an LM head at the end)."""
    seed_everything(cfg.seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(cfg.d_model, w), nn.ReLU(), nn.Linear(w, cfg.d_model))
                           for w in cfg.widths]).to(dtype)


def block_flops(cfg: Config) -> list[float]:
    """Forward + backward FLOPs per sample of each block: 3 × 2 matmuls × 2·d·w."""
    return [3 * 2 * 2 * cfg.d_model * w for w in cfg.widths]


def measure_block_costs(blocks: nn.Sequential, batch: int, info) -> list[float]:
    """Each block's forward + backward time in ms (median), measured on rank 0, shared by all."""
    costs = torch.zeros(len(blocks), dtype=torch.float64)
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


def build_schedule(blocks: nn.Sequential, bounds: list[int], kind: str, info, n_micro: int):
    """PipelineStages for this rank's stages of `bounds`, and the schedule `kind` over them."""
    n_stages = len(bounds) - 1
    ids = local_stage_ids(info.rank, info.world_size, n_stages // info.world_size)
    mods = [nn.Sequential(*blocks[bounds[s]:bounds[s + 1]]) for s in ids]
    stages = [PipelineStage(mod, s, n_stages, info.device) for mod, s in zip(mods, ids)]
    cls = SCHEDULES[kind]
    schedule = cls(stages if kind == "Interleaved1F1B" else stages[0], n_micro, loss_fn=F.mse_loss)
    return schedule, stages, nn.ModuleList(mods)


def pipeline_step(schedule, x, y, info) -> float:
    """One step: rank 0 feeds the batch, the rank holding the last stage gets the losses."""
    losses: list[torch.Tensor] = []
    schedule.step(x if info.rank == 0 else None, target=y, losses=losses)
    value = torch.stack(losses).mean().item() if losses else 0.0
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)  # exactly one rank holds the losses
    return t.item()


def count_live_activations(stage: PipelineStage, state: dict) -> None:
    """Wrap the stage's forward and backward of one micro-batch to count, in `state`, the
    micro-batches whose forward has run and whose backward has not: the activations this rank
    holds. (Not a module hook: the stage's shape-inference forward would count too.)"""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def counted_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        state["live"] += 1
        state["peak"] = max(state["peak"], state["live"])
        return out

    def counted_backward(*args, **kwargs):
        state["live"] -= 1
        return backward(*args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = counted_forward, counted_backward


def time_schedule(cfg: Config, bounds: list[int], kind: str, info) -> float:
    """Median wall-clock ms of one float32 step of `kind` on partition `bounds`."""
    blocks = build_blocks(cfg, torch.float32).to(info.device)
    schedule, _, _ = build_schedule(blocks, bounds, kind, info, cfg.micro_batches)
    x = torch.randn(cfg.time_batch, cfg.d_model, device=info.device)
    times = []
    for _ in range(cfg.time_repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        pipeline_step(schedule, x, x, info)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        error = layout_error(cfg, info.world_size)
        if error:
            raise SystemExit(f"error: {error}")
        rec = RunRecorder(cfg, __file__, info)
        p, m, v = info.world_size, cfg.micro_batches, cfg.chunks

        # 1. Partition: uniform vs balanced on measured costs (and on counted FLOPs).
        measured = measure_block_costs(build_blocks(cfg, torch.float32).to(info.device), cfg.time_batch, info)
        flops = block_flops(cfg)
        uniform, balanced = uniform_partition(len(flops), p), balanced_partition(measured, p)
        log.info("block costs (ms): %s", " ".join(f"{c:.3f}" for c in measured))
        log.info("uniform partition %s, balanced %s", uniform, balanced)
        rec.check("balanced partition == brute-force optimum (measured costs)", "parity",
                  max(stage_costs(measured, balanced)), brute_force_partition(measured, p)[0], 1e-12)
        for name, costs in (("FLOPs", flops), ("ms", measured)):
            for label, bounds in (("uniform", uniform), ("balanced", balanced_partition(costs, p))):
                rec.figure(f"slowest stage, {label} ({name})", max(stage_costs(costs, bounds)),
                           expected=sum(costs) / p, unit=name)
        sim = {label: simulate(one_f_one_b_order(p, m), f_cost=[c for c in stage_costs(flops, b)],
                               b_cost=[2 * c for c in stage_costs(flops, b)])
               for label, b in (("uniform", uniform), ("balanced", balanced_partition(flops, p)))}
        span = {k: max(e.end for e in ev) for k, ev in sim.items()}
        rec.check("simulated 1F1B step: balanced < uniform (FLOPs)", "count",
                  span["balanced"], span["uniform"], compare="<")

        # 2. The three schedules through torch.distributed.pipelining, against the unsplit model.
        blocks = build_blocks(cfg).to(info.device)
        X, Y = regression_data(cfg.batch_size, cfg.d_model, cfg.d_model, seed=cfg.seed, dtype=torch.float64)
        X, Y = X.to(info.device), Y.to(info.device)
        reference = copy.deepcopy(blocks)
        ref_loss = F.mse_loss(reference(X), Y)
        ref_loss.backward()
        peaks, orders, grads = {}, {}, {}
        for kind in SCHEDULES:
            n_stages = p * v if kind == "Interleaved1F1B" else p
            bounds = balanced_partition(measured, n_stages)
            model = copy.deepcopy(blocks)
            schedule, stages, mods = build_schedule(model, bounds, kind, info, m)
            live = {"live": 0, "peak": 0}  # one count per rank, over all its stages (chunks)
            for stage in stages:
                count_live_activations(stage, live)
            loss = pipeline_step(schedule, X, Y, info)
            rec.check(f"{kind}: loss == unsplit", "parity", abs(loss - ref_loss.item()), 0.0, 1e-12)
            rec.check(f"{kind}: grads == unsplit (max |dgrad|)", "parity",
                      stage_diff(model, mods, reference), 0.0, 1e-12)
            peak = torch.tensor(live["peak"] / len(stages))  # a chunk holds 1/v of a rank's layers
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            peaks[kind] = peak.item()
            mine = {id(q) for q in mods.parameters()}
            grads[kind] = {n: q.grad for n, q in model.named_parameters() if id(q) in mine}
            if hasattr(schedule, "pipeline_order"):
                orders[kind] = torch_order(schedule, p)

        # 3. Counted: activations in flight (real hooks) and bubbles (simulated timelines).
        rec.check("GPipe: live activations peak at m micro-batches", "count", peaks["GPipe"], m)
        rec.check("1F1B: live activations peak at <= p micro-batches", "count", peaks["1F1B"], p,
                  compare="<=")
        rec.figure("interleaved: live chunk activations, peak", peaks["Interleaved1F1B"], unit="micro-batches")
        b1 = bubble_fraction(simulate(one_f_one_b_order(p, m)), p)
        bi = bubble_fraction(simulate(interleaved_order(p, m, v)), p)
        rec.check("1F1B bubble (counted) == (p-1)/(m+p-1)", "formula", float(b1), (p - 1) / (m + p - 1), 1e-12)
        rec.check(f"interleaved v={v} bubble (counted) == (p-1)/(vm+p-1)", "formula", float(bi),
                  float(interleaved_bubble_formula(p, m, v)), 1e-12)
        rec.check("interleaved bubble < 1F1B bubble (counted)", "count", float(bi), float(b1), compare="<")
        if "Interleaved1F1B" in orders:
            bt = bubble_fraction(simulate(orders["Interleaved1F1B"]), p)
            rec.check("torch's interleaved order: bubble (counted) < 1F1B", "count", float(bt),
                      float(b1), compare="<")

        # 4. Wall clock, reported beside the counted figures.
        for kind in SCHEDULES:
            n_stages = p * v if kind == "Interleaved1F1B" else p
            expected = bi if kind == "Interleaved1F1B" else b1
            rec.figure(f"{kind} step, balanced", time_schedule(cfg, balanced_partition(measured, n_stages), kind, info),
                       unit="ms")
            rec.figure(f"{kind} bubble (counted)", float(expected))
        t_uniform = time_schedule(cfg, uniform, "1F1B", info)
        rec.figure("1F1B step, uniform", t_uniform, unit="ms")
        t_balanced = rec.figures["1F1B step, balanced"]["measured"]
        rec.check("1F1B wall clock: balanced < uniform", "timing", t_balanced, t_uniform,
                  compare="<")
        rec.metrics(0, loss=ref_loss.item(), lr=0.0)
        gathered = [None] * p
        dist.all_gather_object(gathered, grads)
        if info.is_main:
            save_checkpoint(rec.out / "grads.pt", {k: {n: g for d in gathered for n, g in d[k].items()}
                                                   for k in SCHEDULES})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
