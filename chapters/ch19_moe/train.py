"""Mixture of experts by hand, then expert parallelism: all-to-all dispatch and combine, checked against one process.

An MoE layer replaces the transformer's MLP by E experts and a router that sends each token to
its top-k experts, at most `capacity` tokens per expert (the rest are dropped and ride the
residual). Expert parallelism puts E/N experts on each of N ranks: each rank routes its own
tokens, tells every rank how many rows to expect (an all-to-all of counts), sends the rows
(`all_to_all_single`, uneven splits), lets its experts run on what arrived, and sends the results
back. The router, attention and embeddings stay data-parallel. This script checks the expert-
parallel layer (top-1 and top-2) and an expert-parallel MoE TinyGPT against one process holding
every expert, and the counts, drops, balancing loss and bytes against their formulas.
Parity is checked in float64 whatever --dtype says (a float32 router can flip near-tied top-k
choices); --dtype float32 adds an expert-parallel run in float32 that is timed, not compared.

Run (experts = --experts-per-rank x world size; any world works):
    python chapters/ch19_moe/train.py                                    # one process: 2 experts
    torchrun --standalone --nproc_per_node=2 chapters/ch19_moe/train.py  # 4 experts, 2 per rank
    torchrun --standalone --nproc_per_node=3 chapters/ch19_moe/train.py  # 6 experts on 3 ranks
    torchrun --standalone --nproc_per_node=4 chapters/ch19_moe/train.py  # 8 experts; a rank may get no row
    torchrun --standalone --nproc_per_node=4 chapters/ch19_moe/train.py --top-k 1 --capacity-factor 2
    torchrun --standalone --nproc_per_node=8 chapters/ch19_moe/train.py \\
        --d-model 512 --d-ff 2048 --seq-len 256 --dtype float32          # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch19_moe/train.py                                       # 16 ranks, 32 experts
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

import torch

from chapters.ch19_moe.checks import PARITY_DTYPE, TOLERANCE, layer_check
from chapters.ch19_moe.moe import AllToAllTap, shard_moe_state
from chapters.ch19_moe.moe_gpt import MoEGPT, is_expert_param
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import CharTokenizer, text_corpus, token_windows
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, progress, setup_logging
from common.models import GPTConfig
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Config(RunConfig):
    steps: int = 8
    """SGD steps of the MoE TinyGPT."""
    experts_per_rank: int = 2
    """Experts each rank holds; the layer has experts_per_rank x world size experts."""
    top_k: int = 2
    """Experts per token: 1 (Switch) or 2 (GShard)."""
    capacity_factor: float = 1.25
    """Slots per expert = ceil(capacity_factor * top_k * tokens / experts), per rank's tokens."""
    aux_weight: float = 0.01
    """Weight of the load-balancing loss (Switch: 0.01)."""
    z_weight: float = 0.001
    """Weight of the router z-loss (ST-MoE: 0.001)."""
    d_model: int = 32
    """Hidden size."""
    d_ff: int = 64
    """Hidden size of each expert."""
    n_heads: int = 4
    """Attention heads."""
    n_layers: int = 2
    """Transformer blocks, each with an MoE layer."""
    seq_len: int = 32
    """Tokens per sequence."""
    micro_batch_size: int = 4
    """Sequences per rank per step (the global batch is this x world size)."""
    layer_tokens: int = 48
    """Tokens per rank in the layer check."""
    layer_capacity_factor: float = 1.0
    """Capacity factor of the layer check (tighter than training's, so that choices are dropped
    and the drop counts are tested)."""
    lr: float = 0.1
    """Learning rate of SGD."""
    dtype: str = "float64"
    """dtype of the timed steps. Parity is always checked in float64 (see the lesson); float32
    (on GPUs) adds an expert-parallel run in float32 that is timed, never compared."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "experts_per_rank", "d_model", "d_ff", "n_heads", "n_layers",
                             "seq_len", "micro_batch_size", "layer_tokens")
        if self.top_k not in (1, 2):
            raise ValueError(f"--top-k must be 1 or 2, got {self.top_k}")
        if min(self.capacity_factor, self.layer_capacity_factor) <= 0:
            raise ValueError("--capacity-factor and --layer-capacity-factor must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --n-heads {self.n_heads}")


def validate(cfg: Config, world_size: int) -> None:
    """Every world works: the expert count grows with it. Top-k needs k experts. On GPUs the
    chapter's all-to-all is run and checked over NCCL only: torch's gloo backend accepts CUDA
    tensors for all_to_all_single (it stages them through host memory, ProcessGroupGloo.cpp's
    AsyncAlltoallCUDAWork), but that path has not been run here, so it is refused."""
    on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if world_size > 1 and cfg.backend == "gloo" and on_gpus:
        raise ValueError("gloo on GPUs is untested for this chapter's all-to-all: use NCCL or "
                         "--device cpu")
    if cfg.experts_per_rank * world_size < cfg.top_k:
        raise ValueError(f"top-{cfg.top_k} routing needs at least {cfg.top_k} experts; "
                         f"use --experts-per-rank {cfg.top_k}")


def gpt_config(cfg: Config, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layers,
                     n_head=cfg.n_heads, d_model=cfg.d_model)


def make_batches(cfg: Config, world: int):
    """(steps, world · micro_batch_size, seq_len) windows of the course's text corpus."""
    text = text_corpus(max_chars=200_000)
    tok = CharTokenizer.fit(text)
    x, y = token_windows(tok.encode(text), cfg.seq_len, cfg.steps * world * cfg.micro_batch_size, cfg.seed)
    shape = (cfg.steps, world * cfg.micro_batch_size, cfg.seq_len)
    return x.view(shape), y.view(shape), tok.vocab_size


BROKEN_SYNC = ("none", "shared_not_reduced", "experts_undivided")


def ep_grad_sync(model: torch.nn.Module, world: int, broken: str = "none") -> None:
    """Replicated parameters: all-reduce, then average. Expert parameters: no all-reduce (each
    lives on one rank), but their gradients already hold every rank's loss (the all-to-all
    brought them), so they are divided by the world too. `broken` names a negative control:
    "shared_not_reduced" (replicated gradients left local), "experts_undivided" (no 1/N on the
    expert gradients: experts learn N times faster than the rest)."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        expert = is_expert_param(name)
        if not expert and broken != "shared_not_reduced":
            torch.distributed.all_reduce(p.grad)
        if not (expert and broken == "experts_undivided"):
            p.grad /= world


def layer_counts(model) -> torch.Tensor:
    """(2, layers, E): choices routed to and kept by each expert of each MoE layer, summed over
    the layer's routing groups. Per layer: expert e of one layer is not expert e of another, so
    the imbalance max/mean is taken per layer, then averaged over the layers."""
    return torch.stack([torch.stack([sum(r.routed for r in layer.stats.routings),
                                     sum(r.kept for r in layer.stats.routings)])
                        for layer in model.moe_layers()], dim=1)


def train(model, batches, cfg: Config, info, expert_parallel: bool, broken: str = "none") -> dict:
    """SGD on CE + α·aux + β·z. Expert-parallel: this rank's micro-batch, then `ep_grad_sync`;
    one process: the whole global batch, routed in one group per rank."""
    X, Y, _ = batches
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    rank, world, m = info.rank, info.world_size, cfg.micro_batch_size
    out = {"loss": [], "ce": [], "imbalance": [], "dropped": [], "ms": [], "idle": 0}
    for step in progress(range(cfg.steps), total=cfg.steps, desc="steps", enabled=info.is_main and expert_parallel):
        x, y = X[step].to(info.device), Y[step].to(info.device)
        if expert_parallel:
            x, y = x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m]
        with Timer(info.device) as timer:
            loss, ce = model(x, y, cfg.aux_weight, cfg.z_weight)
            loss.backward()
            if expert_parallel:
                ep_grad_sync(model, world, broken)
            opt.step()
            opt.zero_grad()
        out["ms"].append(timer.elapsed * 1e3)
        counts = layer_counts(model)  # (2, layers, E): routed and kept choices per expert
        if expert_parallel:  # the global view: every rank's routing, summed (one all-reduce)
            loss, ce = reduce_number(loss.detach()) / world, reduce_number(ce.detach()) / world
            torch.distributed.all_reduce(counts)
            out["idle"] += reduce_number(sum(int(layer.received.sum() == 0) for layer in model.moe_layers()))
        else:
            loss, ce = loss.item(), ce.item()
        routed, kept = counts.double()
        out["loss"].append(loss)
        out["ce"].append(ce)
        out["imbalance"].append((routed.amax(1) / routed.mean(1)).mean().item())
        out["dropped"].append(1 - kept.sum().item() / routed.sum().item())
    return out


def compare_params(ep_model, ref_model, rank: int, world: int, n_experts: int) -> float:
    """Largest difference between this rank's parameters and the one-process model's."""
    ref = shard_moe_state(ref_model.state_dict(), rank, world, n_experts)
    mine = ep_model.state_dict()
    return max((mine[k] - ref[k]).abs().max().item() for k in mine)


def training_check(rec: RunRecorder, cfg: Config, info, broken: str = "none"):
    """The MoE TinyGPT trained expert-parallel and on one process from the same weights; checks
    losses, trained parameters and all-to-all calls. `broken` is one of `ep_grad_sync`'s negative
    controls. Always in float64 (PARITY_DTYPE), whatever --dtype says."""
    world, dtype, E = info.world_size, DTYPES[PARITY_DTYPE], cfg.experts_per_rank * info.world_size
    batches = make_batches(cfg, world)
    seed_everything(cfg.seed)
    gcfg = gpt_config(cfg, batches[2])
    ref = MoEGPT(gcfg, cfg.d_ff, E, cfg.top_k, cfg.capacity_factor, "local", groups=world).to(info.device, dtype)
    ep = MoEGPT(gcfg, cfg.d_ff, E, cfg.top_k, cfg.capacity_factor, "ep", rank=info.rank,
                world=world).to(info.device, dtype)
    ep.load_state_dict(shard_moe_state(ref.state_dict(), info.rank, world, E))
    ref_run = train(ref, batches, cfg, info, expert_parallel=False)
    with AllToAllTap() as tap:
        ep_run = train(ep, batches, cfg, info, expert_parallel=True, broken=broken)
    tol = TOLERANCE[PARITY_DTYPE]
    rec.check("MoE TinyGPT: EP losses == one process", "parity",
              max(abs(a - b) for a, b in zip(ep_run["loss"], ref_run["loss"])), 0.0, tolerance=tol)
    rec.check("MoE TinyGPT: EP trained parameters == one process", "parity",
              reduce_number(compare_params(ep, ref, info.rank, world, E), "max"), 0.0, tolerance=tol)
    rec.check("MoE TinyGPT: all_to_all calls = steps x layers x (1 counts + 2 fwd + 2 bwd)", "count",
              len(tap.calls), cfg.steps * cfg.n_layers * 5)
    return ep_run, ep, ref


def timing_run(cfg: Config, info) -> tuple[dict, torch.nn.Module]:
    """The expert-parallel MoE TinyGPT trained in --dtype from the same start as the parity run
    (its float64 weights, rounded): timed, never compared, since in float32 a rounding
    difference may flip a near-tied top-k choice and route a token elsewhere."""
    world, E = info.world_size, cfg.experts_per_rank * info.world_size
    batches = make_batches(cfg, world)
    seed_everything(cfg.seed)
    gcfg = gpt_config(cfg, batches[2])
    ref = MoEGPT(gcfg, cfg.d_ff, E, cfg.top_k, cfg.capacity_factor, "local", groups=world)
    ep = MoEGPT(gcfg, cfg.d_ff, E, cfg.top_k, cfg.capacity_factor, "ep", rank=info.rank, world=world)
    ep.load_state_dict(shard_moe_state(ref.state_dict(), info.rank, world, E))
    ep = ep.to(info.device, DTYPES[cfg.dtype])
    return train(ep, batches, cfg, info, expert_parallel=True), ep


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        world = info.world_size
        E = cfg.experts_per_rank * world
        log.info("%d experts, %d per rank, top-%d, capacity factor %g, on %d rank(s) (%s/%s)",
                 E, cfg.experts_per_rank, cfg.top_k, cfg.capacity_factor, world, info.device, info.backend)
        for k in sorted({1, 2} & set(range(1, E + 1))):
            layer_check(rec, cfg, info, k)

        ep_run, ep, ref = training_check(rec, cfg, info)
        for step in range(cfg.steps):
            rec.metrics(step, loss=ep_run["loss"][step], ce=ep_run["ce"][step], lr=cfg.lr,
                        imbalance=ep_run["imbalance"][step], dropped_fraction=ep_run["dropped"][step])
            log.info("step %2d  loss %.5f  ce %.5f  max/mean choices per expert %.2f  dropped %.3f", step,
                     ep_run["loss"][step], ep_run["ce"][step], ep_run["imbalance"][step], ep_run["dropped"][step])
        n_expert = sum(p.numel() for name, p in ref.named_parameters() if is_expert_param(name))
        held = sum(p.numel() for name, p in ep.named_parameters() if is_expert_param(name))
        rec.figure("expert parameters held per rank (all experts' / world, by construction)", held,
                   n_expert // world)
        rec.figure("layer passes in which a rank's experts received no rows (all ranks, steps)",
                   int(ep_run["idle"]))
        rec.figure("final cross-entropy", round(ep_run["ce"][-1], 5), unit="nats")
        rec.figure("max/mean choices per expert (mean over layers), first and last step",
                   [round(ep_run["imbalance"][0], 3), round(ep_run["imbalance"][-1], 3)])
        timed = ep_run
        if cfg.dtype != PARITY_DTYPE:
            timed = timing_run(cfg, info)[0]
            log.info("%s run (timed, not compared): final ce %.5f; the checks above ran in %s",
                     cfg.dtype, timed["ce"][-1], PARITY_DTYPE)
        steady = timed["ms"][1:] or timed["ms"]
        rec.figure(f"step time, expert-parallel: median of steps 1-{cfg.steps - 1}",
                   round(statistics.median(steady), 2), unit="ms", spread=(min(steady), max(steady)))
        rec.figure("threads per rank", torch.get_num_threads())
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
