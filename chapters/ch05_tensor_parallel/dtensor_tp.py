"""The production API: the dense block split by DTensor's `parallelize_module`.

ColwiseParallel / RowwiseParallel are Megatron's column / row layers (they insert f and g);
SequenceParallel shards LayerNorm along the sequence, and PrepareModuleInput all-gathers the
sequence before attention and the MLP, as the hand-written f̄ does. Collectives are counted
with `CommDebugMode`, the DTensor counterpart of `tp_layers.COMM`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
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
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    return model


def comm_mode() -> CommDebugMode:
    return CommDebugMode()


def counts(modes: dict) -> dict:
    """{phase: {op name: calls}} from CommDebugMode objects, one per phase."""
    out = {}
    for phase, mode in modes.items():
        out[phase] = {str(op).split(".")[-1].replace("_into_tensor", "").replace("_tensor", ""): n
                      for op, n in mode.get_comm_counts().items()}
    return out


def to_full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (gathered); a plain tensor, copied."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def full_state(model: nn.Module) -> dict:
    return {n: to_full(p) for n, p in model.named_parameters()}
