"""Small collectives the chapters' checks and figures use: agree on one number across the ranks
(`reduce_number`, `broadcast_number`, `gather_numbers`, on whichever device the backend needs),
start every rank from rank 0's parameters (`broadcast_from_rank0`), list the parameters that
need a gradient (`trainable_params`), and torch's tensor all-gather and reduce-scatter under
the name each torch release has. Plumbing, not a lesson: `common.distributed` re-exports them,
so `from common.distributed import reduce_number` keeps working.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.14 renamed the tensor forms of all-gather and reduce-scatter (all_gather_into_tensor,
# reduce_scatter_tensor); older releases (2.11 on the lent GPU machines) have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def comm_device(group=None) -> torch.device:
    """Where a tensor handed to a collective must live: the current CUDA device under NCCL
    (it takes CUDA tensors only), the CPU under gloo (which runs every collective on CPU
    tensors, and only some on CUDA tensors)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _number_tensor(value) -> tuple[torch.Tensor, bool]:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"expected one number, got a tensor of shape {tuple(value.shape)}")
        is_int = not (value.is_floating_point() or value.is_complex())
        value = value.detach().item()
    else:
        is_int = isinstance(value, int)
    dtype = torch.int64 if is_int else torch.float64
    return torch.tensor([value], dtype=dtype, device=comm_device()), is_int


def _as_number(t: torch.Tensor, is_int: bool):
    return int(t.item()) if is_int else float(t.item())


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def reduce_number(value, op: str = "sum", group=None):
    """Agree on one number across the ranks: the sum, max or min of every rank's `value`
    (a Python number or a one-element tensor), returned to every rank as a Python number.
    The tensor lives on `comm_device()`, so the same call works on gloo and on NCCL.

        worst = reduce_number(max_diff, "max")      # a parity check every rank agrees on
        sent = reduce_number(bytes_sent, "sum")     # a count over the world
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, not {op!r}")
    t, is_int = _number_tensor(value)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=getattr(dist.ReduceOp, _OPS[op]), group=group)
    return _as_number(t, is_int)


def broadcast_number(value, src: int = 0, group=None):
    """Every rank gets rank `src`'s `value` (e.g. the loss the main rank computed)."""
    t, is_int = _number_tensor(value)
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(t, src=src, group=group)
    return _as_number(t, is_int)


def gather_numbers(value, group=None) -> list:
    """Every rank's `value`, in rank order, on every rank (per-rank step times, per-rank diffs)."""
    t, is_int = _number_tensor(value)
    if not (dist.is_available() and dist.is_initialized()):
        return [_as_number(t, is_int)]
    out = torch.empty(dist.get_world_size(group), dtype=t.dtype, device=t.device)
    all_gather_single(out, t, group=group)
    return [_as_number(x, is_int) for x in out]


def trainable_params(params) -> list[torch.nn.Parameter]:
    """Parameters that need a gradient, each once (tied weights are one parameter).
    (Used by the hand-written wrappers of chapters 06 and 08.)"""
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def broadcast_from_rank0(module: torch.nn.Module, group=None) -> None:
    """Every rank starts from rank 0's parameters and buffers, frozen ones too, as DDP does when
    it wraps a model (taught in chapter 08; used by chapter 06's ZeRO wrappers)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=src, group=group)
