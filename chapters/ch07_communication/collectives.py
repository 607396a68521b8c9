"""Collectives written by hand with point-to-point messages (chapter 07's subject).

Ring all-reduce = ring reduce-scatter + ring all-gather; a binary-tree all-reduce; a naive
gather-to-one all-reduce for contrast; a hierarchical all-reduce (reduce-scatter inside each
node, all-reduce across nodes, all-gather inside each node) on two levels of subgroups. Every
message goes through `P2P`, which counts the bytes this rank sends (the `numel × element_size`
of the tensor handed to send), per destination, so the lesson's byte formulas are checked
against what was really sent. Tensors of any length work: `tensor_split` cuts n chunks whose
sizes differ by at most one (possibly zero), and every rank knows every chunk's size, so empty
messages are skipped on both sides consistently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.distributed import all_gather_single, comm_device, reduce_scatter_single

# The library's tensor forms, under torch 2.14's names (all_gather_into_tensor and
# reduce_scatter_tensor before); common.distributed picks whichever this torch has.
library_all_gather = all_gather_single
library_reduce_scatter = reduce_scatter_single


class P2P:
    """send / recv / exchange among the ranks of `group` (default: all), counting what this
    rank sends. `rank` and `world_size` are positions in the group; `peer(i)` is the global rank
    of the group's i-th member, which is what torch.distributed's send/recv take."""

    def __init__(self, group=None):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        self.rank, self.world_size = self.ranks.index(dist.get_rank()), len(self.ranks)
        self.bytes_sent = 0
        self.messages = 0
        self.bytes_to: dict[int, int] = {}  # global destination rank -> bytes sent to it

    def peer(self, i: int) -> int:
        return self.ranks[i]

    def _count(self, t: torch.Tensor, dst: int) -> None:
        nbytes = t.numel() * t.element_size()
        self.bytes_sent += nbytes
        self.messages += 1
        self.bytes_to[self.peer(dst)] = self.bytes_to.get(self.peer(dst), 0) + nbytes

    def send(self, t: torch.Tensor, dst: int) -> None:
        if t.numel():
            self._count(t, dst)
            dist.send(t, self.peer(dst), group=self.group)

    def recv(self, t: torch.Tensor, src: int) -> None:
        if t.numel():
            dist.recv(t, self.peer(src), group=self.group)

    def exchange(self, send_t: torch.Tensor, dst: int, recv_t: torch.Tensor, src: int) -> None:
        """Send to `dst` and receive from `src` at the same time. In a ring every rank sends
        and receives in the same step: blocking sends would wait on each other forever (for
        messages too large for the transport's buffers), so both are posted together and then
        awaited. The receive is posted first: under gloo over TCP, posting the `isend` before
        the `irecv` made the two directions of a ring step run one after the other (~2× bytes
        ÷ rate between two shaped network namespaces, against 1.1× with the receive first;
        measured in chapter 22)."""
        ops = []
        if recv_t.numel():
            ops.append(dist.P2POp(dist.irecv, recv_t, self.peer(src), self.group))
        if send_t.numel():
            self._count(send_t, dst)
            ops.append(dist.P2POp(dist.isend, send_t, self.peer(dst), self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # NCCL: the current stream waits; the += that follows is queued after


def ring_reduce_scatter_(chunks: list[torch.Tensor], comm: P2P) -> None:
    """In place, n−1 steps: at step s rank r sends chunk r−s−1 to its right neighbour and adds
    chunk r−s−2 received from its left. Afterwards chunks[r] holds the sum over all ranks."""
    r, n = comm.rank, comm.world_size
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_c, recv_c = (r - s - 1) % n, (r - s - 2) % n
        incoming = torch.empty_like(chunks[recv_c])
        comm.exchange(chunks[send_c], right, incoming, left)
        chunks[recv_c] += incoming


def ring_all_gather_(chunks: list[torch.Tensor], comm: P2P) -> None:
    """In place, n−1 steps: rank r starts with chunks[r]; at step s it forwards chunk r−s to
    the right and receives chunk r−s−1 from the left. Afterwards every rank has every chunk."""
    r, n = comm.rank, comm.world_size
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n
        comm.exchange(chunks[send_c], right, chunks[recv_c], left)


def ring_all_reduce(x: torch.Tensor, comm: P2P) -> torch.Tensor:
    """Sum of x over all ranks: reduce-scatter then all-gather, 2(n−1) steps of one chunk."""
    flat = x.detach().reshape(-1).clone()
    chunks = list(flat.tensor_split(comm.world_size))
    ring_reduce_scatter_(chunks, comm)
    ring_all_gather_(chunks, comm)
    return flat.view_as(x)


def ring_reduce_scatter(x: torch.Tensor, comm: P2P) -> torch.Tensor:
    """This rank's chunk (x.tensor_split(n)[rank]) of the sum of x over all ranks."""
    chunks = list(x.detach().reshape(-1).clone().tensor_split(comm.world_size))
    ring_reduce_scatter_(chunks, comm)
    return chunks[comm.rank]


def ring_all_gather(shard: torch.Tensor, comm: P2P, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenation of every rank's 1-D shard, in rank order; `sizes` lists each rank's
    length when they differ (the library's all-gather needs equal shards)."""
    sizes = sizes or [shard.numel()] * comm.world_size
    out = torch.empty(sum(sizes), dtype=shard.dtype, device=shard.device)
    chunks = list(out.split(sizes))
    chunks[comm.rank].copy_(shard.reshape(-1))
    ring_all_gather_(chunks, comm)
    return out


def tree_all_reduce(x: torch.Tensor, comm: P2P) -> torch.Tensor:
    """Binary tree rooted at rank 0 (children 2r+1, 2r+2): sum up the tree, then send the
    total back down. 2·⌈log2(n+1)−1⌉ rounds instead of the ring's 2(n−1), but every message
    is the whole tensor."""
    r, n = comm.rank, comm.world_size
    buf = x.detach().clone(memory_format=torch.contiguous_format)
    children = [c for c in (2 * r + 1, 2 * r + 2) if c < n]
    incoming = torch.empty_like(buf)
    for c in children:
        comm.recv(incoming, c)
        buf += incoming
    if r != 0:
        parent = (r - 1) // 2
        comm.send(buf, parent)
        comm.recv(buf, parent)
    for c in children:
        comm.send(buf, c)
    return buf


def naive_all_reduce(x: torch.Tensor, comm: P2P) -> torch.Tensor:
    """Everyone sends everything to rank 0, which adds and sends the total back:
    rank 0 sends (n−1)·S bytes, serially, and its link is the bottleneck."""
    r, n = comm.rank, comm.world_size
    buf = x.detach().clone(memory_format=torch.contiguous_format)
    if r == 0:
        incoming = torch.empty_like(buf)
        for src in range(1, n):
            comm.recv(incoming, src)
            buf += incoming
        for dst in range(1, n):
            comm.send(buf, dst)
    else:
        comm.send(buf, 0)
        comm.recv(buf, 0)
    return buf


@dataclass
class Levels:
    """The two levels of a hierarchical all-reduce, as seen by one rank: `intra` connects the
    ranks of its node, `inter` the ranks with the same local index on every node (one per node,
    the "rail" its NIC serves on a real cluster). Each has its own byte counter."""

    ranks_per_node: int
    intra: P2P
    inter: P2P

    def reset(self) -> None:
        for comm in (self.intra, self.inter):
            comm.bytes_sent = comm.messages = 0
            comm.bytes_to = {}


def node_levels(ranks_per_node: int) -> Levels:
    """Subgroups for nodes of `ranks_per_node` consecutive ranks (node k holds ranks
    k·g … k·g+g−1). Every rank creates every group, in the same order (new_group is a
    collective over the whole world), and keeps the two it belongs to.

    Each group's first call is a one-element all-reduce made by all its members: with NCCL the
    first call in a group creates its communicator, and `batch_isend_irecv` must then be called
    by every rank of the group, which a ring step whose chunks are empty on some ranks is not."""
    n, g = dist.get_world_size(), ranks_per_node
    if g < 1 or n % g:
        raise ValueError(f"{g} ranks per node do not divide a world of {n}")
    nodes = [list(range(k * g, (k + 1) * g)) for k in range(n // g)]
    rails = [list(range(j, n, g)) for j in range(g)]
    intra, _ = dist.new_subgroups_by_enumeration(nodes)
    inter, _ = dist.new_subgroups_by_enumeration(rails)
    for group in (intra, inter):
        dist.all_reduce(torch.zeros(1, device=comm_device(group)), group=group)
    return Levels(g, P2P(intra), P2P(inter))


def hierarchical_all_reduce(x: torch.Tensor, levels: Levels) -> torch.Tensor:
    """Sum over all ranks in three phases: ring reduce-scatter inside the node (rank with local
    index l now holds chunk l of its node's sum), ring all-reduce of that chunk across the nodes
    (among the ranks with local index l), ring all-gather inside the node. Only S/g per rank
    crosses between nodes, instead of the flat ring's 2(n−1)/n·S on the ranks at node borders."""
    flat = x.detach().reshape(-1).clone()
    chunks = list(flat.tensor_split(levels.intra.world_size))
    ring_reduce_scatter_(chunks, levels.intra)
    mine = list(chunks[levels.intra.rank].tensor_split(levels.inter.world_size))  # views
    ring_reduce_scatter_(mine, levels.inter)
    ring_all_gather_(mine, levels.inter)
    ring_all_gather_(chunks, levels.intra)
    return flat.view_as(x)


def hand_all_reduces(comm: P2P, levels: Levels) -> dict:
    """{name: x -> sum of x over the ranks} for every hand-written all-reduce."""
    return {"ring": lambda x: ring_all_reduce(x, comm), "tree": lambda x: tree_all_reduce(x, comm),
            "naive": lambda x: naive_all_reduce(x, comm),
            "hier": lambda x: hierarchical_all_reduce(x, levels)}


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Sizes `tensor_split` gives: the first numel % n chunks one element longer."""
    return [numel // n + (1 if i < numel % n else 0) for i in range(n)]


def expected_bytes_sent(algorithm: str, numel: int, n: int, rank: int, elem: int) -> int:
    """Bytes rank `rank` sends in one all-reduce of `numel` elements of `elem` bytes.

    ring: every chunk but its own in reduce-scatter, every chunk but its right neighbour's in
    all-gather: elem·(2·numel − c_r − c_{r+1}); = 2(n−1)/n·S when n divides numel.
    tree: the whole tensor up to the parent and down to each child. naive: S, or (n−1)·S on rank 0.
    """
    size = numel * elem
    if n == 1:
        return 0
    if algorithm == "ring":
        c = chunk_sizes(numel, n)
        return elem * (2 * numel - c[rank] - c[(rank + 1) % n])
    if algorithm == "tree":
        children = sum(1 for child in (2 * rank + 1, 2 * rank + 2) if child < n)
        return size * (children + (rank != 0))
    if algorithm == "naive":
        return size * (n - 1) if rank == 0 else size
    raise ValueError(f"unknown algorithm {algorithm!r}")


def expected_hierarchical_bytes(numel: int, n: int, ranks_per_node: int, rank: int,
                                elem: int) -> tuple[int, int]:
    """(intra-node, inter-node) bytes rank `rank` sends in one hierarchical all-reduce: a ring
    over the g ranks of its node on the whole tensor, and a ring over the n/g nodes on its chunk
    (chunk l of the tensor cut in g, l its local index)."""
    g = ranks_per_node
    local, node = rank % g, rank // g
    intra = expected_bytes_sent("ring", numel, g, local, elem)
    inter = expected_bytes_sent("ring", chunk_sizes(numel, g)[local], n // g, node, elem)
    return intra, inter


def off_node_bytes(bytes_to: dict[int, int], rank: int, ranks_per_node: int) -> int:
    """Bytes this rank sent to ranks on other nodes (nodes of `ranks_per_node` consecutive ranks)."""
    return sum(b for dst, b in bytes_to.items() if dst // ranks_per_node != rank // ranks_per_node)


def ring_schedule(n: int) -> list[list[tuple[int, int]]]:
    """(chunk sent, chunk received) by each rank at each of the 2(n−1) steps of ring all-reduce."""
    rs = [[((r - s - 1) % n, (r - s - 2) % n) for r in range(n)] for s in range(n - 1)]
    ag = [[((r - s) % n, (r - s - 1) % n) for r in range(n)] for s in range(n - 1)]
    return rs + ag
