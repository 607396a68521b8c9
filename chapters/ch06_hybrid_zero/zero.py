"""ZeRO stages 1, 2 and 3 written by hand, usable on any model with any `torch.optim` optimizer:
the flat layout they share and ZeRO-1 here, ZeRO-2 and ZeRO-3 in zero23.py.

All three lay the trainable parameters end to end in one flat vector of Ψ numbers, pad it to
N·⌈Ψ/N⌉ and give rank r the slice [r·S, (r+1)·S), S = ⌈Ψ/N⌉. The optimizer only ever sees that
slice, so its states are 1/N of the baseline (ZeRO-1, P_os). ZeRO-2 (P_os+g) also keeps only the
gradient slice: each gradient is reduce-scattered the moment backward produces it and then
freed. ZeRO-3 (P_os+g+p) also keeps only the parameter slice: a module's weights are
all-gathered just before its forward (and again before its backward) and freed right after.

- `ZeroOneOptimizer(params, torch.optim.Adam, lr=...)` is a `torch.optim.Optimizer`, like
  `torch.distributed.optim.ZeroRedundancyOptimizer`: parameter groups, `state_dict`,
  `zero_grad(set_to_none=...)`, `step(closure)`, LR schedulers.
- `ZeroTwo(module)` and `ZeroThree(module)` (zero23.py) wrap a module, like FSDP2's
  `fully_shard`: their `parameters()` are the flat fp32 slice, so the caller builds any optimizer on them, and the
  loop calls `reduce_gradients()` between `backward()` and `optimizer.step()`. With
  `compute_dtype=torch.bfloat16` they gather and compute in bf16, reduce gradients in fp32 and
  keep fp32 master slices (FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`).

Communication is reduce-scatter + all-gather, never all-reduce + broadcast: a reduce-scatter plus
an all-gather move what one all-reduce moves (2Ψ in the paper's convention), so stages 1 and 2
cost no more bandwidth than DDP; stage 3 gathers the weights twice, forward and backward (3Ψ).
Frozen parameters (requires_grad=False) are not sharded: every rank keeps them whole.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from chapters.ch06_hybrid_zero.probe import count_held
from common.distributed import (  # torch 2.11 and 2.14 names
    all_gather_single,
    reduce_scatter_single,
    trainable_params,
)


def shard_size(numel: int, world_size: int) -> int:
    """S = ⌈Ψ/N⌉: every rank's slice has the same length; the last one is zero-padded."""
    return math.ceil(numel / world_size)


class FlatLayout:
    """Where each parameter sits in the flat vector, and which piece of it each rank owns."""

    def __init__(self, params: list[torch.Tensor], world_size: int, rank: int):
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:  # one flat buffer has one dtype: a copy would silently convert
            raise ValueError(f"the parameters laid out in one flat buffer must share one dtype and "
                             f"device, got {sorted(map(str, kinds))}: put each kind in its own "
                             f"parameter group (ZeroOneOptimizer) or cast the module first")
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


def flatten_into_buffer(layout: FlatLayout, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Copy the parameters into one padded flat buffer (of `dtype`, default theirs) and make
    each parameter a view of it."""
    p0 = layout.params[0]
    flat = torch.zeros(layout.world_size * layout.shard, dtype=dtype or p0.dtype, device=p0.device)
    for i, p in enumerate(layout.params):
        view = flat[layout.offsets[i]:layout.offsets[i + 1]].view_as(p)
        view.copy_(p.data)
        p.data = view
    return flat


def reduce_scatter_flat(grads: list[torch.Tensor | None], layout: FlatLayout) -> torch.Tensor:
    """ZeRO-1: copy every gradient into one padded buffer, reduce-scatter it (SUM) and divide by
    N: this rank's slice of the averaged gradient. The copy is a second, transient, full
    gradient (N·S numbers) next to the gradients themselves: ZeRO-1's peak."""
    p0 = layout.params[0]
    flat = torch.zeros(layout.world_size * layout.shard, dtype=p0.dtype, device=p0.device)
    for i, g in enumerate(grads):
        if g is not None:
            flat[layout.offsets[i]:layout.offsets[i + 1]].copy_(g.reshape(-1))
    out = torch.empty(layout.shard, dtype=flat.dtype, device=flat.device)
    reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM)
    return out.div_(layout.world_size)


def all_gather_flat(flat: torch.Tensor, shard: torch.Tensor) -> None:
    """Every rank's slice to every rank, in the flat buffer's dtype: the buffer is whole again."""
    all_gather_single(flat, shard.detach().to(flat.dtype, copy=True))


class ZeroOneOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (P_os), a `torch.optim.Optimizer` shaped like `ZeroRedundancyOptimizer`:

        opt = ZeroOneOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        opt = ZeroOneOptimizer([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                               torch.optim.AdamW, lr=1e-3, weight_decay=0.1)

    Use it on local (not averaged) gradients, without DDP: `step()` reduce-scatters them,
    updates this rank's slice with `optimizer_class` and all-gathers the slices back into every
    parameter. Each parameter group gets its own flat buffer, so groups keep their own
    hyperparameters (an LR scheduler changes `param_groups[i]["lr"]` here; `step()` hands it to
    the inner optimizer). `state_dict()` is this rank's shard: save one per rank and load it into
    the same rank of the same world.

    One difference from torch's optimizers: every `step()` updates the whole slice, so a
    parameter that got no gradient on any rank is stepped with a zero gradient (torch skips a
    `None` gradient; with Adam its momentum still moves it). Freeze such a parameter
    (`requires_grad_(False)`) before building the optimizer."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], **defaults):
        self.optim = None  # the inner optimizer, over the slices; built once the groups exist
        self._flat: list[tuple[FlatLayout, torch.Tensor | None, torch.Tensor | None]] = []
        super().__init__(params, defaults)  # calls add_param_group for every group
        self.optim = optimizer_class([self._inner_group(i) for i in range(len(self._flat))],
                                     **defaults)
        # The inner optimizer's defaults (betas, momentum, ...) are ours too: schedulers that
        # cycle momentum (OneCycleLR, CyclicLR) look for them here.
        self.defaults = {**self.optim.defaults, **defaults}
        self._sync_hyperparameters(self.optim.param_groups, self.param_groups)

    def add_param_group(self, param_group: dict) -> None:
        """A new group: its own flat buffer and its own slice in the inner optimizer."""
        super().add_param_group(param_group)
        params = trainable_params(self.param_groups[-1]["params"])
        layout = FlatLayout(params, dist.get_world_size(), dist.get_rank())
        flat = shard = None
        if params:
            flat = flatten_into_buffer(layout)
            shard = flat[layout.rank * layout.shard:(layout.rank + 1) * layout.shard]  # a view
        self._flat.append((layout, flat, shard))
        if self.optim is not None:
            self.optim.add_param_group(self._inner_group(len(self._flat) - 1))
            self._sync_hyperparameters(self.optim.param_groups[-1:], self.param_groups[-1:])

    def _inner_group(self, i: int) -> dict:
        shard = self._flat[i][2]
        options = {k: v for k, v in self.param_groups[i].items() if k != "params"}
        return {"params": [] if shard is None else [shard], **options}

    @staticmethod
    def _sync_hyperparameters(src: list[dict], dst: list[dict]) -> None:
        for a, b in zip(src, dst):
            b.update({k: v for k, v in a.items() if k != "params"})

    def slices(self) -> list[torch.Tensor]:
        """This rank's slice of each group's flat parameter buffer (views)."""
        return [shard for _, _, shard in self._flat if shard is not None]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters(self.param_groups, self.optim.param_groups)  # e.g. a new lr
        for layout, _, shard in self._flat:
            if shard is not None:
                shard.grad = reduce_scatter_flat([p.grad for p in layout.params], layout)
        self.optim.step()
        self._sync_hyperparameters(self.optim.param_groups, self.param_groups)
        for _, flat, shard in self._flat:
            if shard is not None:
                shard.grad = None  # transient: 1/N of the gradient
                all_gather_flat(flat, shard)
        return loss

    def state_dict(self) -> dict:
        """The groups' hyperparameters (as any optimizer's) and this rank's inner state."""
        state = super().state_dict()
        state["zero"] = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                         "numel": [layout.numel for layout, _, _ in self._flat],
                         "inner": self.optim.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        zero = state_dict["zero"]
        here = (dist.get_rank(), dist.get_world_size(), [layout.numel for layout, _, _ in self._flat])
        if (zero["rank"], zero["world_size"], zero["numel"]) != here:
            raise ValueError(f"this state was saved by rank {zero['rank']} of {zero['world_size']} "
                             f"for groups of {zero['numel']} numbers; this is rank {here[0]} of "
                             f"{here[1]} with {here[2]}")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zero"})
        self.optim.load_state_dict(zero["inner"])
        self._sync_hyperparameters(self.param_groups, self.optim.param_groups)


def model_states(model: nn.Module, optimizer=None) -> dict[str, list]:
    """The tensors one rank holds as model states, by category, whatever the wrapper: a ZeRO-2/3
    module's `states()`, or a module's parameters and gradients; the optimizer's state tensors
    (through a ZeRO-1 or ZeroRedundancyOptimizer wrapper to the optimizer inside)."""
    if hasattr(model, "states"):
        groups = model.states()
    else:
        params = list(model.parameters())
        groups = {"params": params, "grads": [p.grad for p in params]}
    if optimizer is not None:
        if isinstance(optimizer, ZeroOneOptimizer):
            groups["grads"] = groups["grads"] + [s.grad for s in optimizer.slices()]
        inner = getattr(optimizer, "optim", optimizer)
        groups["optim"] = [v for s in inner.state.values() for v in s.values()
                           if isinstance(v, torch.Tensor)]
    return groups


def bytes_held(model: nn.Module, optimizer) -> dict[str, int]:
    """What one rank holds right now for parameters, gradients and optimizer states, counted
    from the tensors' storages (views of one buffer count once; a DTensor counts its shard)."""
    held = count_held(model_states(model, optimizer))
    return {k: held[k] for k in ("params", "grads", "optim")}
