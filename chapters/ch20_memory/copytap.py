"""`CopyTap`: the bytes an offload moves, counted where they move.

A counter incremented by the offload code would count what the code meant to copy; this one
sits at the boundary instead: a TorchDispatchMode sees every copy operation PyTorch runs
(`aten._to_copy`, `aten.copy_`) and keeps those that read from or write into the working model.
offload.py's hand-written ZeRO-Offload is checked with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _storage(t: torch.Tensor) -> tuple[str, int]:
    return t.device.type, t.untyped_storage().data_ptr()


@dataclass(frozen=True)
class Copy:
    """One copy operation between the working model and anything else."""

    way: str  # "to host" (out of the working model) or "to device" (into it)
    nbytes: int
    src: str  # device types
    dst: str


class CopyTap(TorchDispatchMode):
    """`with CopyTap(working) as tap: ...`: every copy operation PyTorch runs in the block
    (`aten._to_copy`, what `.to()`/`.cpu()` call, and `aten.copy_`), kept when it reads from or
    writes into the working model: `working()` returns the device model's parameters and
    gradients at that moment. Out of them is "to host", into them "to device"; the bytes are
    the destination's, the devices those of the tensors themselves. A copy that is skipped, or
    a host "copy" that aliases the device tensor, is not an operation and counts nothing."""

    def __init__(self, working: Callable[[], list[torch.Tensor]]):
        super().__init__()
        self.working = working
        self.copies: list[Copy] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in ("_to_copy", "copy_"):
            src, dst = (args[0], out) if name == "_to_copy" else (args[1], args[0])
            mine = {_storage(t) for t in self.working()}
            out_of, into = _storage(src) in mine, _storage(dst) in mine
            if out_of != into:
                self.copies.append(Copy("to host" if out_of else "to device",
                                        dst.numel() * dst.element_size(), src.device.type,
                                        dst.device.type))
        return out

    def nbytes(self, way: str) -> int:
        return sum(c.nbytes for c in self.copies if c.way == way)


def working_tensors(model) -> Callable[[], list[torch.Tensor]]:
    """What the device model holds now: its parameters and the gradients it still has."""
    return lambda: [t for p in model.parameters() for t in (p, p.grad) if t is not None]


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
