"""What reached the collectives: every tensor handed to `torch.distributed`, with its dtype and bytes.

A hook that counts its own bytes counts what it meant to send. `WireTap` counts what was sent,
whoever sent it: for the duration of a `with` block it replaces `torch.distributed`'s collective
functions by wrappers that record, per call, the kind of collective, the dtype and the bytes
(`numel × element_size`) of the tensor the rank handed in, then call the original. So the dtype
of a reduction (bf16 or fp32?) is read off the tensor itself, not off a setting.

    with WireTap() as tap:
        loss.backward()                     # DDP's communication hook all-reduces in here
    tap.nbytes("all_reduce"), tap.dtypes("all_reduce")

It sees every call made through the `torch.distributed` module, from any thread: DDP's
communication hooks (the way DDP communicates once a hook is registered), torch's own hooks
including PowerSGD's collectives chained in future callbacks (they run on the communication
library's thread), and FSDP2's all-gathers and reduce-scatters. It does not see what C++ sends
directly (DDP *without* a hook all-reduces from its C++ reducer) nor functional collectives
(DTensor, torch.compile): `torch.distributed.tensor.debug.CommDebugMode` counts those.

Helper module of chapter 09 (no main guard); chapter 10 uses it to check reduce dtypes.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# function name -> (kind, the argument that holds what this rank sends)
COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "all_gather_single": ("all_gather", "input_tensor"),       # torch >= 2.14
    "all_gather_into_tensor": ("all_gather", "input_tensor"),  # older name (calls the above)
    "all_gather": ("all_gather", "tensor"),
    "all_gather_coalesced": ("all_gather", "input_tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
}


@dataclass(frozen=True)
class Sent:
    """One tensor handed to one collective."""

    kind: str
    dtype: torch.dtype
    numel: int
    nbytes: int


class WireTap:
    """Record every tensor handed to a `torch.distributed` collective while the block runs."""

    def __init__(self):
        self.sent: list[Sent] = []
        self._saved: list[tuple[object, str, object]] = []
        self._local = threading.local()  # a collective calling another one counts once

    def _wrap(self, fn, kind: str, arg: str):
        signature = inspect.signature(fn)

        def tapped(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                given = signature.bind_partial(*args, **kwargs).arguments.get(arg)
                tensors = given if isinstance(given, (list, tuple)) else [given]
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        self.sent.append(Sent(kind, t.dtype, t.numel(), t.numel() * t.element_size()))
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        return tapped

    def __enter__(self) -> WireTap:
        for name, (kind, arg) in COLLECTIVES.items():
            fn = getattr(c10d, name, None)
            if fn is None:
                continue  # a name this torch does not have
            tapped = self._wrap(fn, kind, arg)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    self._saved.append((module, name, fn))
                    setattr(module, name, tapped)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def _of(self, kind: str | None) -> list[Sent]:
        return [s for s in self.sent if kind is None or s.kind == kind]

    def nbytes(self, kind: str | None = None) -> int:
        """Bytes this rank handed to collectives (of one kind, or all)."""
        return sum(s.nbytes for s in self._of(kind))

    def calls(self, kind: str | None = None) -> int:
        """Tensors handed to collectives (of one kind, or all)."""
        return len(self._of(kind))

    def dtypes(self, kind: str | None = None) -> list[str]:
        """The dtypes that went to collectives (of one kind, or all), sorted, each once."""
        return sorted({str(s.dtype) for s in self._of(kind)})
