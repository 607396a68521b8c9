"""Pushing the trainer's weights to the generator ranks: in full (one broadcast of every
element) or as a delta (the indices and new values of the elements that changed since the last
sync), each push verified by a checksum of the result so that a delta that lost an element is
rejected instead of silently leaving a generator on weights nobody trained.

The weights travel as one flat vector (`flatten`/`unflatten_into`), the way inference engines
receive them in buckets. Every tensor handed to a collective lives on the communication device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

TRAINER = 0  # the rank that trains; every other rank generates (disaggregated placement)
HEADER = 2  # int64 numbers before a delta: how many elements changed, checksum of the result


def flatten(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, in order, as one contiguous vector (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def unflatten_into(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector back into the parameters (the inverse of `flatten`, bit for bit)."""
    torch.nn.utils.vector_to_parameters(flat.to(next(model.parameters()).dtype), model.parameters())


def bits(flat: torch.Tensor) -> torch.Tensor:
    """The raw bits of each element as an integer tensor: equality here is bitwise equality
    (-0.0 and 0.0 differ, a NaN equals itself)."""
    return flat.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[flat.element_size()])


def checksum(flat: torch.Tensor) -> torch.Tensor:
    """Σ_i (i + 1) · bits_i as int64 (wrapping): any change of one element changes it, since
    0 < |Δbits · (i + 1)| < 2^64; the order of the sum does not matter (integer arithmetic)."""
    b = bits(flat).to(torch.int64)
    return (b * torch.arange(1, len(b) + 1, device=b.device, dtype=torch.int64)).sum()


@dataclass
class SyncStats:
    """What the pushes cost and how they ended, counted from the tensors handed to broadcast."""

    full_bytes: int = 0
    delta_bytes: int = 0
    syncs: int = 0
    rejected: int = 0
    changed: list = field(default_factory=list)  # elements changed per delta

    def sent(self, kind: str, *tensors: torch.Tensor) -> None:
        n = sum(t.numel() * t.element_size() for t in tensors)
        if kind == "full":
            self.full_bytes += n
        else:
            self.delta_bytes += n


def full_sync(flat: torch.Tensor, stats: SyncStats, group=None) -> None:
    """Broadcast every element of the trainer's vector into each generator's `flat` (in place)."""
    dist.broadcast(flat, src=TRAINER, group=group)
    stats.sent("full", flat)


def changed_elements(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Indices where `new` and `old` differ bitwise (a weight that moved by less than its last
    bit did not change, so it is not sent)."""
    return (bits(new) != bits(old)).nonzero().squeeze(1)


def delta_sync(flat: torch.Tensor, stats: SyncStats, new: torch.Tensor | None = None,
               drop: int = 0, group=None) -> bool:
    """Send only what changed. On the trainer `flat` is the generators' current vector (the last
    one pushed) and `new` the vector to push; `flat` becomes `new`. On a generator `flat` is
    updated in place and verified against the trainer's checksum. `drop` (the negative control)
    leaves that many changed elements out. Returns whether the result matched the checksum."""
    is_trainer = dist.get_rank(group) == TRAINER
    header = torch.zeros(HEADER, dtype=torch.int64, device=flat.device)
    if is_trainer:
        idx = changed_elements(new, flat)
        header[0], header[1] = len(idx) - min(drop, len(idx)), checksum(new)
        idx = idx[min(drop, len(idx)):]
    dist.broadcast(header, src=TRAINER, group=group)
    n = int(header[0].item())
    if not is_trainer:
        idx = torch.empty(n, dtype=torch.int64, device=flat.device)
    values = flat.new_empty(n) if not is_trainer else new[idx]
    dist.broadcast(idx, src=TRAINER, group=group)
    dist.broadcast(values, src=TRAINER, group=group)
    stats.sent("delta", header, idx, values)
    stats.changed.append(n)
    if is_trainer:
        flat.copy_(new)
        return True
    flat[idx] = values
    ok = bool(checksum(flat) == header[1])
    if not ok:
        stats.rejected += 1
    return ok


def push(flat: torch.Tensor, how: str, stats: SyncStats, new: torch.Tensor | None = None,
         drop: int = 0, group=None) -> bool:
    """One sync, `how` = full or delta. A rejected delta is followed by a full push, so the
    generators never run on wrong weights. Returns whether the first attempt was accepted,
    agreed by every rank."""
    stats.syncs += 1
    if how == "full":
        if dist.get_rank(group) == TRAINER:
            flat.copy_(new)
        full_sync(flat, stats, group)
        return True
    ok = delta_sync(flat, stats, new, drop, group)
    agreed = torch.tensor([int(ok)], device=flat.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not agreed.item():
        full_sync(flat, stats, group)
    return bool(agreed.item())


def delta_bytes_formula(changed: int, flat: torch.Tensor) -> int:
    """Bytes of one delta: the int64 header, an int64 index and a value per changed element."""
    return 8 * HEADER + changed * (8 + flat.element_size())
