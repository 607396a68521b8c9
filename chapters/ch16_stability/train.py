"""Numerical stability at scale: clip by the global norm over shards, skip bad steps on every rank.

An FSDP2 model keeps only a shard of each gradient per rank, so the global gradient norm is the
square root of the all-reduced sum of the ranks' local squared norms; this script writes that by
hand over the DTensor local shards and checks it against torch's `clip_grad_norm_` and against
one unsharded process. A NaN injected into one rank's batch, an inf written into one rank's own
gradient shard after the reduce-scatter (a fault only that rank sees) and a loss spike are caught,
and every rank agrees (one MAX all-reduce of a "bad" flag) to skip the step, leaving weights and
Adam state untouched; the bf16 accumulation-error table is measured beside its bounds.

Run:
    python chapters/ch16_stability/train.py                                    # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch16_stability/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch16_stability/train.py  # uneven shards
    torchrun --standalone --nproc_per_node=8 chapters/ch16_stability/train.py  # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch16_stability/train.py                                       # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch16_stability/train.py   # Slurm
"""

import copy
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from chapters.ch16_stability import checks
from common.checkpoint import save_checkpoint
from common.config import RunConfig, check_global_batch, parse_config
from common.data import regression_data
from common.distributed import (
    reduce_number,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything


@dataclass
class Config(RunConfig):
    global_batch_size: int = 48
    """Samples per step, split evenly over the ranks (48: valid on 1, 2, 3, 4, 8 and 16 ranks)."""
    lr: float = 0.01
    """Adam learning rate."""
    max_norm: float = 0.5
    """Clip the global gradient norm to this value."""
    d_in: int = 8
    """Input features of the MLP."""
    d_hidden: int = 64
    """Hidden width (64 rows shard unevenly over 3 ranks: 22, 22, 20)."""
    poison_step: int = 8
    """Step whose batch gets a non-finite value on one rank (-1: none)."""
    poison_rank: int = 1
    """Rank whose batch is poisoned (taken modulo the world size)."""
    poison_value: float = float("nan")
    """The value injected: nan or inf."""
    grad_fault_step: int = 17
    """Step at which an inf is written into one rank's own gradient shard after the reduce-scatter: a fault only that rank sees (-1: none)."""
    grad_fault_rank: int = 0
    """Rank whose gradient shard gets the inf (taken modulo the world size)."""
    spike_step: int = 13
    """Step whose targets are scaled by spike_scale on every rank, a loss spike (-1: none)."""
    spike_scale: float = 30.0
    """Factor applied to the targets of the spike step."""
    spike_factor: float = 4.0
    """A loss above spike_factor x the running median of recent losses is a spike."""
    spike_window: int = 5
    """Number of recent accepted losses in the running median."""
    sum_terms: int = 100_000
    """Terms in the bf16 accumulation-error experiment (uniform in [0, 1e-3))."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.global_batch_size < 1 or self.spike_window < 1 or self.sum_terms < 2:
            raise ValueError("--global-batch-size and --spike-window must be at least 1, --sum-terms at least 2")
        if self.max_norm <= 0 or self.spike_factor <= 1:
            raise ValueError("--max-norm must be positive and --spike-factor above 1")


def validate(cfg: Config, world_size: int) -> None:
    """The global batch splits into equal shards (the global loss is the mean of the ranks' means)."""
    check_global_batch(cfg.global_batch_size, world_size)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) tensor this rank holds."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_grad_sq_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """Σ g² over this rank's shards only (float64, so the sum of shards adds up exactly)."""
    sq = [local_shard(p.grad).double().pow(2).sum() for p in params if p.grad is not None]
    return torch.stack(sq).sum()


def global_grad_norm(params: list[nn.Parameter], sharded: bool = True) -> torch.Tensor:
    """‖g‖ = sqrt(Σ_ranks Σ_local g²). Each element lives on exactly one rank under FSDP2, so
    one all-reduce of a scalar gives the norm of the whole model's gradient."""
    sq = local_grad_sq_norm(params)
    if sharded:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    return sq.sqrt()


def clip_by_global_norm(params: list[nn.Parameter], max_norm: float, sharded: bool = True) -> torch.Tensor:
    """Scale every local gradient shard by min(1, max_norm / (‖g‖ + 1e-6)), as torch does."""
    norm = global_grad_norm(params, sharded)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            local_shard(p.grad).mul_(coef.to(p.grad.dtype))
    return norm


def all_ranks_agree(bad: bool, sharded: bool = True) -> bool:
    """True on every rank if it is true on any rank: a MAX all-reduce of a 0/1 flag (on the
    device the backend needs: `reduce_number`). A rank that decides alone skips while its peers
    step (or the reverse), and the model's shards drift apart for good. `sharded=False`: this
    rank's own view, undecided by the others (a world of one, or the negative control)."""
    return bool(reduce_number(int(bad), "max")) if sharded else bad


def is_spike(loss: float, history: list[float], cfg: Config) -> bool:
    """A loss above spike_factor x the running median of the last spike_window accepted losses."""
    recent = history[-cfg.spike_window:]
    return len(recent) == cfg.spike_window and loss > cfg.spike_factor * statistics.median(recent)


def make_batch(X, Y, step: int, cfg: Config, rank: int, world_size: int):
    """This rank's shard of the step's global batch, with the injected faults."""
    x, y = X[step].chunk(world_size)[rank].clone(), Y[step].chunk(world_size)[rank].clone()
    if step == cfg.spike_step:
        y *= cfg.spike_scale
    if step == cfg.poison_step and rank == cfg.poison_rank % world_size:
        x[0, 0] = cfg.poison_value
    return x, y


def inject_grad_fault(params: list[nn.Parameter], step: int, cfg: Config, rank: int, world_size: int) -> None:
    """After the backward (and FSDP2's reduce-scatter): an inf in this rank's own gradient shard at
    --grad-fault-step, a fault no other rank sees (a flipped bit, a bad kernel on one device).
    It goes into the first parameter of which this rank holds a non-empty shard."""
    if step == cfg.grad_fault_step and rank == cfg.grad_fault_rank % world_size:
        shard = next(g for g in (local_shard(p.grad) for p in params) if g.numel())
        shard.view(-1)[0] = float("inf")


def step_is_bad(loss: torch.Tensor, params: list[nn.Parameter]) -> bool:
    """This rank's view: a non-finite loss or a non-finite value in its gradient shards."""
    return not (torch.isfinite(loss) and torch.isfinite(local_grad_sq_norm(params)))


def train(model: nn.Module, opt: torch.optim.Optimizer, X, Y, cfg: Config, rank: int,
          world_size: int, sharded: bool, steps: range | None = None, log_: dict | None = None,
          agree: bool = True) -> dict:
    """Adam with global-norm clipping; a step whose loss or gradients are not finite on any
    rank, or whose global loss spikes, is skipped by all ranks together. Every rank runs the
    same collectives whatever it decides (the norms are computed before the branch, which holds
    only the local `opt.step()`), so a wrong decision cannot hang: `agree=False` lets each rank
    decide on its own view, the negative control whose shards drift apart."""
    params = list(model.parameters())
    keys = ("every_loss", "taken", "loss", "hand_norm", "torch_norm", "skipped_bad", "spikes", "bad_here")
    log_ = log_ or {k: [] for k in keys}
    for step in steps or range(cfg.steps):
        x, y = make_batch(X, Y, step, cfg, rank, world_size)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        inject_grad_fault(params, step, cfg, rank, world_size)
        global_loss = loss.detach().clone()
        if sharded:
            dist.all_reduce(global_loss)
            global_loss /= world_size  # equal shards: the mean of means is the global mean
        log_["every_loss"].append(global_loss.item())
        bad_here = step_is_bad(loss, params)  # decided before clipping: a NaN norm poisons every grad
        if bad_here:
            log_["bad_here"].append(step)
        bad = all_ranks_agree(bad_here, sharded and agree)
        hand_norm = global_grad_norm(params, sharded).item()  # collectives on every rank, every step
        norm = nn.utils.clip_grad_norm_(params, cfg.max_norm)  # torch's, DTensor-aware
        if bad:  # the gradients (clipped by a non-finite norm) are dropped below
            log_["skipped_bad"].append(step)
        elif is_spike(global_loss.item(), log_["loss"], cfg):
            log_["spikes"].append(step)
        else:
            log_["hand_norm"].append(hand_norm)
            log_["torch_norm"].append(local_shard(norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
            opt.step()
            log_["taken"].append(step)
            log_["loss"].append(global_loss.item())
        opt.zero_grad(set_to_none=True)
    return log_


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Clones of this rank's weight shards and Adam state (exp_avg, exp_avg_sq, step)."""
    out = [local_shard(p.detach()).clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [local_shard(state[k]).clone() for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def fully_shard_model(model: nn.Module, info) -> nn.Module:
    """FSDP2: every parameter becomes a DTensor sharded on dim 0 over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=init_device_mesh(info.device.type, (info.world_size,)))


def full_params(model: nn.Module) -> dict:
    """Every parameter gathered whole (an all-gather per DTensor: every rank must call it)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in model.state_dict().items()}


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed,
                               dtype=torch.float64)
        X = X.view(cfg.steps, cfg.global_batch_size, cfg.d_in).to(info.device)
        Y = Y.view(cfg.steps, cfg.global_batch_size, 1).to(info.device)
        model = MLP(cfg.d_in, cfg.d_hidden, 1).to(info.device, torch.float64)
        reference = copy.deepcopy(model)  # one process on the whole batch, every rank can afford it
        ref = train(reference, torch.optim.Adam(reference.parameters(), lr=cfg.lr), X, Y, cfg,
                    0, 1, sharded=False)
        fsdp = fully_shard_model(model, info)
        opt = torch.optim.Adam(fsdp.parameters(), lr=cfg.lr)
        run = train(fsdp, opt, X, Y, cfg, info.rank, info.world_size, sharded=True)
        for step, loss, norm in zip(run["taken"], run["loss"], run["hand_norm"]):
            if step % cfg.log_every == 0:
                rec.metrics(step, loss=loss, lr=cfg.lr, grad_norm=norm)
        log.info("world %d on %s/%s: skipped bad steps %s, spikes %s, %d optimizer steps",
                 info.world_size, info.device, info.backend, run["skipped_bad"], run["spikes"],
                 len(run["loss"]))

        params = full_params(fsdp)
        adam_steps = int(opt.state[next(fsdp.parameters())]["step"].item())
        checks.record_training(rec, cfg, info.world_size, run, ref, params, reference, adam_steps)

        if info.is_main:  # single-process arithmetic, no collective inside: rank 0 alone
            checks.record_accumulation(rec, cfg)
            save_checkpoint(rec.out / "final_params.pt", {
                "fsdp": params, "reference": reference.state_dict(),
                "hand_norm": torch.tensor(run["hand_norm"]), "torch_norm": torch.tensor(run["torch_norm"])})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
