"""Activation recomputation in data-parallel training: what autograd keeps, what it costs.

A forward pass keeps activations alive until backward; recomputation keeps fewer and reruns
part of the forward in backward instead. This script trains a stack of transformer feed-forward
blocks on every rank's shard with no, selective and full recomputation (by hand and with
torch.utils.checkpoint), counts the bytes held for backward beside the formula, checks that
gradients and trained parameters are those of no recomputation (bit for bit where the forward's
own ops are rerun, within a few ulps for the hand-written selective backward), and times the cost.

Run:
    python chapters/ch20_memory/train.py                                        # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch20_memory/train.py
    torchrun --standalone --nproc_per_node=8 chapters/ch20_memory/train.py \\
        --d-model 1024 --d-ff 4096 --tokens 8192 --dtype float32                # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch20_memory/train.py                                           # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch20_memory/train.py   # Slurm
"""

import copy
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chapters.ch03_data_parallel.data_parallel import all_reduce_gradients
from chapters.ch20_memory.data_shard import rank_rows, regression_shard
from chapters.ch20_memory.recompute import (
    RERUNS,
    STRATEGIES,
    ResidualMLP,
    StorageCensus,
    hooks_see_everything,
    predicted_saved_bytes,
    recompute_flop_ratio,
    run_block,
    saved_tensor_bytes,
)
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import benchmark

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Config(RunConfig):
    steps: int = 10
    """Optimizer steps of data-parallel training per strategy."""
    d_model: int = 32
    """Width of the residual stream (the block input and output)."""
    d_ff: int = 128
    """Hidden width of each feed-forward block (4 x d_model in GPT-2)."""
    n_layers: int = 4
    """Number of feed-forward blocks."""
    tokens: int = 64
    """Tokens per rank per step (micro_batch_size x sequence length, flattened)."""
    lr: float = 0.05
    """Learning rate of SGD."""
    dtype: str = "float64"
    """float64 or float32: reruns are bit-for-bit in both; the hand selective backward is within a few ulps."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        require_at_least_one(self, "d_model", "d_ff", "n_layers", "tokens")


def nccl_determinism_env(cfg: Config, environ=os.environ) -> dict:
    """Environment to set before NCCL starts so that separately run trainings add their
    gradients in the same order (the tolerance-0 checks compare such trainings): no NVLS,
    whose in-switch reductions (NVLink SHARP) may add in any order. As chapter 25 does; a
    variable the user set is kept. Nothing on CPUs."""
    on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    wanted = {"NCCL_NVLS_ENABLE": "0"} if on_gpus else {}
    return {k: v for k, v in wanted.items() if k not in environ}


def loss_fn(model: ResidualMLP, x: torch.Tensor, y: torch.Tensor, strategy: str) -> torch.Tensor:
    """Mean squared error of the block stack run under `strategy`."""
    for block in model.blocks:
        x = run_block(block, x, strategy)
    return F.mse_loss(x, y)


def measure_saved(model: ResidualMLP, x, y, strategy: str) -> dict:
    """One forward+backward: bytes saved for backward (hooks), bytes alive after forward
    (storage census) and the gradients."""
    model.zero_grad()
    with saved_tensor_bytes(exclude=[*model.parameters(), x, y]) as saved:
        loss = loss_fn(model, x, y, strategy)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    census = StorageCensus()
    with census:
        loss = loss_fn(model, x, y, strategy)
    live = census.live_bytes(exclude=[loss, *model.parameters()])
    del loss  # frees the graph and everything it kept
    return {"saved": sum(saved.values()), "live": live, "grads": grads}


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def validate(cfg: Config, world_size: int) -> None:
    """Nothing here depends on the world size: --tokens is per rank, so every world is valid."""


def roundings_per_gradient(cfg: Config) -> int:
    """How many roundings stand behind one gradient element, at most: a weight gradient sums
    over the tokens, and the gradient it starts from came back through every block's two
    matmuls (sums of d_ff and d_model terms)."""
    return cfg.tokens + cfg.n_layers * (cfg.d_ff + cfg.d_model)


def parity_tolerance(strategy: str, cfg: Config, scale: float, steps: int = 1) -> float:
    """0 for a strategy that reruns the forward's own ops (the same computation, same machine);
    else a few ulps times the roundings behind each element, times the steps taken, relative
    to the size `scale` of what is compared: a different order of the same sums."""
    if strategy in RERUNS or strategy == "none":
        return 0.0
    unit_roundoff = torch.finfo(DTYPES[cfg.dtype]).eps / 2
    return 4 * steps * roundings_per_gradient(cfg) * unit_roundoff * scale


def largest(tensors: list[torch.Tensor]) -> float:
    return max(t.abs().max().item() for t in tensors)


def record_saved(rec: RunRecorder, results: dict, cfg: Config, elem: int) -> None:
    """Bytes kept for backward beside the formula, and gradients beside no recomputation."""
    reference = results["none"]["grads"]
    for s, r in results.items():
        expected = predicted_saved_bytes(s, cfg.tokens, cfg.d_model, cfg.d_ff, cfg.n_layers, elem)
        rec.figure(f"saved for backward, {s}", r["saved"], expected, unit="bytes")
        if hooks_see_everything(s):
            rec.check(f"saved bytes (hooks) = formula, {s}", "formula", r["saved"], expected)
        else:  # this torch keeps SAC's tensors out of the hooks' sight: only the census counts
            log.info("torch %s: selective checkpointing bypasses saved_tensors_hooks; the hooks "
                     "saw %d bytes, the census checks the formula", torch.__version__, r["saved"])
        rec.check(f"live bytes (census) = formula, {s}", "formula", r["live"], expected)
        if s != "none":
            rec.check(f"gradients {s} == none (max |dgrad|)", "parity",
                      max_diff(r["grads"], reference), 0.0,
                      parity_tolerance(s, cfg, largest(reference)))


def train_data_parallel(model: ResidualMLP, X, Y, cfg: Config, info, strategy: str) -> list:
    """Chapter 03's loop with recomputation inside: each rank its shard (X, Y: this rank's
    (steps, tokens, d)), gradients all-reduced, SGD. Returns the trained parameters and this
    rank's losses."""
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        x, y = X[step], Y[step]
        opt.zero_grad()
        loss = loss_fn(model, x, y, strategy)
        loss.backward()
        all_reduce_gradients(model, info.world_size)
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def step_time_us(model: ResidualMLP, x, y, strategy: str, device) -> tuple[float, float, float]:
    """Median, min and max time of one forward+backward in µs (reported, never asserted)."""
    stats = benchmark(lambda: loss_fn(model, x, y, strategy).backward(), warmup=2, repeats=7,
                      device=device)
    return stats.median * 1e6, stats.min * 1e6, stats.max * 1e6


def cuda_peak_bytes(model: ResidualMLP, x, y, strategy: str) -> int:
    """Peak bytes the CUDA caching allocator handed out during one forward+backward, above
    what it held before: the weights and the data are in that baseline; the gradients are
    set to None first, so the ones this backward creates count in the peak."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss_fn(model, x, y, strategy).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main(cfg: Config) -> int:
    nccl_env = nccl_determinism_env(cfg)
    os.environ.update(nccl_env)  # before NCCL's first communicator
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        if nccl_env:
            log.info("set %s: NVLS reductions are not bitwise reproducible, and the trainings "
                     "below are compared with tolerance 0", nccl_env)
        dtype, n = DTYPES[cfg.dtype], cfg.tokens * info.world_size
        model = ResidualMLP(cfg.d_model, cfg.d_ff, cfg.n_layers).to(info.device, dtype)
        rows = rank_rows(cfg.steps, cfg.tokens, info.rank, info.world_size)
        X, Y = regression_shard(cfg.steps * n, cfg.d_model, cfg.d_model, rows, seed=cfg.seed, dtype=dtype)
        shape = (cfg.steps, cfg.tokens, cfg.d_model)  # this rank's rows only, step by step
        X, Y = X.view(shape).to(info.device), Y.view(shape).to(info.device)
        x, y = X[0], Y[0]
        elem = torch.finfo(dtype).bits // 8
        log.info("world %d on %s/%s: %d blocks %dx%d, %d tokens per rank, %s",
                 info.world_size, info.device, info.backend, cfg.n_layers, cfg.d_model, cfg.d_ff,
                 cfg.tokens, cfg.dtype)

        results = {s: measure_saved(model, x, y, s) for s in STRATEGIES}
        record_saved(rec, results, cfg, elem)

        trained = {s: train_data_parallel(copy.deepcopy(model), X, Y, cfg, info, s)[0]
                   for s in STRATEGIES if s != "none"}
        trained["none"], losses = train_data_parallel(copy.deepcopy(model), X, Y, cfg, info, "none")
        for s in STRATEGIES[1:]:
            rec.check(f"DP training {s} == none (max |dparam|)", "parity",
                      max_diff(trained[s], trained["none"]), 0.0,
                      parity_tolerance(s, cfg, largest(trained["none"]), cfg.steps))
        for step, loss in enumerate(losses):
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                rec.metrics(step, loss=loss, lr=cfg.lr)
                log.info("step %3d  loss %.5f (no recomputation, rank 0's shard)", step, loss)

        base_us = None
        for s in STRATEGIES:
            us, fastest, slowest = step_time_us(copy.deepcopy(model), x, y, s, info.device)
            base_us = base_us or us
            rec.figure(f"step time, {s}", us, unit="us", spread=(fastest, slowest))
            rec.figure(f"step time / none, {s}", us / base_us, recompute_flop_ratio(s))
        if info.device.type == "cuda":
            for s in STRATEGIES:
                rec.figure(f"CUDA peak allocated, {s}", cuda_peak_bytes(model, x, y, s), unit="bytes")
            stats = torch.cuda.memory_stats()
            rec.figure("CUDA reserved - allocated (fragmentation)",
                       stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"],
                       unit="bytes")
        else:
            log.info("CPU run: there is no caching-allocator statistic to read; the storage census")
            log.info("is what torch.cuda.memory_allocated would show on a GPU.")
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
