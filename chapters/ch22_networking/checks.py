"""The proofs chapter 22's run records about the leader hierarchy: it sums what `all_reduce`
sums, and the bytes it hands to torch.distributed (counted by chapter 09's `WireTap`) and sends
between nodes equal the formulas; its control (no inter-node step) is caught. train.py runs it
beside the training parity (`check_training`) and the timed all-reduces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chapters.ch07_communication.checks import max_abs_diff, rank_data, sum_tolerance
from chapters.ch07_communication.collectives import (
    P2P,
    expected_bytes_sent,
    off_node_bytes,
    ring_all_reduce,
)
from chapters.ch09_compression.wire import WireTap
from chapters.ch22_networking.calculator import bytes_leaving_node
from chapters.ch22_networking.hierarchical import inter_node_bytes, leader_all_reduce, make_nodes
from common.distributed import reduce_number
from common.results import RunRecorder


def check_hierarchy(rec: RunRecorder, cfg, info, g: int) -> None:
    """Leader all-reduce == all_reduce; the bytes handed to torch.distributed (WireTap: counted
    where they reach `dist`, not by the code under test) and those crossing between nodes == formula.
    `cfg` is train.py's Config (its hier_numel and seed)."""
    n, rank, dev = info.world_size, info.rank, info.device
    nodes = make_nodes(g)
    m, elem = nodes.m, 8
    size = cfg.hier_numel * elem
    x = rank_data(cfg.hier_numel, torch.float64, rank, cfg.seed, dev)
    lib = x.clone()
    dist.all_reduce(lib)
    tol = sum_tolerance(n, torch.float64, reduce_number(x.abs().max().item(), "max"))
    with WireTap() as tap:
        hier = leader_all_reduce(x, nodes)
    rec.check(f"leader all-reduce == all_reduce ({m} nodes x {g})", "parity",
              reduce_number(max_abs_diff(hier, lib), "max"), 0.0, tol)
    # every leader's sends go to another node's leader: the tap's sends are inter-node bytes
    inter = reduce_number(tap.nbytes("send"), "sum")
    rec.check("inter-node bytes, leaders = 2(m-1)S", "formula", inter,
              m * bytes_leaving_node("leader", size, g, m))
    mine = expected_bytes_sent("ring", cfg.hier_numel, m, nodes.node, elem) if nodes.local == 0 else 0
    rec.check("inter-node bytes of this rank = ch07's ring formula", "formula",
              inter_node_bytes(nodes, rank), mine)
    # intra-node: every rank hands S to its node's reduce, every leader S to the broadcast
    intra = reduce_number(tap.nbytes("reduce") + tap.nbytes("broadcast"), "sum")
    rec.check("bytes to the nodes' reduce + broadcast = (n+m)S", "formula", intra, (n + m) * size)
    flat = P2P()
    ring_all_reduce(x, flat)
    flat_inter = reduce_number(off_node_bytes(flat.bytes_to, rank, g), "sum")
    rec.check("inter-node bytes, flat ring = 2m(n-1)/n S", "formula", flat_inter,
              m * bytes_leaving_node("flat_ring", size, g, m))
    if m > 1:
        with WireTap() as skipped:
            broken = leader_all_reduce(x, nodes, skip_inter=True)
        rec.check("control: no inter-node step differs from all_reduce", "parity",
                  reduce_number(max_abs_diff(broken, lib), "max"), tol, compare=">")
        rec.check("control: skipped inter-node step sends 0 bytes", "count",
                  reduce_number(skipped.nbytes("send"), "sum"), 0)
        if g > 1:
            rec.check("leaders send fewer inter-node bytes than a flat ring", "count", inter,
                      flat_inter, compare="<")
    rec.figure("nodes x ranks per node", f"{m} x {g}")
