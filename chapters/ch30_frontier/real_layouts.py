"""Three layouts of one tiny MLP, run for real on the world's ranks with the course's own
implementations, so the planner's predicted order can be held against measured step times:

- dp: chapter 03's data parallelism by hand (each rank a 1/W slice of the batch, one all-reduce
  of the flattened gradients);
- tp: chapter 05's Megatron pairs (`copy_to_tp` / `reduce_from_tp`): the first linear of each
  pair split by output features, the second by input features, one all-reduce forward and one
  backward per pair;
- pp: chapter 04's GPipe (`build_stage`, `gpipe_step`) with m micro-batches.

The MLP is `common.models.MLP` with 2·pairs linears of width h; the planner sees it as
`pairs` MLP-only layers with d_ff = h (`tiny_spec`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from chapters.ch04_model_parallel.gpipe import build_stage, gpipe_step
from chapters.ch05_tensor_parallel.tp_layers import copy_to_tp, reduce_from_tp
from chapters.ch07_communication.cost_model import fit_latency_bandwidth, ring_alpha_beta
from chapters.ch30_frontier.planner import Cluster, Layout, ModelSpec
from common.distributed import gather_numbers
from common.models import MLP
from common.timing import benchmark


def tiny_spec(width: int, pairs: int, batch: int) -> ModelSpec:
    """The MLP as the planner sees it: float32 SGD (no optimizer state), one 'token' per row."""
    return ModelSpec(n_layers=pairs, d_model=width, n_heads=1, d_ff=width, seq_len=1,
                     global_batch=batch, attention=False, param_bytes=4, grad_bytes=4,
                     state_bytes=0, act_bytes=4)


def layout_for(kind: str, world: int, batch: int, micro_batches: int) -> Layout:
    return {"dp": Layout(world, 1, 1, batch // world, 0, 0),
            "tp": Layout(1, world, 1, batch, 0, 0),
            "pp": Layout(1, 1, world, batch // micro_batches, 0, 0)}[kind]


def possible(kind: str, world: int, width: int, pairs: int, batch: int, micro_batches: int) -> bool:
    """Whether this world can run the layout (dp splits the batch, tp the width, pp the linears)."""
    return {"dp": batch % world == 0, "tp": width % world == 0,
            "pp": (2 * pairs) % world == 0 and batch % micro_batches == 0}[kind]


class TPPairs(nn.Module):
    """This rank's shards of the MLP's Megatron pairs; ReLU between linears as in the MLP."""

    def __init__(self, model: MLP, rank: int, tp: int):
        super().__init__()
        linears = [m for m in model if isinstance(m, nn.Linear)]
        self.cols, self.rows, self.row_bias = nn.ModuleList(), nn.ModuleList(), nn.ParameterList()
        for a, b in zip(linears[0::2], linears[1::2]):
            col = nn.Linear(a.in_features, a.out_features // tp)
            col.weight.data.copy_(a.weight.data.chunk(tp, 0)[rank])
            col.bias.data.copy_(a.bias.data.chunk(tp, 0)[rank])
            row = nn.Linear(b.in_features // tp, b.out_features, bias=False)
            row.weight.data.copy_(b.weight.data.chunk(tp, 1)[rank])
            self.cols.append(col)
            self.rows.append(row)
            self.row_bias.append(nn.Parameter(b.bias.data.clone()))  # added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (col, row, bias) in enumerate(zip(self.cols, self.rows, self.row_bias)):
            x = reduce_from_tp(row(F.relu(col(copy_to_tp(x))))) + bias
            if i < len(self.cols) - 1:
                x = F.relu(x)
        return x


def dp_step(model: MLP, x, y, rank: int, world: int) -> None:
    """Chapter 03 by hand: this rank's rows, then one all-reduce of every gradient, flattened."""
    rows = x.shape[0] // world
    model.zero_grad(set_to_none=False)
    F.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= world
    torch.nn.utils.vector_to_parameters(flat, [p.grad for p in model.parameters()])


def tp_step(model: TPPairs, x, y) -> None:
    model.zero_grad(set_to_none=False)
    F.mse_loss(model(x), y).backward()


def pp_step(stage: nn.Sequential, x, y, rank: int, world: int, width: int, micro_batches: int) -> None:
    stage.zero_grad(set_to_none=False)
    act_like = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    gpipe_step(stage, x, y, rank, world, act_like, micro_batches)


def time_layouts(kinds: list[str], width: int, pairs: int, batch: int, micro_batches: int,
                 warmup: int, repeats: int, seed: int, device: torch.device) -> dict[str, dict]:
    """Median step time of each layout on this world (the slowest rank's median), in seconds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = MLP(width, width, width, n_layers=2 * pairs).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = (torch.randn(batch, width, generator=g).to(device) for _ in range(2))
    steps = {"dp": lambda: dp_step(model, x, y, rank, world),
             "tp": (lambda tp_model: lambda: tp_step(tp_model, x, y))(TPPairs(model, rank, world).to(device)),
             "pp": (lambda stage: lambda: pp_step(stage, x, y, rank, world, width, micro_batches))(
                 build_stage(model, rank, world))}
    out = {}
    for kind in kinds:
        dist.barrier()
        stats = benchmark(steps[kind], warmup=warmup, repeats=repeats, device=device)
        medians = gather_numbers(stats.median)
        out[kind] = {"median_s": max(medians), "min_s": stats.min, "max_s": stats.max,
                     "threads": stats.threads}
    return out


def calibrate(width: int, pairs: int, batch: int, repeats: int,
              device: torch.device) -> dict[str, float]:
    """This machine's constants for the planner, measured the way the layouts run: FLOP/s of
    the matmul a dp or pp rank runs (batch/W rows × width × width, on the ranks' one thread,
    median as the layouts report), and α, β of the all-reduce fitted by chapter 07's line to
    the two messages the layouts send: tp's activations (batch × width) and dp's gradients."""
    world = dist.get_world_size()
    rows = max(batch // world, 1)
    x, w = torch.randn(rows, width, device=device), torch.randn(width, width, device=device)
    mm = benchmark(lambda: x @ w, warmup=2, repeats=repeats, device=device).median
    rate = min(gather_numbers(2 * rows * width * width / mm))
    sizes = [4 * batch * width, 4 * pairs * 2 * (width * width + width)]  # with the biases
    times = []
    for size in sizes:
        t = torch.zeros(size // 4, device=device)
        dist.barrier()
        times.append(max(gather_numbers(benchmark(lambda t=t: dist.all_reduce(t), warmup=2,
                                                  repeats=repeats, device=device).median)))
    a, b = fit_latency_bandwidth([float(s) for s in sizes], times)
    alpha, beta = ring_alpha_beta(a, b, world)
    return {"flops": rate, "alpha": alpha, "beta": beta}


def cpu_cluster(world: int, flops: float, alpha: float, beta: float) -> Cluster:
    """This machine as the planner sees it: one node of `world` ranks, memory not binding, and
    asynchronous pipeline sends (the implementation that runs here)."""
    bw = 1 / beta if beta > 0 else float("inf")
    return Cluster(n_gpus=world, gpus_per_node=world, memory_bytes=float("inf"), peak_flops=flops,
                   efficiency=1.0, alpha_intra=alpha, bw_intra=bw, alpha_inter=alpha, bw_inter=bw,
                   async_p2p=True)  # pp_step runs chapter 04's gpipe_step, which sends with isend
