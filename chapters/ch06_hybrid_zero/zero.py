"""ZeRO stages 1, 2 and 3 written by hand, reusable on any model and any `torch.optim` optimizer.

All three lay the trainable parameters end to end in one flat vector of Ψ numbers, pad it to
N·⌈Ψ/N⌉ and give rank r the slice [r·S, (r+1)·S), S = ⌈Ψ/N⌉. The inner optimizer only ever sees
that slice, so its states are 1/N of the baseline (ZeRO-1, P_os). ZeRO-2 (P_os+g) also keeps
only the gradient slice: each gradient is reduce-scattered the moment backward produces it and
then freed. ZeRO-3 (P_os+g+p) also keeps only the parameter slice: a layer's weights are
all-gathered just before its forward (and again before its backward) and freed right after.

Communication is reduce-scatter + all-gather, never all-reduce + broadcast: a ring reduce-scatter
plus a ring all-gather move exactly what one ring all-reduce moves (2·(N−1)/N·Ψ per rank), so
stages 1 and 2 cost no more bandwidth than DDP; stage 3 adds one more all-gather (3·(N−1)/N·Ψ).
Frozen parameters (requires_grad=False) are not sharded: every rank keeps them whole.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from common.distributed import all_gather_single, reduce_scatter_single  # torch 2.11 and 2.14 names


def shard_size(numel: int, world_size: int) -> int:
    """S = ⌈Ψ/N⌉: every rank's slice has the same length; the last one is zero-padded."""
    return math.ceil(numel / world_size)


def trainable_params(params) -> list[nn.Parameter]:
    """Parameters that need a gradient, each once (tied weights are one parameter)."""
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class FlatLayout:
    """Where each parameter sits in the flat vector, and which piece of it each rank owns."""

    def __init__(self, params: list[torch.Tensor], world_size: int, rank: int):
        self.params, self.world_size, self.rank = params, world_size, rank
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.shard = shard_size(self.numel, world_size)

    def pieces(self, i: int) -> list[tuple[int, int]]:
        """For parameter i, the (start, end) of each rank's piece in the parameter's own flat
        coordinates; a rank whose slice misses the parameter gets an empty piece."""
        a, b = self.offsets[i], self.offsets[i + 1]
        out = []
        for r in range(self.world_size):
            lo, hi = max(a, r * self.shard), min(b, (r + 1) * self.shard)
            out.append((lo - a, hi - a) if hi > lo else (0, 0))
        return out

    def my_range(self, i: int) -> tuple[int, int]:
        """Parameter i's piece owned by this rank, in this rank's shard coordinates."""
        lo, hi = self.pieces(i)[self.rank]
        start = self.offsets[i] + lo - self.rank * self.shard
        return start, start + hi - lo


def broadcast_from_rank0(module: nn.Module) -> None:
    """Every rank starts from rank 0's weights (as DDP does when it wraps a model)."""
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=0)


def flatten_into_buffer(layout: FlatLayout) -> torch.Tensor:
    """Copy the parameters into one padded flat buffer and make each parameter a view of it."""
    p0 = layout.params[0]
    flat = torch.zeros(layout.world_size * layout.shard, dtype=p0.dtype, device=p0.device)
    for i, p in enumerate(layout.params):
        view = flat[layout.offsets[i]:layout.offsets[i + 1]].view_as(p)
        view.copy_(p.data)
        p.data = view
    return flat


def reduce_scatter_flat(grads: list[torch.Tensor | None], layout: FlatLayout) -> torch.Tensor:
    """ZeRO-1: concatenate every gradient into one padded buffer, reduce-scatter it (SUM),
    and divide by N: this rank's slice of the averaged gradient."""
    p0 = layout.params[0]
    flat = torch.zeros(layout.world_size * layout.shard, dtype=p0.dtype, device=p0.device)
    for i, g in enumerate(grads):
        if g is not None:
            flat[layout.offsets[i]:layout.offsets[i + 1]].copy_(g.reshape(-1))
    out = torch.empty(layout.shard, dtype=flat.dtype, device=flat.device)
    reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM)
    return out.div_(layout.world_size)


def reduce_scatter_param_grad(grad: torch.Tensor, i: int, layout: FlatLayout,
                              grad_shard: torch.Tensor) -> None:
    """ZeRO-2/3: reduce-scatter one parameter's gradient by owner and add this rank's piece
    (summed over the ranks) into its gradient slice. Pieces are uneven, some empty: the list
    form of reduce_scatter takes that."""
    flat = grad.reshape(-1)
    pieces = [flat[lo:hi].contiguous() for lo, hi in layout.pieces(i)]
    start, end = layout.my_range(i)
    mine = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter(mine, pieces, op=dist.ReduceOp.SUM)
    grad_shard[start:end] += mine


def all_gather_flat(flat: torch.Tensor, shard: torch.Tensor) -> None:
    """Every rank's updated slice to every rank: the padded flat buffer is whole again."""
    all_gather_single(flat, shard.detach().clone())


class ZeroOneOptimizer:
    """ZeRO-1 (P_os): `ZeroOneOptimizer(params, torch.optim.Adam, lr=...)`, the shape of
    `torch.distributed.optim.ZeroRedundancyOptimizer`. Call it on local (not averaged)
    gradients: `step()` reduce-scatters them, updates this rank's slice with the inner
    optimizer and all-gathers the slices back into every parameter."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], **kwargs):
        self.layout = FlatLayout(trainable_params(params), dist.get_world_size(), dist.get_rank())
        self.flat = flatten_into_buffer(self.layout)
        r, S = self.layout.rank, self.layout.shard
        self.shard_param = self.flat[r * S:(r + 1) * S]  # a view: no second copy of the weights
        self.grad_shard = None
        self.optim = optimizer_class([self.shard_param], **kwargs)

    def zero_grad(self) -> None:
        for p in self.layout.params:
            p.grad = None

    def step(self) -> None:
        self.grad_shard = reduce_scatter_flat([p.grad for p in self.layout.params], self.layout)
        self.shard_param.grad = self.grad_shard
        self.optim.step()
        self.shard_param.grad = self.grad_shard = None  # transient: only 1/N of it anyway
        all_gather_flat(self.flat, self.shard_param)


class ZeroTwo(nn.Module):
    """ZeRO-2 (P_os+g): wrap any module; gradients are reduce-scattered as backward produces
    them (a post-accumulate-grad hook per parameter) and freed, so a rank keeps only the
    gradient slice it updates. `step()` updates the slice and all-gathers the parameters."""

    def __init__(self, module: nn.Module, optimizer_class: type[torch.optim.Optimizer], **kwargs):
        super().__init__()
        self.module = module
        broadcast_from_rank0(module)
        self.layout = FlatLayout(trainable_params(module.parameters()),
                                 dist.get_world_size(), dist.get_rank())
        self.flat = flatten_into_buffer(self.layout)
        r, S = self.layout.rank, self.layout.shard
        self.shard_param = self.flat[r * S:(r + 1) * S]
        self.grad_shard = torch.zeros_like(self.shard_param)
        self.optim = optimizer_class([self.shard_param], **kwargs)
        for i, p in enumerate(self.layout.params):
            p.register_post_accumulate_grad_hook(self._grad_ready(i))

    def _grad_ready(self, i: int):
        def hook(p: torch.Tensor) -> None:
            reduce_scatter_param_grad(p.grad, i, self.layout, self.grad_shard)
            p.grad = None  # the full gradient is gone as soon as it is reduced
        return hook

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_shard.zero_()

    def step(self) -> None:
        self.shard_param.grad = self.grad_shard / self.layout.world_size
        self.optim.step()
        self.shard_param.grad = None
        all_gather_flat(self.flat, self.shard_param)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}


def _free(p: torch.Tensor) -> None:
    p.untyped_storage().resize_(0)


class ZeroThree(ZeroTwo):
    """ZeRO-3 (P_os+g+p): as ZeRO-2, and the parameters themselves are sharded. Every module
    that owns parameters all-gathers them in a forward pre-hook, frees them after its forward,
    gathers them again when the gradient of its output arrives (before its backward needs
    them), and frees them once their gradients are reduce-scattered."""

    def __init__(self, module: nn.Module, optimizer_class: type[torch.optim.Optimizer], **kwargs):
        nn.Module.__init__(self)
        self.module = module
        broadcast_from_rank0(module)
        self.layout = FlatLayout(trainable_params(module.parameters()),
                                 dist.get_world_size(), dist.get_rank())
        r, S = self.layout.rank, self.layout.shard
        flat = flatten_into_buffer(self.layout)
        self.shard_param = flat[r * S:(r + 1) * S].clone()  # the only copy a rank keeps
        for p in self.layout.params:
            p.data = p.data.clone()  # own storage again, so each can be freed on its own
            _free(p)
        del flat
        self.index = {id(p): i for i, p in enumerate(self.layout.params)}
        self.grad_shard = torch.zeros_like(self.shard_param)
        self.optim = optimizer_class([self.shard_param], **kwargs)
        for i, p in enumerate(self.layout.params):
            p.register_post_accumulate_grad_hook(self._grad_ready(i))
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) in self.index]
            if own:
                m.register_forward_pre_hook(lambda _m, _a, own=own: self.gather(own))
                m.register_forward_hook(lambda _m, _a, out, own=own: self._after_forward(own, out))

    def gather(self, params: list[torch.Tensor]) -> None:
        """All-gather whole parameters from every rank's slice. The pieces are uneven, which
        gloo's all_gather refuses, so it is an all_to_all_single that sends my piece to all."""
        for p in params:
            if p.untyped_storage().nbytes() > 0:
                continue  # already whole (a tied weight used twice)
            i = self.index[id(p)]
            sizes = [hi - lo for lo, hi in self.layout.pieces(i)]
            start, end = self.layout.my_range(i)
            mine = self.shard_param.detach()[start:end]
            full = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
            dist.all_to_all_single(full, mine.repeat(self.layout.world_size),
                                   output_split_sizes=sizes,
                                   input_split_sizes=[end - start] * self.layout.world_size)
            p.untyped_storage().resize_(p.numel() * p.element_size())
            p.data.view(-1).copy_(full)

    def _after_forward(self, params: list[torch.Tensor], output) -> None:
        for p in params:
            _free(p)
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, params=params: self.gather(params))

    def _grad_ready(self, i: int):
        def hook(p: torch.Tensor) -> None:
            reduce_scatter_param_grad(p.grad, i, self.layout, self.grad_shard)
            p.grad = None
            _free(p)
        return hook

    def step(self) -> None:
        self.shard_param.grad = self.grad_shard / self.layout.world_size
        self.optim.step()
        self.shard_param.grad = None  # no all-gather: the next forward gathers what it needs
        for p in self.layout.params:
            _free(p)  # a parameter that got no gradient this step

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Whole parameters on every rank (for checks and checkpoints)."""
        S, N = self.layout.shard, self.layout.world_size
        flat = torch.empty(N * S, dtype=self.shard_param.dtype, device=self.shard_param.device)
        all_gather_flat(flat, self.shard_param)
        out = {}
        for name, p in self.module.named_parameters():
            if id(p) in self.index:
                i = self.index[id(p)]
                out[name] = flat[self.layout.offsets[i]:self.layout.offsets[i + 1]].view(p.shape).clone()
            else:
                out[name] = p.detach().clone()
        return out


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once;
    a DTensor counts its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        if s.data_ptr() in seen and s.nbytes() > 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def bytes_held(model: nn.Module, optimizer) -> dict[str, int]:
    """What one rank holds for parameters, gradients and optimizer states, counted from the
    tensors themselves. `optimizer` is a torch optimizer or one of the ZeRO wrappers above."""
    inner = getattr(optimizer, "optim", optimizer)
    params = list(model.parameters())
    extra_p = [getattr(optimizer, "shard_param", None)]
    grads = [p.grad for p in params] + [getattr(optimizer, "grad_shard", None)]
    states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": _storage_bytes(params + extra_p), "grads": _storage_bytes(grads),
            "optim": _storage_bytes(states)}
