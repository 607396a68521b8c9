"""The collectives of chapter 05's tensor parallelism, counted: `COMM` records, per phase
(forward or backward) and operation, the calls, the elements of the whole tensor, and the bytes
of the tensor this rank handed to the collective (numel × element_size of what went in).

What a library collective puts on the wire is its own business (NCCL picks ring or tree). With
`use_ring(True)` the sums and gathers run as a ring written here with send/recv (chapter 07
writes the collectives by hand in full: rings, trees and hierarchies, for tensors of any length),
and `COMM` also records the bytes this rank's sends carried: the ring formula measured, not
assumed. Its `ring_reduce_scatter_` and `ring_all_gather_` take the same steps with the same
message sizes as chapter 07's: a copy on purpose, because chapter 05 comes first and a chapter
never imports a later one.

Tensor-parallel group = the whole world here; with a device mesh it is the mesh's TP axis
(chapter 06).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

STATS = ("calls", "elements", "bytes_in", "wire_bytes")


class CommCounter:
    """This rank's collectives by (phase, op): `calls`; `elements` of the whole tensor (the
    all-gather's output, the reduce-scatter's input); `bytes_in`, the bytes of the tensor this
    rank handed to the collective; `wire_bytes`, the bytes its sends carried (ring mode only)."""

    def __init__(self):
        self.phase = "forward"
        self.reset()

    def reset(self) -> None:
        for what in STATS:
            setattr(self, what, Counter())

    def record(self, op: str, given: torch.Tensor, whole: torch.Tensor, wire: int = 0) -> None:
        key = (self.phase, op)
        self.calls[key] += 1
        self.elements[key] += whole.numel()
        self.bytes_in[key] += given.numel() * given.element_size()
        self.wire_bytes[key] += wire

    def total(self, what: str, phase: str | None = None, op: str | None = None) -> float:
        """Sum of `what` (one of STATS) over matching phases and ops."""
        return sum(v for (p, o), v in getattr(self, what).items()
                   if phase in (None, p) and op in (None, o))


COMM = CommCounter()


class Ring:
    """Send/receive between ring neighbours (all ranks), counting the bytes this rank sends:
    the `numel × element_size` of every tensor handed to a send."""

    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.bytes_sent = 0

    def exchange(self, send_t: torch.Tensor, recv_t: torch.Tensor) -> None:
        """Send to the right neighbour while receiving from the left: every rank does both in the
        same step, so both are posted together (blocking sends could wait on each other forever),
        the receive first (under gloo over TCP a send posted first made the two directions take
        turns, as chapter 22 measures)."""
        r, n = self.rank, self.world_size
        ops = [dist.P2POp(dist.irecv, recv_t, (r - 1) % n)] if recv_t.numel() else []
        if send_t.numel():
            self.bytes_sent += send_t.numel() * send_t.element_size()
            ops.append(dist.P2POp(dist.isend, send_t, (r + 1) % n))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()


def ring_reduce_scatter_(chunks: list[torch.Tensor], ring: Ring) -> None:
    """In place, n−1 steps: at step s rank r sends chunk r−s−1 to the right and adds chunk
    r−s−2 received from the left. Afterwards chunks[r] holds the sum over all ranks."""
    r, n = ring.rank, ring.world_size
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 2) % n])
        ring.exchange(chunks[(r - s - 1) % n], incoming)
        chunks[(r - s - 2) % n] += incoming


def ring_all_gather_(chunks: list[torch.Tensor], ring: Ring) -> None:
    """In place, n−1 steps: rank r starts with chunks[r]; at step s it forwards chunk r−s to the
    right and receives chunk r−s−1 from the left. Afterwards every rank has every chunk."""
    r, n = ring.rank, ring.world_size
    for s in range(n - 1):
        ring.exchange(chunks[(r - s) % n], chunks[(r - s - 1) % n])


_RING = None  # the Ring (it counts the bytes it sends) while use_ring(True)


def use_ring(on: bool) -> None:
    """Route the sums and gathers below through the hand-written ring above (send/recv, so
    NCCL on GPUs); False returns to the library collectives."""
    global _RING
    _RING = Ring() if on else None


def _wire(before: int) -> int:
    return _RING.bytes_sent - before if _RING is not None else 0


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The sum (or max) of x over the TP ranks, in a new tensor: never reduce in place a
    tensor autograd saved."""
    given = x.contiguous().clone()
    sent = _RING.bytes_sent if _RING is not None else 0
    if _RING is not None and op == "sum":  # reduce-scatter, then all-gather: 2(t−1) steps
        flat = given.detach().reshape(-1).clone()
        chunks = list(flat.tensor_split(_RING.world_size))
        ring_reduce_scatter_(chunks, _RING)
        ring_all_gather_(chunks, _RING)
        out = flat.view_as(given)
    else:
        out = given
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    COMM.record("all_reduce", x, x, _wire(sent))
    return out


def all_gather_seq(x: torch.Tensor) -> torch.Tensor:
    """(B, S/t, h) on each rank -> (B, S, h) on every rank, ranks in order along dim 1."""
    t, x = dist.get_world_size(), x.contiguous()
    sent = _RING.bytes_sent if _RING is not None else 0
    if _RING is not None:
        B, s, h = x.shape  # the ring concatenates flat shards: rank r's (B, s, h) is block r
        flat = torch.empty(t * x.numel(), dtype=x.dtype, device=x.device)
        chunks = list(flat.split(x.numel()))
        chunks[_RING.rank].copy_(x.reshape(-1))
        ring_all_gather_(chunks, _RING)
        out = flat.view(t, B, s, h).transpose(0, 1).reshape(B, t * s, h)
    else:
        parts = [torch.empty_like(x) for _ in range(t)]
        dist.all_gather(parts, x)
        out = torch.cat(parts, dim=1)
    COMM.record("all_gather", x, out, _wire(sent))
    return out


def reduce_scatter_seq(x: torch.Tensor) -> torch.Tensor:
    """(B, S, h) partial sums on each rank -> this rank's (B, S/t, h) slice of the total."""
    t = dist.get_world_size()
    sent = _RING.bytes_sent if _RING is not None else 0
    if _RING is not None:
        B, S, h = x.shape  # lay the sequence slices out as t contiguous blocks, one per rank
        given = x.reshape(B, t, S // t, h).transpose(0, 1).contiguous()
        chunks = list(given.detach().reshape(-1).clone().tensor_split(t))
        ring_reduce_scatter_(chunks, _RING)
        out = chunks[_RING.rank].view(B, S // t, h)
    else:
        given = x.contiguous()
        out = torch.empty_like(given.chunk(t, dim=1)[0].contiguous())
        dist.reduce_scatter(out, [c.contiguous() for c in given.chunk(t, dim=1)])
    COMM.record("reduce_scatter", given, x, _wire(sent))
    return out
