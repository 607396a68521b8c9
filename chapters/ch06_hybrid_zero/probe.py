"""What a training step moves and holds, counted from the tensors themselves.

`StepProbe` is a `TorchDispatchMode`: while it is active, every operation PyTorch runs passes
through it, the collectives too (`torch.ops.c10d.*`: what `dist.all_reduce`, DDP's reducer,
`ZeroRedundancyOptimizer`, FSDP2 and the hand-written stages all end up calling). It records

- **volume**: for each collective, the bytes of the tensors handed to it, in the ZeRO paper's
  convention (Rajbhandari et al., 2020, section 7): a reduce-scatter or an all-gather moves the
  whole vector it reduces or assembles once (Ψ), an all-reduce twice (a reduce-scatter then an
  all-gather, 2Ψ), a broadcast once. A ring sends (N−1)/N of that from each rank.
- **peak**: before and after every operation, the bytes held in parameters, gradients,
  optimizer states, and the buffers of a collective in flight that are none of these (ZeRO-1's
  flat gradient copy, a gathered weight before it is copied in). Distinct storages are counted
  once, so views of one buffer count once and a freed storage (`resize_(0)`) counts zero.

The functional collectives that DTensor and tensor parallelism use (`torch.ops._c10d_functional.*`,
`torch.distributed._functional_collectives`) are counted too, under their own names ("funcol.
all_reduce", ...): the mode sees the functional op and not the c10d op it calls inside, so nothing
is counted twice. Point-to-point operations and gathers to one rank are listed in `uncounted`.

It sees what runs inside its `with` block on this thread and on the threads autograd runs
backward on (autograd carries the dispatch mode to its worker threads with the rest of the
thread-local state: CUDA's per-device backward threads included, by torch's source; this course
has not yet run the probe on a GPU). Tensors outside the tracked groups (activations, autograd's
buffers) are not counted: the peak is the peak of the *model states* the ZeRO formulas are
about, plus collective buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("params", "grads", "optim", "buffers")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def collective_volume(name: str, args) -> int | None:
    """Bytes of one c10d operation in the paper's convention, from its own tensor arguments;
    None for what is not a collective that moves data."""
    if name in ("allreduce_", "allreduce_coalesced_"):
        return 2 * _bytes(tree_leaves(args[0]))
    if name in ("broadcast_", "reduce_"):  # one vector, to or from one root
        return _bytes(tree_leaves(args[0]))
    if name in ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        return _bytes(tree_leaves(args[1]))  # the whole input vector
    if name in ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
                "allgather_coalesced_", "alltoall_base_", "alltoall_"):
        return _bytes(tree_leaves(args[0]))  # the whole gathered output
    return None  # barrier, send/recv, gather/scatter: listed in StepProbe.uncounted


FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd")
NOT_MOVING = ("wait_tensor", "_wrap_tensor_autograd")  # functional ops that move no data


def functional_volume(name: str, args, out) -> int | None:
    """The same convention for a functional collective (it returns a new tensor): from its
    input, or, where the input is one rank's piece (all-gather, all-to-all), from the tensor it
    returned. None for a functional operation this function does not know."""
    if name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"):
        return 2 * _bytes(tree_leaves(args[0]))
    if name in ("broadcast", "broadcast_", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        return _bytes(tree_leaves(args[0]))
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_out",
                "all_gather_into_tensor_coalesced", "all_to_all_single"):
        return _bytes(tree_leaves(out))
    return None


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def count_held(groups: dict, in_flight=()) -> dict[str, int]:
    """Bytes per category of `groups` ({"params": [...], "grads": [...], "optim": [...]}, None
    entries skipped), each storage counted once (views of one buffer, a tied weight), a freed
    one (`resize_(0)`) as zero, a DTensor as its local shard; "buffers": the storages of
    `in_flight` (a collective's tensors) that are in none of the groups."""
    seen: set[int] = set()
    held = {}
    for cat in ("params", "grads", "optim"):
        total = 0
        for t in groups.get(cat, ()):
            if t is None:
                continue
            s = _local(t).untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            total += s.nbytes()
        held[cat] = total
    extra = 0
    for t in in_flight:
        s = _local(t).untyped_storage()
        if s.nbytes() > 0 and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            extra += s.nbytes()
    held["buffers"] = extra
    return held


class StepProbe(TorchDispatchMode):
    """`with StepProbe(holdings) as probe: one training step`, then read `probe.volume`
    (bytes per collective kind), `probe.calls`, `probe.peak` (each category's own highest
    bytes during the step) and `probe.peak_total` (the highest sum, at one moment).
    `holdings()` returns {"params": [...], "grads": [...], "optim": [...]}: the tensors that
    are model states right now (None entries are skipped)."""

    def __init__(self, holdings: Callable[[], dict] | None = None):
        super().__init__()
        self.holdings = holdings
        self.volume: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.uncounted: set[str] = set()  # collectives seen whose bytes are not counted (send, ...)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0

    @property
    def total_volume(self) -> int:
        return sum(self.volume.values())

    def sample(self, in_flight=()) -> None:
        """Count what is held now; keep it if it is the largest total seen."""
        if self.holdings is None:
            return
        now = count_held(self.holdings(), in_flight)
        self.peak_total = max(self.peak_total, sum(now.values()))
        self.peak = {k: max(self.peak[k], now[k]) for k in CATEGORIES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        volume = collective_volume(name, args) if func.namespace == "c10d" else None
        if func.namespace == "c10d" and volume is None and name not in ("barrier", "check_for_nan"):
            self.uncounted.add(name)
        functional = func.namespace in FUNCTIONAL and name not in NOT_MOVING
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        collective = volume is not None or functional
        self.sample(tensors if collective else ())
        out = func(*args, **kwargs)
        if functional:
            volume = functional_volume(name, args, out)
            if volume is None:
                self.uncounted.add(f"funcol.{name}")
            name = f"funcol.{name}"
            tensors += [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if volume is not None:
            self.volume[name] = self.volume.get(name, 0) + volume
            self.calls[name] = self.calls.get(name, 0) + 1
        self.sample(tensors if collective else ())
        return out
