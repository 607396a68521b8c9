"""Collectives written by hand with point-to-point messages (chapter 07's subject).

Ring all-reduce = ring reduce-scatter + ring all-gather; a binary-tree all-reduce; a naive
gather-to-one all-reduce for contrast. Every message goes through `P2P`, which counts the bytes
this rank sends, so the lesson's byte formulas are checked against what was really sent.
Tensors of any length work: `tensor_split` cuts n chunks whose sizes differ by at most one
(possibly zero), and every rank knows every chunk's size, so empty messages are skipped on
both sides consistently.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.distributed import all_gather_single, reduce_scatter_single

# The library's tensor forms, under torch 2.14's names (all_gather_into_tensor and
# reduce_scatter_tensor before); common.distributed picks whichever this torch has.
library_all_gather = all_gather_single
library_reduce_scatter = reduce_scatter_single


class P2P:
    """send / recv / exchange through torch.distributed, counting what this rank sends."""

    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.bytes_sent = 0
        self.messages = 0

    def _count(self, t: torch.Tensor) -> None:
        self.bytes_sent += t.numel() * t.element_size()
        self.messages += 1

    def send(self, t: torch.Tensor, dst: int) -> None:
        if t.numel():
            self._count(t)
            dist.send(t, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        if t.numel():
            dist.recv(t, src)

    def exchange(self, send_t: torch.Tensor, dst: int, recv_t: torch.Tensor, src: int) -> None:
        """Send to `dst` and receive from `src` at the same time. In a ring every rank sends
        before it receives: blocking sends would wait on each other forever (for messages too
        large for the transport's buffers), so both are posted together and then awaited."""
        ops = []
        if send_t.numel():
            self._count(send_t)
            ops.append(dist.P2POp(dist.isend, send_t, dst))
        if recv_t.numel():
            ops.append(dist.P2POp(dist.irecv, recv_t, src))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


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


def ring_schedule(n: int) -> list[list[tuple[int, int]]]:
    """(chunk sent, chunk received) by each rank at each of the 2(n−1) steps of ring all-reduce."""
    rs = [[((r - s - 1) % n, (r - s - 2) % n) for r in range(n)] for s in range(n - 1)]
    ag = [[((r - s) % n, (r - s - 1) % n) for r in range(n)] for s in range(n - 1)]
    return rs + ag
