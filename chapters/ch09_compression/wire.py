"""What reached the collectives: every tensor a rank handed to `torch.distributed`, with its dtype and bytes.

A hook that counts its own bytes counts what it meant to send. `WireTap` counts what was sent,
whoever sent it: for the duration of a `with` block it replaces `torch.distributed`'s collective
functions by wrappers that record, per call, the kind of collective, the dtype and the bytes
(`numel × element_size`) of the tensors this rank contributes, then call the original. So the
dtype of a reduction (bf16 or fp32?) is read off the tensor itself, not off a setting.

    with WireTap() as tap:
        loss.backward()                     # DDP's communication hook all-reduces in here
    tap.nbytes("all_reduce"), tap.dtypes("all_reduce")

What "contributes" means: the input of an all-reduce, all-gather, reduce-scatter, all-to-all,
reduce, gather or send; for a broadcast or a scatter the source's tensors, on the source only
(the other ranks only receive). A collective that calls another one (a deprecated name such as
`all_gather_into_tensor` calling `all_gather_single`, `send` calling `isend`,
`batch_isend_irecv` calling `isend`) counts once.

It sees every call made through the `torch.distributed` module, from any thread: DDP's
communication hooks (the way DDP communicates once a hook is registered), torch's own hooks
including PowerSGD's collectives chained in future callbacks (they run on the communication
library's thread), FSDP2's all-gathers and reduce-scatters, object collectives (as the byte
tensors they send). It does not see what C++ sends directly (DDP *without* a hook all-reduces
from its C++ reducer; DDP's construction broadcasts from C++ too), functional collectives
(DTensor, torch.compile: `torch.distributed.tensor.debug.CommDebugMode` counts those), nor a
reference taken before the block (`from torch.distributed import all_reduce`).

`WireTap(keep=True)` also keeps a copy of each tensor as it was handed in (`Sent.tensor`,
copied before the collective runs): what a rank put on the wire, to decode and compare with
what it should have sent (chapter 09's test of error feedback does).

The block restores every function it replaced, also when the block raises. One limitation:
a `P2POp` built inside the block and run after it holds the wrapper, which torch's
`batch_isend_irecv` no longer recognises as `isend`: build P2P ops where you run them.

Helper module of chapter 09 (no main guard); chapter 10 uses it to check reduce dtypes.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# function name -> (kind, the argument that holds what this rank contributes, the argument
# naming the source rank for collectives where only the source sends, else None)
COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor", None),
    "all_reduce_coalesced": ("all_reduce", "tensors", None),
    "all_gather_single": ("all_gather", "input_tensor", None),       # torch >= 2.14
    "all_gather_into_tensor": ("all_gather", "input_tensor", None),  # older name (calls the above)
    "_all_gather_base": ("all_gather", "input_tensor", None),        # older still
    "all_gather": ("all_gather", "tensor", None),
    "all_gather_coalesced": ("all_gather", "input_tensor_list", None),
    "reduce_scatter_single": ("reduce_scatter", "input", None),      # torch >= 2.14
    "reduce_scatter_tensor": ("reduce_scatter", "input", None),
    "_reduce_scatter_base": ("reduce_scatter", "input", None),
    "reduce_scatter": ("reduce_scatter", "input_list", None),
    "all_to_all_single": ("all_to_all", "input", None),
    "all_to_all": ("all_to_all", "input_tensor_list", None),
    "broadcast": ("broadcast", "tensor", "src"),
    "scatter": ("scatter", "scatter_list", "src"),
    "reduce": ("reduce", "tensor", None),
    "gather": ("gather", "tensor", None),
    "gather_single": ("gather", "tensor", None),
    "gather_into_tensor": ("gather", "tensor", None),
    "send": ("send", "tensor", None),
    "isend": ("send", "tensor", None),
}


@dataclass(frozen=True)
class Sent:
    """One tensor handed to one collective."""

    kind: str
    dtype: torch.dtype
    numel: int
    nbytes: int
    tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """A copy of the tensor as handed in (with `WireTap(keep=True)`), else None."""


def _is_source(bound: dict, src_arg: str) -> bool:
    """Is this rank the source of a broadcast/scatter (`src` global, or `group_src` in `group`)?"""
    group_src = bound.get(f"group_{src_arg}")
    if group_src is not None:
        return dist.get_rank(bound.get("group")) == group_src
    return dist.get_rank() == bound.get(src_arg, 0)


def _original(fn):
    """The torch function under any number of taps."""
    while hasattr(fn, "_wiretap_original"):
        fn = fn._wiretap_original
    return fn


class WireTap:
    """Record every tensor this rank hands to a `torch.distributed` collective while the block runs."""

    def __init__(self, keep: bool = False):
        self.keep = keep
        self.sent: list[Sent] = []
        self._saved: list[tuple[object, str, object]] = []
        self._local = threading.local()  # a collective calling another one counts once

    def _record(self, kind: str, tensors) -> None:
        tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                copy = t.detach().clone() if self.keep else None
                self.sent.append(Sent(kind, t.dtype, t.numel(), t.numel() * t.element_size(), copy))

    def _outermost(self, fn, record):
        """Call fn; `record()` first if no tapped collective is already running on this thread."""
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            record()
        self._local.depth = depth + 1
        try:
            return fn()
        finally:
            self._local.depth = depth

    def _wrap(self, fn, kind: str, arg: str, src_arg: str | None):
        signature = inspect.signature(fn)
        if arg not in signature.parameters:  # a renamed argument would count nothing, silently
            raise TypeError(f"WireTap: {fn.__name__} has no argument {arg!r} on this torch")

        def record(args, kwargs):
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return  # a wrong call: torch's own function raises its own error next
            if src_arg is None or _is_source(bound, src_arg):
                self._record(kind, bound.get(arg))

        @functools.wraps(fn)
        def tapped(*args, **kwargs):
            return self._outermost(lambda: fn(*args, **kwargs), lambda: record(args, kwargs))

        tapped._wiretap_original = fn
        return tapped

    def _wrap_batch(self, fn):
        """`batch_isend_irecv`: record the sends, and hand torch P2P ops whose `op` is the
        current (tapped) `isend`, which torch compares by identity."""

        @functools.wraps(fn)
        def tapped(p2p_op_list):
            isend = _original(c10d.isend)
            ops = [(op, op.op) for op in p2p_op_list]
            for op, f in ops:
                if _original(f) is isend:
                    op.op = c10d.isend
            try:
                return self._outermost(lambda: fn(p2p_op_list), lambda: self._record(
                    "send", [op.tensor for op, f in ops if _original(f) is isend]))
            finally:
                for op, f in ops:
                    op.op = f

        tapped._wiretap_original = fn
        return tapped

    def _patch(self, name: str, tapped) -> None:
        fn = getattr(c10d, name)
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                self._saved.append((module, name, fn))
                setattr(module, name, tapped)

    def __enter__(self) -> WireTap:
        if self._saved:
            raise RuntimeError("this WireTap is already active: use a new one to nest")
        try:
            for name, (kind, arg, src_arg) in COLLECTIVES.items():
                fn = getattr(c10d, name, None)
                if fn is not None:  # skip a name this torch does not have
                    self._patch(name, self._wrap(fn, kind, arg, src_arg))
            if hasattr(c10d, "batch_isend_irecv"):
                self._patch("batch_isend_irecv", self._wrap_batch(c10d.batch_isend_irecv))
        except BaseException:
            self.__exit__()  # never leave torch half patched
            raise
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

    def tensors(self, kind: str | None = None) -> list[torch.Tensor]:
        """Copies of the tensors handed to collectives (of one kind, or all), in call order."""
        if not self.keep:
            raise RuntimeError("this WireTap counts bytes only: use WireTap(keep=True)")
        return [s.tensor for s in self._of(kind)]
