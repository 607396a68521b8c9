"""Activation recomputation, by hand and with torch.utils.checkpoint, and two ways to count what
autograd keeps for backward, and the matmul FLOP ratio of recomputation (`recompute_flop_ratio`,
which chapter 30 takes). Helpers for chapter 20's train.py and offload.py; no main guard.

Strategies for one residual feed-forward block y = x + W2·gelu(W1·x + b1) + b2:
  none             autograd saves x, h = W1·x + b1 and g = gelu(h)
  selective        keep the matmul output h, recompute the cheap gelu in backward (hand-written)
  full             keep only the block input x, recompute the whole block in backward (hand-written)
  torch_full       torch.utils.checkpoint.checkpoint(use_reentrant=False)
  torch_selective  the same with create_selective_checkpoint_contexts: save every mm/addmm output
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

STRATEGIES = ("none", "selective", "full", "torch_full", "torch_selective")
# Strategies whose backward reruns the forward's own ops on the same inputs and then runs
# autograd's own backward: the same computation as no recomputation, so on one machine their
# gradients are bit-for-bit those of "none". The hand-written `selective` forms its backward
# products itself: a different computation, equal only to within rounding.
RERUNS = ("full", "torch_full", "torch_selective")


class FeedForward(nn.Module):
    """The MLP half of a transformer block (TinyGPT's `Block.mlp`) with its residual."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class ResidualMLP(nn.Module):
    """`n_layers` FeedForward blocks on (tokens, d_model) inputs; `strategy` picks the recompute."""

    def __init__(self, d_model: int = 32, d_ff: int = 128, n_layers: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(FeedForward(d_model, d_ff) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, strategy: str = "none") -> torch.Tensor:
        for block in self.blocks:
            x = run_block(block, x, strategy)
        return x


class GeluLinear(torch.autograd.Function):
    """z = gelu(h)·Wᵀ + b that saves h, not gelu(h): backward recomputes the gelu (cheap,
    pointwise) and never reruns a matmul. The hand-written selective policy."""

    @staticmethod
    def forward(ctx, h, weight, bias):
        ctx.save_for_backward(h, weight)  # weight is a parameter: it costs no activation memory
        return F.linear(F.gelu(h), weight, bias)

    @staticmethod
    def backward(ctx, grad_z):
        h, weight = ctx.saved_tensors
        with torch.enable_grad():
            h = h.detach().requires_grad_()
            g = F.gelu(h)  # the recomputation
        # The products autograd's addmm backward needs, formed here by hand: equal to autograd's
        # within rounding, not bit for bit (autograd may order a transposed product differently).
        grad_weight = (g.detach().t() @ grad_z).t()
        (grad_h,) = torch.autograd.grad(g, h, grad_z @ weight)
        return grad_h, grad_weight, grad_z.sum(0)


class Recompute(torch.autograd.Function):
    """Full recomputation by hand: forward runs `block` without a graph and saves only its
    input; backward runs it again with a graph and differentiates that."""

    @staticmethod
    def forward(ctx, block, x, *params):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(ctx.needs_input_grad[1])
        params = tuple(ctx.block.parameters())
        with torch.enable_grad():
            y = ctx.block(x)
        inputs = (x, *params) if x.requires_grad else params
        grads = torch.autograd.grad(y, inputs, grad_y)
        return (None, *grads) if x.requires_grad else (None, None, *grads)


MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
# torch >= 2.14 can route what selective checkpointing keeps through saved-tensor hooks (so
# `saved_tensor_bytes` sees it); older versions (2.11 on the lent GPU machines) bypass the hooks:
# there only the storage census sees SAC's kept tensors. `hooks_see_everything` says which ran.
SAC_HOOKS = ({"respect_saved_tensors_hooks": True}
             if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


def hooks_see_everything(strategy: str) -> bool:
    """Do autograd's saved-tensor hooks see every tensor `strategy` keeps for backward? Not for
    selective checkpointing unless this torch routes SAC's cache through them (>= 2.14)."""
    return strategy != "torch_selective" or bool(SAC_HOOKS.get("respect_saved_tensors_hooks"))


def run_block(block: FeedForward, x: torch.Tensor, strategy: str) -> torch.Tensor:
    """One block under one recomputation strategy."""
    if strategy == "none":
        return block(x)
    if strategy == "selective":
        return x + GeluLinear.apply(block.fc1(x), block.fc2.weight, block.fc2.bias)
    if strategy == "full":
        return Recompute.apply(block, x, *block.parameters())
    if strategy == "torch_full":
        return checkpoint(block, x, use_reentrant=False)
    if strategy == "torch_selective":  # ops in the list: MUST_SAVE; every other op: recompute
        context = partial(create_selective_checkpoint_contexts, MATMULS)
        return checkpoint(block, x, use_reentrant=False, context_fn=context, **SAC_HOOKS)
    raise ValueError(f"unknown strategy {strategy!r}: use one of {STRATEGIES}")


def predicted_saved_bytes(strategy: str, tokens: int, d_model: int, d_ff: int, n_layers: int,
                          elem: int) -> int:
    """Activation bytes held for backward, per block: its output (kept by the next block or the
    loss) plus what the strategy keeps inside it. The model's input is not counted."""
    inside = {"none": 2 * d_ff, "selective": d_ff, "full": 0, "torch_full": 0,
              "torch_selective": d_ff + d_model}[strategy]  # SAC also keeps fc2's output
    return n_layers * tokens * (d_model + inside) * elem


@contextmanager
def saved_tensor_bytes(exclude: Iterable[torch.Tensor] = ()):
    """Count, with autograd's saved-tensor hooks, the bytes of every distinct storage saved for
    backward inside the block (tensors sharing a storage count once; `exclude`: parameters,
    inputs). Yields a dict storage -> bytes; sum its values after the forward pass."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t  # keep the tensor itself: the count changes nothing

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


class StorageCensus(TorchDispatchMode):
    """Records every storage an op creates; `live_bytes` sums those still alive. It sees what
    any mechanism keeps (saved tensors, checkpoint caches): what a GPU allocator would hold.
    Exclude the parameters (a weight's transpose is a view of the parameter's storage)."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.refs.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out

    def live_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        skip = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
        alive = {ref.cdata: n for ref, n in self.refs if not ref.expired() and ref.cdata not in skip}
        return sum(alive.values())


def recompute_flop_ratio(strategy: str) -> float:
    """Matmul FLOPs with recomputation over without: forward 1, backward 2, full recomputation
    reruns the forward (+1); the selective policies rerun no matmul."""
    return 4 / 3 if strategy in ("full", "torch_full") else 1.0
