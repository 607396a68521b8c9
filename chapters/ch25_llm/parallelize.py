"""How chapter 25's Llama is parallelized, in torchtitan's order (`parallelize_llama` after
`pipeline_llama`): the named mesh, the pipeline stage split, tensor (and sequence) parallelism,
what attention reads for context parallelism, activation checkpointing, FSDP2, and the
gradient norm that clipping takes over every dimension. composed.py
applies them in that order (`build_composed`) and trains the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chapters.ch25_llm.llama import Llama, rope_cos_sin
from chapters.ch25_llm.reference import DIMS, Layout


def build_mesh(layout: Layout, device_type: str = "cpu"):
    """The named 4-D mesh and its flattened data dimension "dp_cp" (FSDP2's mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(getattr(layout, d) for d in DIMS),
                            mesh_dim_names=DIMS)
    mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def split_stage(model: Llama, stage: int, stages: int) -> Llama:
    """Keep stage `stage` of `stages`: its contiguous share of the layers; the embedding on the
    first stage, the final norm and head on the last (torchtitan's `pipeline_module_split`)."""
    per = model.cfg.layers // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if stage != 0:
        model.embed_tokens = None
    if stage != stages - 1:
        model.norm, model.lm_head = None, None
    return model


def apply_tp(model: Llama, tp_mesh, plan: str = "blocks") -> None:
    """Tensor parallelism on the tp mesh, one of two plans (`TP_PLANS`).

    "blocks": Megatron's split of every block (q, k, v, gate, up column-wise, o and down
    row-wise: an all-reduce after attention and after the MLP); the embedding, norms and head
    stay whole on every tp rank.

    "sequence": torchtitan's plan (`parallelize_llama`'s `apply_tp`), Megatron's split plus
    sequence parallelism. Between the blocks' matmuls the residual stream is cut along the
    sequence (Shard(1)): the norms run on their 1/tp of the tokens (`SequenceParallel`), each of
    attention and the MLP all-gathers its input (`PrepareModuleInput` Shard(1) -> Replicate) and
    o and down reduce-scatter their output back to Shard(1) where "blocks" all-reduces it (a
    ring all-reduce is a reduce-scatter then an all-gather: in forward the same bytes on the
    wire, split around the norm).
    The embedding is split by vocabulary rows and reduce-scatters its output onto the sequence;
    the head is split by vocabulary columns and keeps its logits sharded (loss parallel: the
    cross-entropy is computed on the shards, `train_composed` enters `loss_parallel`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = plan == "sequence"
    row_out = {"output_layouts": Shard(1)} if sp else {}  # reduce-scatter onto the sequence
    block_plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                  "self_attn.v_proj": ColwiseParallel(),
                  "self_attn.o_proj": RowwiseParallel(**row_out),
                  "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                  "mlp.down_proj": RowwiseParallel(**row_out)}
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        block_plan.update({"input_layernorm": SequenceParallel(), "self_attn": gather,
                           "post_attention_layernorm": SequenceParallel(), "mlp": gather})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    if not sp:
        return
    ends = {}
    if model.embed_tokens is not None:  # first stage: token ids whole, output on the sequence
        ends["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.lm_head is not None:  # last stage: logits sharded over the vocabulary
        ends["norm"] = SequenceParallel()
        ends["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                          use_local_output=False)
    if ends:
        parallelize_module(model, tp_mesh, ends)


def set_context(model: Llama, positions, cp_group, no_reduce_mesh=None, device="cpu") -> None:
    """What attention reads (`Attention.ctx`), once per layout: the RoPE tables at this rank's
    global token positions (built once on the CPU as HF does, then moved once to the model's
    device; every block shares them), the cp group and, for the tp control, the mesh."""
    cfg = model.cfg
    cos, sin = (t.to(device) for t in rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta,
                                                   next(model.parameters()).dtype))
    for block in model.layers.values():
        block = getattr(block, "_checkpoint_wrapped_module", block)
        block.self_attn.ctx = {"rope": (cos, sin), "cp_group": cp_group,
                               "no_reduce_mesh": no_reduce_mesh}
        block.mlp.ctx = {"no_reduce_mesh": no_reduce_mesh}


def apply_ac(model: Llama) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for key in list(model.layers.keys()):
        model.layers[key] = checkpoint_wrapper(model.layers[key])


def apply_fsdp2(model: Llama, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def tp_grads_to_param_placements(model) -> None:
    """Bring each DTensor gradient to its parameter's placements. Under sequence parallelism a
    replicated norm weight sees 1/tp of the tokens: its gradient comes out Partial (a sum still
    to be taken over tp), and the vocabulary-split embedding's comes out Replicate. FSDP2 does
    this itself before its reduce-scatter (`redistribute` to the parameter's tp placements);
    without FSDP2 (dp·cp = 1) the Partial sums would reach clipping and AdamW unsummed."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)


def grad_norm(params, pp_group, over_pp: bool = True, device="cpu") -> torch.Tensor:
    """The global gradient norm of a composed model: each parameter's local squared gradient is
    summed over the mesh dimensions its DTensor is sharded on (replicated dimensions hold copies:
    summing them would count them twice), then over the pipeline stages. `over_pp=False` is the
    `clip_local_stage` control: each stage clips by its own stages' norm."""
    from torch.distributed.tensor import DTensor

    sums: dict = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            # not `is_shard()`: FSDP2 over TP gives `_StridedShard`, for which it is False
            local, groups = g.to_local(), tuple(g.device_mesh.get_group(i) for i, pl in
                                                enumerate(g.placements) if not pl.is_replicate())
        else:
            local, groups = g, ()
        key = tuple(tuple(dist.get_process_group_ranks(gr)) for gr in groups)
        s, _ = sums.get(key, (torch.zeros((), dtype=torch.float64, device=local.device), groups))
        sums[key] = (s + local.double().pow(2).sum(), groups)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for s, groups in sums.values():
        for group in groups:
            dist.all_reduce(s, group=group)
        total = total + s
    if over_pp and dist.get_world_size(pp_group) > 1:  # pp = 1: nothing to sum, no collective
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()
