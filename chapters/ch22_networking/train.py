"""Training across "nodes", a hierarchical all-reduce through node leaders, and the α–β model.

Runs on any launch: one machine (nodes simulated by groups of consecutive ranks), several
network namespaces on one machine (netns.py starts one torchrun per namespace), or real nodes.
It trains a float64 MLP with data parallelism and checks the result against one process on the
whole batch; checks the leader hierarchy (intra-node reduce, inter-node all-reduce among the
leaders, intra-node broadcast) against `all_reduce` and counts the bytes that cross between
nodes against the formula; and times all-reduces beside the calculator's prediction for links
shaped to --rate-mbit (0: not shaped, nothing predicted).

Run:
    python chapters/ch22_networking/train.py                                      # one process
    torchrun --standalone --nproc_per_node=4 chapters/ch22_networking/train.py    # 2 nodes of 2, simulated
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-id=job1 \\
        --rdzv-endpoint=HOST0:29500 chapters/ch22_networking/train.py            # the same on every node
    sudo python chapters/ch22_networking/netns.py --nodes 2 --rate-mbit 200      # namespaces, as root
The default global batch, 48, divides over 1, 2, 3, 4, 8 and 16 ranks.
"""

import copy
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch07_communication.collectives import (
    P2P,
    expected_bytes_sent,
    off_node_bytes,
    ring_all_reduce,
)
from chapters.ch07_communication.train import max_abs_diff, rank_data, sum_tolerance
from chapters.ch22_networking.calculator import bytes_leaving_node, shaped_time
from chapters.ch22_networking.hierarchical import inter_node_bytes, leader_all_reduce, make_nodes
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
from common.timing import benchmark

# Measured/predicted time of an all-reduce over shaped links must lie in this band. Lower side:
# tbf lets no more than the rate leave a node, except its 32-kbit (4 KB) bucket, 0.3 % of the
# 1.5 MiB a node sends on 4 nodes, and TCP/IP and Ethernet headers only add bytes (~3-5 %): a
# ratio under 0.95 means the link was not shaped to the rate, or fewer bytes crossed than the
# ring sends (a prediction with 2·S per node instead of 2(n−1)/n·S on 4 nodes gives 0.87).
# Upper side: CPU time on a loaded 2-core machine (gloo's all_reduce: 1.10–1.49 and 1.10–1.21 in
# two recordings; the hand rings 1.09–1.34 since chapter 07's P2P posts its receive first).
TIME_BAND = (0.95, 1.8)


@dataclass
class Config(RunConfig):
    global_batch_size: int = 48
    """Samples per step over all ranks (48 divides over 1, 2, 3, 4, 8 and 16 ranks)."""
    lr: float = 0.05
    """SGD learning rate."""
    ranks_per_node: int = 0
    """Ranks per node for the hierarchy; 0: torchrun's local world when there are several nodes, else 2 (1 for an odd world)."""
    hier_numel: int = 12288
    """Elements of the tensor the hierarchical all-reduce sums (12288 divides by 1, 2, 3, 4, 8, 16)."""
    rate_mbit: float = 0.0
    """Bandwidth each node's link is shaped to (Mbit/s), for the predicted times; 0: not shaped."""
    allreduce_mib: float = 2.0
    """Size of the timed all-reduces, MiB."""
    repeats: int = 3
    """Timed repeats of each all-reduce (after one warm-up); the median is reported."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("global_batch_size", "hier_numel", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.ranks_per_node < 0 or self.rate_mbit < 0 or self.allreduce_mib <= 0:
            raise ValueError("--ranks-per-node and --rate-mbit must be >= 0, --allreduce-mib > 0")


def validate(cfg: Config, world_size: int) -> None:
    check_global_batch(cfg.global_batch_size, world_size)
    if cfg.ranks_per_node and world_size % cfg.ranks_per_node:
        raise ValueError(f"--ranks-per-node {cfg.ranks_per_node} must divide the world of {world_size}")


def ranks_per_node(cfg: Config, world_size: int, local_world_size: int) -> int:
    """As asked; else the real node when there are several; else simulated nodes of 2 ranks."""
    if cfg.ranks_per_node:
        return cfg.ranks_per_node
    if local_world_size < world_size:
        return local_world_size
    return 2 if world_size % 2 == 0 and world_size > 2 else 1


def batches(cfg: Config):
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, 8, 1, seed=cfg.seed, dtype=torch.float64)
    return X.view(cfg.steps, cfg.global_batch_size, 8), Y.view(cfg.steps, cfg.global_batch_size, 1)


def train(model, X, Y, cfg: Config, rank: int, world: int, all_reduce: bool = True):
    """SGD on this rank's shard of every global batch, gradients averaged over the ranks by
    all-reduce (world 1 and rank 0 of 1: one process on the whole batch, the reference).
    `all_reduce=False` is the negative control: every rank trains on its shard alone."""
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        x, y = X[step].chunk(world)[rank], Y[step].chunk(world)[rank]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if all_reduce and world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
    return model


def max_param_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def check_training(rec: RunRecorder, cfg: Config, info) -> dict:
    """Data parallelism over the nodes ends at the one-process parameters (float64: summing the
    ranks' gradients in another order moves them by ~1e-16 per step; tolerance 1e-12)."""
    X, Y = batches(cfg)
    seed_everything(cfg.seed)
    model = MLP(8, 32, 1).to(torch.float64)
    single = train(copy.deepcopy(model), X, Y, cfg, 0, 1)
    dev = info.device  # every tensor a collective sees lives there (NCCL: CUDA only)
    dp = train(copy.deepcopy(model).to(dev), X.to(dev), Y.to(dev), cfg, info.rank,
               info.world_size).cpu()
    rec.check("DP over the nodes == one process (max |dparam|)", "parity",
              max_param_diff(dp, single), 0.0, 1e-12)
    if info.world_size > 1:
        alone = train(copy.deepcopy(model), X, Y, cfg, info.rank, info.world_size, all_reduce=False)
        # min over ranks: every rank's own model must differ, the check fails if any one agrees
        rec.check("control: no all-reduce differs from one process", "parity",
                  reduce_number(max_param_diff(alone, single), "min"), 1e-12, compare=">")
    return {"single": single.state_dict(), "dp": dp.state_dict()}


def check_hierarchy(rec: RunRecorder, cfg: Config, info, g: int) -> None:
    """Leader all-reduce == all_reduce; bytes crossing between nodes, counted, == formula."""
    n, rank, dev = info.world_size, info.rank, info.device
    nodes = make_nodes(g)
    m, elem = nodes.m, 8
    x = rank_data(cfg.hier_numel, torch.float64, rank, cfg.seed, dev)
    lib = x.clone()
    dist.all_reduce(lib)
    tol = sum_tolerance(n, torch.float64, reduce_number(x.abs().max().item(), "max"))
    hier = leader_all_reduce(x, nodes)
    rec.check(f"leader all-reduce == all_reduce ({m} nodes x {g})", "parity",
              reduce_number(max_abs_diff(hier, lib), "max"), 0.0, tol)
    inter = reduce_number(inter_node_bytes(nodes, rank), "sum")
    want = m * bytes_leaving_node("leader", cfg.hier_numel * elem, g, m)
    rec.check("inter-node bytes, leaders = 2(m-1)S", "formula", inter, want)
    mine = expected_bytes_sent("ring", cfg.hier_numel, m, nodes.node, elem) if nodes.local == 0 else 0
    rec.check("inter-node bytes of this rank = ch07's ring formula", "formula",
              inter_node_bytes(nodes, rank), mine)
    rec.check("intra-node bytes handed to reduce + broadcast = 2S", "count", nodes.intra_bytes,
              2 * cfg.hier_numel * elem)
    flat = P2P()
    ring_all_reduce(x, flat)
    flat_inter = reduce_number(off_node_bytes(flat.bytes_to, rank, g), "sum")
    rec.check("inter-node bytes, flat ring = 2m(n-1)/n S", "formula", flat_inter,
              m * bytes_leaving_node("flat_ring", cfg.hier_numel * elem, g, m))
    if m > 1:
        rec.check("control: no inter-node step differs from all_reduce", "parity",
                  reduce_number(max_abs_diff(leader_all_reduce(x, nodes, skip_inter=True), lib), "max"),
                  tol, compare=">")
        if g > 1:
            rec.check("leaders send fewer inter-node bytes than a flat ring", "count", inter,
                      flat_inter, compare="<")
    rec.figure("nodes x ranks per node", f"{m} x {g}")


def slowest_time(fn, device, repeats: int) -> tuple[float, float, float]:
    """Median, min, max over repeats of the slowest rank's time (every rank waits for the last)."""
    dist.barrier()
    stats = benchmark(fn, warmup=1, repeats=repeats, device=device)
    return tuple(reduce_number(v, "max") for v in (stats.median, stats.min, stats.max))


def time_all_reduces(rec: RunRecorder, cfg: Config, info, g: int) -> None:
    """Library all-reduce (one rank per node only: its traffic pattern is then a ring of nodes),
    the leader hierarchy and the flat hand ring, each beside bytes ÷ shaped bandwidth."""
    n, dev = info.world_size, info.device
    if n == 1:
        rec.figure("all-reduce time", "n/a: one rank")
        return
    numel = int(cfg.allreduce_mib * 2**20) // 8 // n * n
    size = numel * 8
    x = torch.ones(numel, dtype=torch.float64, device=dev)
    nodes, flat, m = make_nodes(g), P2P(), n // g
    rate = cfg.rate_mbit * 1e6 or float("inf")  # unshaped: nothing predicted
    runs = {"leader all-reduce": (lambda: leader_all_reduce(x, nodes), shaped_time(size, m, rate)),
            "hand flat ring": (lambda: ring_all_reduce(x, flat),
                               bytes_leaving_node("flat_ring", size, g, m) * 8 / rate)}
    if g == 1:
        runs["library all_reduce"] = (lambda: dist.all_reduce(x.clone()), shaped_time(size, n, rate))
    shaped = cfg.rate_mbit > 0 and m > 1
    for name, (fn, predicted) in runs.items():
        med, lo, hi = slowest_time(fn, dev, cfg.repeats)
        rec.figure(f"{name} time, {size / 2**20:.2f} MiB", med, expected=predicted if shaped else None,
                   unit="s", spread=(lo, hi))
        if shaped:
            rec.check(f"{name}: measured / (bytes / rate)", "timing", med / predicted,
                      list(TIME_BAND), compare="between")


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        g = ranks_per_node(cfg, info.world_size, info.local_world_size)
        log.info("world %d on %s/%s: %d node(s) of %d rank(s)%s", info.world_size, info.device,
                 info.backend, info.world_size // g, g,
                 f", links shaped to {cfg.rate_mbit:g} Mbit/s" if cfg.rate_mbit else "")
        params = check_training(rec, cfg, info)
        check_hierarchy(rec, cfg, info, g)
        time_all_reduces(rec, cfg, info, g)
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt", params)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
