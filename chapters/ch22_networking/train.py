"""Training across "nodes", a hierarchical all-reduce through node leaders, and the α–β model.

Runs on any launch: one machine (nodes simulated by groups of consecutive ranks), several
network namespaces on one machine (netns.py starts one torchrun per namespace), or real nodes.
It trains a float64 MLP with data parallelism and checks the result against one process on the
whole batch; checks the leader hierarchy (intra-node reduce, inter-node all-reduce among the
leaders, intra-node broadcast) against `all_reduce` and counts the bytes that cross between
nodes against the formula (counted where the tensors reach torch.distributed, with chapter 09's
WireTap); times all-reduces beside the calculator's prediction for links shaped to --rate-mbit
(0: not shaped, nothing predicted) and reports nccl-tests' bus bandwidth; and, with --wire-bytes
(netns.py sets it), reads the bytes each node's network interface really sent, from the
kernel's counters, against the formula. The hierarchy's checks are in checks.py.

Run:
    python chapters/ch22_networking/train.py                                      # one process
    torchrun --standalone --nproc_per_node=4 chapters/ch22_networking/train.py    # 2 nodes of 2, simulated
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-id=job1 \\
        --rdzv-endpoint=HOST0:29500 chapters/ch22_networking/train.py            # the same on every node
    sudo python chapters/ch22_networking/netns.py --nodes 2 --rate-mbit 200      # namespaces, as root
The default global batch, 48, divides over 1, 2, 3, 4, 8 and 16 ranks.
"""

import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch03_data_parallel.data_parallel import max_param_diff
from chapters.ch07_communication.collectives import P2P, ring_all_reduce
from chapters.ch22_networking.calculator import bus_bandwidth, bytes_leaving_node, shaped_time
from chapters.ch22_networking.checks import check_hierarchy
from chapters.ch22_networking.hierarchical import leader_all_reduce, make_nodes
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
# tbf lets no more than the rate leave a node, except its 32-kbit (4 KB) bucket, under 0.3 % of
# what a node sends here, and TCP/IP and Ethernet headers only add bytes (~5 %, measured by
# --wire-bytes): a ratio under 0.95 means the link was faster than predicted, or fewer bytes
# crossed than the ring sends. Upper side: CPU time on a loaded 2-core machine. It tells a rate
# off by 2x only where the link sets the time: in figures/data.json (2026-12-01, load 19 -> 7),
# with links shaped to 25 Mbit/s and 1 MiB, 4x1 and 2x2 gave 1.16-1.30, 4 nodes with links twice
# as fast as predicted 0.61-0.65 and twice as slow 2.40-2.56; at 200 Mbit/s and 2 MiB the same
# recording gave 2.05-2.92 on 4 nodes (CPU-bound). The system tests use 25 Mbit/s.
TIME_BAND = (0.95, 1.8)
# Bytes a node's interface sends (its tx_bytes) / payload bytes the formula says leave the node.
# Lower side 1: TCP delivers every payload byte, once or more. Upper side: per TCP segment of at
# most 1448 payload bytes (MTU 1500 less IPv4 20, TCP 20 and timestamps 12) the counter adds
# Ethernet 14 + IPv4 20 + TCP 32 = 66 header bytes (4.6 %), and the node also sends the ACKs of
# what it receives (in a ring as much as it sends: at most one 66-byte ACK per segment, 4.6 %);
# WIRE_SLACK bytes per measurement cover the barriers around it and the rendezvous' keep-alives.
WIRE_OVERHEAD = 2 * 66 / 1448
WIRE_SLACK = 64 * 1024


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
    wire_bytes: bool = False
    """Read the bytes each node's interface (GLOO_SOCKET_IFNAME) sent during the timed all-reduces from /sys/class/net/IF/statistics/tx_bytes and check them against the formula: only where nothing else uses that interface (netns.py turns it on)."""

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


def interface_tx_bytes() -> int | None:
    """Bytes this node's interface has sent, as the kernel counts them (every frame, headers
    included): /sys/class/net/<GLOO_SOCKET_IFNAME>/statistics/tx_bytes, as seen from this
    process's network namespace. None when the variable names no interface here."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    path = Path("/sys/class/net") / ifname / "statistics" / "tx_bytes"
    return int(path.read_text()) if ifname and path.exists() else None


def wire_agreed(enabled: bool) -> bool:
    """Whether the ranks read the wire, decided once for the whole world: every rank then joins
    the barrier and the sum of what each node's interface sent, so one node that cannot read its
    interface (GLOO_SOCKET_IFNAME unset or naming none there) turns it off everywhere (the min
    over the ranks of "my interface is readable"), instead of leaving the others in a collective
    it skips. `enabled` must be the same on every rank (it is: --wire-bytes and the node count)."""
    if not enabled:
        return False
    return reduce_number(int(interface_tx_bytes() is not None), "min") == 1


def wire_band(payload: float) -> list[float]:
    """The range measured / payload may take (WIRE_OVERHEAD, WIRE_SLACK above)."""
    return [1.0, 1.0 + WIRE_OVERHEAD + WIRE_SLACK / payload]


def slowest_time(fn, device, repeats: int) -> tuple[float, float, float]:
    """Median, min, max over repeats of the slowest rank's time (every rank waits for the last)."""
    dist.barrier()
    stats = benchmark(fn, warmup=1, repeats=repeats, device=device)
    return tuple(reduce_number(v, "max") for v in (stats.median, stats.min, stats.max))


def time_all_reduces(rec: RunRecorder, cfg: Config, info, g: int) -> None:
    """Library all-reduce (one rank per node only: its traffic pattern is then a ring of nodes),
    the leader hierarchy and the flat hand ring, each beside bytes ÷ shaped bandwidth; their bus
    bandwidth (nccl-tests) beside the shaped rate; with --wire-bytes, the bytes the nodes'
    interfaces sent during the timed calls beside the formula's."""
    n, dev = info.world_size, info.device
    if n == 1:
        rec.figure("all-reduce time", "n/a: one rank")
        return
    numel = int(cfg.allreduce_mib * 2**20) // 8 // n * n
    size = numel * 8
    x = torch.ones(numel, dtype=torch.float64, device=dev)
    nodes, flat, m = make_nodes(g), P2P(), n // g
    rate = cfg.rate_mbit * 1e6 or float("inf")  # unshaped: nothing predicted
    # name: (the call, the scheme whose bytes leave each node, the calculator's predicted time)
    runs = {"leader all-reduce": (lambda: leader_all_reduce(x, nodes), "leader", shaped_time(size, m, rate)),
            "hand flat ring": (lambda: ring_all_reduce(x, flat), "flat_ring",
                               bytes_leaving_node("flat_ring", size, g, m) * 8 / rate)}
    if g == 1:
        runs["library all_reduce"] = (lambda: dist.all_reduce(x.clone()), "flat_ring", shaped_time(size, n, rate))
    shaped = cfg.rate_mbit > 0 and m > 1
    wire = wire_agreed(cfg.wire_bytes and m > 1)
    if cfg.wire_bytes and not wire:
        rec.figure("bytes on the wire", "n/a: one node, or GLOO_SOCKET_IFNAME names no interface on some node")
    for name, (fn, scheme, predicted) in runs.items():
        leaving = bytes_leaving_node(scheme, size, g, m)  # per node, per call
        before = interface_tx_bytes() if wire and nodes.local == 0 else 0
        med, lo, hi = slowest_time(fn, dev, cfg.repeats)
        rec.figure(f"{name} time, {size / 2**20:.2f} MiB", med, expected=predicted if shaped else None,
                   unit="s", spread=(lo, hi))
        if shaped:
            rec.check(f"{name}: measured / (bytes / rate)", "timing", med / predicted,
                      list(TIME_BAND), compare="between")
            # nccl-tests' busbw, over nodes: leaving / t is what one node's link carried
            rec.figure(f"{name} bus bandwidth (link)", leaving / med, expected=rate / 8, unit="B/s")
        if name == "library all_reduce":
            rec.figure("library all_reduce busbw (nccl-tests)", bus_bandwidth(size, med, n), unit="B/s")
        if wire:
            dist.barrier()
            sent = reduce_number(interface_tx_bytes() - before if nodes.local == 0 else 0, "sum")
            payload = (1 + cfg.repeats) * m * leaving  # warm-up + repeats, every node
            rec.figure(f"{name}: bytes on the wire", sent, expected=payload, unit="B")
            rec.check(f"{name}: wire bytes / formula bytes", "formula", sent / payload,
                      wire_band(payload), compare="between")


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
