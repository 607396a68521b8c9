"""The production API: the dense block split by DTensor's `parallelize_module`.

ColwiseParallel / RowwiseParallel are Megatron's column / row layers (they insert f and g);
SequenceParallel shards LayerNorm along the sequence, and PrepareModuleInput all-gathers the
sequence before attention and the MLP, as the hand-written f̄ does. Collectives are counted
with `CommDebugMode`, the DTensor counterpart of `tp_comm.COMM`.

Under sequence parallelism the LayerNorm weights are replicated but see only this rank's
tokens, so after backward their gradients are `Partial(sum)`: each rank's local tensor is its
share, and DTensor all-reduces it lazily, at the first operation that needs the whole value
(the norm inside `clip_grad_norm_`, then again the optimizer's update). `reduce_partial_grads`
does it once, explicitly, right after backward, where it can be counted.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def make_mesh(info):
    """A one-dimensional mesh over every rank: the tensor-parallel axis."""
    return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("tp",))


def block_plan(sequence_parallel: bool) -> dict:
    """What each submodule of a block becomes. Without SP the block's input and output are
    replicated; with SP they are sequence shards (Shard(1)) and only the linears see the full
    sequence."""
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                     "attn": gather, "mlp": gather,
                     "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                     "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))})
    return plan


def parallelize(model: nn.Module, mesh, sequence_parallel: bool) -> nn.Module:
    """Every block gets the plan. (A block left out still trains correctly, replicated: only
    the collective counts and the parameters held per rank show it; see the tests.)"""
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    return model


def expected_counts(sequence_parallel: bool) -> dict:
    """DTensor's collectives per layer and phase, from the plan. Forward: one all-reduce per
    RowwiseParallel (or a reduce-scatter, and an all-gather per PrepareModuleInput). Backward
    without SP: an all-reduce for every ColwiseParallel whose input arrives as a plain tensor
    (q, k, v and fc1: 4, where Megatron's fused qkv has 2); with SP the gathered input is one
    DTensor, so q, k, v's gradients are summed locally before one reduce-scatter. Grad sync:
    SP's LayerNorm gradients are Partial: 2 LayerNorms × (weight, bias)."""
    if sequence_parallel:
        both = {"all_gather": 2, "reduce_scatter": 2}
        return {"forward": both, "backward": both, "grad sync": {"all_reduce": 4}, "optimizer step": {}}
    return {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 4}, "grad sync": {},
            "optimizer step": {}}


def reduce_partial_grads(model: nn.Module) -> int:
    """Turn every Partial(sum) gradient into the replicated sum now (one all-reduce each), so
    clipping, logging and the optimizer see whole gradients. Returns the calls made."""
    calls = 0
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl
                                                for pl in g.placements])
            calls += 1
    return calls


def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ for a model that mixes DTensor and plain parameters:
    without SP the LayerNorms stay plain tensors and torch's version raises ("got mixed
    torch.Tensor and DTensor"). The DTensor gradients' norm is one DTensor reduction."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    params = [p for p in model.parameters() if p.grad is not None]
    groups = [[p for p in params if isinstance(p.grad, DTensor)],
              [p for p in params if not isinstance(p.grad, DTensor)]]
    norms = []
    for group in groups:
        if group:
            n = get_total_norm([p.grad for p in group])
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups:
        if group:
            clip_grads_with_norm_(group, max_norm, total)
    return total.item()


def local_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds (a DTensor's local shard, a plain tensor whole)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


@contextmanager
def phase(name: str, modes: dict | None = None):
    """Count the collectives of one phase of a step: the hand-written ones in
    `tp_comm.COMM` under `name`, DTensor's in a CommDebugMode stored as `modes[name]`."""
    from chapters.ch05_tensor_parallel.tp_comm import COMM

    COMM.phase = name
    if modes is None:
        yield
    else:
        with CommDebugMode() as mode:
            yield
        modes[name] = mode


def counts(modes: dict) -> dict:
    """{phase: {op name: calls}} from CommDebugMode objects, one per phase."""
    out = {}
    for phase, mode in modes.items():
        out[phase] = {str(op).split(".")[-1].replace("_into_tensor", "").replace("_tensor", ""): n
                      for op, n in mode.get_comm_counts().items()}
    return out


def to_full(t: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor's whole value (a DTensor's gathered). Copied in both cases: a
    replicated DTensor's full_tensor() is its local tensor, which clipping then scales in place."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: nn.Module) -> dict:
    return {n: to_full(p) for n, p in model.named_parameters()}
