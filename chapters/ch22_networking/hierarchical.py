"""Hierarchical all-reduce through node leaders, by hand, on torch.distributed subgroups.

Three phases: every node reduces to its leader (its first rank) over the node's group; the
leaders all-reduce among themselves (a ring written with chapter 07's counted point-to-point
messages, so the bytes that cross between nodes are the bytes actually sent); every leader
broadcasts the result back over its node's group. Nodes hold consecutive ranks: node k is ranks
k·g … k·g+g−1 (what torchrun gives with --nproc_per_node=g; with c10d, node k is the agent
the rendezvous numbered k, not necessarily the k-th machine started).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from chapters.ch07_communication.collectives import P2P, off_node_bytes, ring_all_reduce


@dataclass
class Nodes:
    """One rank's view of the node layout: its node's group, and (on leaders) the leaders' group."""

    g: int  # ranks per node
    m: int  # nodes
    node: int
    local: int
    node_group: object
    leader_comm: P2P | None  # the leaders' ring, counting bytes (None on non-leaders)

    @property
    def leader(self) -> int:
        return self.node * self.g

    def reset(self) -> None:
        if self.leader_comm:
            self.leader_comm.bytes_sent = self.leader_comm.messages = 0
            self.leader_comm.bytes_to = {}


def make_nodes(g: int) -> Nodes:
    """Create every node's group and the leaders' group with `dist.new_group` (a collective over
    the whole world: every rank creates every group, in the same order) and keep this rank's."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if g < 1 or n % g:
        raise ValueError(f"{g} ranks per node do not divide a world of {n}")
    m = n // g
    mine = None
    for k in range(m):
        group = dist.new_group(list(range(k * g, (k + 1) * g)))
        if rank // g == k:
            mine = group
    leaders = dist.new_group([k * g for k in range(m)])
    comm = P2P(leaders) if rank % g == 0 else None
    return Nodes(g, m, rank // g, rank % g, mine, comm)


def leader_all_reduce(x: torch.Tensor, nodes: Nodes, skip_inter: bool = False) -> torch.Tensor:
    """Sum of x over every rank, in three phases. `skip_inter=True` is the negative control:
    without the leaders' all-reduce every rank ends with its own node's sum only."""
    buf = x.detach().clone()
    dist.reduce(buf, dst=nodes.leader, group=nodes.node_group)  # 1: into the node's leader
    if nodes.leader_comm is not None and not skip_inter:
        buf = ring_all_reduce(buf, nodes.leader_comm)  # 2: across the nodes, leaders only
    dist.broadcast(buf, src=nodes.leader, group=nodes.node_group)  # 3: back to the node
    return buf


def inter_node_bytes(nodes: Nodes, rank: int) -> int:
    """Bytes this rank sent to ranks on other nodes during the leader all-reduce (counted)."""
    return off_node_bytes(nodes.leader_comm.bytes_to, rank, nodes.g) if nodes.leader_comm else 0
