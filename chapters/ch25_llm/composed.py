"""Chapter 25's Llama trained as large models are: pipeline, tensor, context and data parallelism
composed on one named `DeviceMesh` ("pp", "dp", "cp", "tp"), in torchtitan's order, and proven
against one process.

The order (torchtitan's `parallelize_llama` after `pipeline_llama`):
1. pipeline: every rank builds the whole model from the same weights, then keeps its stage's
   part (embedding + the first layers, ..., the last layers + norm + head); the layers live in a
   `ModuleDict` keyed by their global index, so a parameter's name is the same on every layout
   (what lets a DCP checkpoint reshard across layouts). `torch.distributed.pipelining` runs the
   stages with the 1F1B schedule over the "pp" dimension;
2. tensor parallelism per stage (`parallelize_module` on "tp"): q, k, v, gate, up column-wise,
   o and down row-wise (Megatron's split: one all-reduce after attention and one after the MLP;
   `--tp-plan sequence` is torchtitan's plan, with sequence parallelism: the all-reduces become
   reduce-scatters and all-gathers around sequence-sharded norms, the embedding and head are
   split by vocabulary and the loss is computed on the vocabulary shards);
3. context parallelism on "cp": each rank holds a zigzag shard of every sequence; attention is
   chapter 18's ring attention (`RING_ADAPTER`: grouped-query heads repeated before the ring,
   RoPE at the tokens' global positions);
4. activation checkpointing per block;
5. FSDP2 per block, then per stage, over the flattened "dp" × "cp" mesh (`dp_cp`), with
   `reshard_after_forward=False` under pipelining (1F1B interleaves micro-batches: resharding
   would all-gather every block again for every micro-batch's backward).

Gradient clipping sees every dimension: each parameter's local squared gradient is summed over
the mesh dimensions its DTensor is sharded on (dp_cp by FSDP2, tp for the split matrices), then
the stages' sums over "pp" (`grad_norm`). The pipeline's loss is a mean per micro-batch and
the schedule divides gradients by the number of micro-batches (`scale_grads`).

Run (CPU, gloo; the one-process reference and its checks run in the same program):
    torchrun --standalone --nproc_per_node=8 chapters/ch25_llm/composed.py --dp 2 --tp 2 --pp 2
    torchrun --standalone --nproc_per_node=8 chapters/ch25_llm/composed.py --pp 2 --tp 2 --cp 2 \
        --tp-plan sequence

How the files divide: this one is the training step, the resharding checkpoint and the script;
parallelize.py applies the parallelisms in that order (and the gradient norm over every
dimension); llama.py is the model; reference.py the one process, the batches and the layout's
rules; formulas.py the closed forms it is measured against and the script's checks;
counters.py what it measures inside itself; composed_checks.py the chapter's 8-rank job of
layouts and controls.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch25_llm.counters import (
    ActivationCounter,
    CommCounter,
    full_params,
    merge_stages,
    state_bytes,
)
from chapters.ch25_llm.formulas import record_checks
from chapters.ch25_llm.llama import Cfg, reference_model
from chapters.ch25_llm.parallelize import (
    apply_ac,
    apply_fsdp2,
    apply_tp,
    build_mesh,
    grad_norm,
    set_context,
    split_stage,
    tp_grads_to_param_placements,
)
from chapters.ch25_llm.reference import (
    DIMS,
    TP_PLANS,
    Layout,
    Run,
    layout_error,
    local_batch,
    make_optimizer,
)
from common.config import RunConfig, parse_config, require_at_least_one

BROKEN = ("none", "no_reduce:dp", "no_reduce:cp", "pp_unscaled", "clip_local_stage",
          "tp_unreduced")


def build_composed(run: Run, layout: Layout, mesh, broken: str = "none", device="cpu"):
    """This rank's stage of the model, parallelized in torchtitan's order; returns
    (stage module, pipeline schedule)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    coords = {d: mesh[d].get_local_rank() for d in DIMS}
    model = split_stage(reference_model(run.cfg, run.seed, run.dtype),      # 1. pipeline
                        coords["pp"], layout.pp).to(device)  # only this stage to the device
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], layout.tp_plan)                           # 2. tensor
    positions, cp_group = torch.arange(run.seq_len), None  # attention sees the whole s/cp
    if layout.cp > 1:                                                        # 3. context
        from chapters.ch18_long_context.layouts import positions as zigzag_positions

        positions = zigzag_positions(run.seq_len, coords["cp"], layout.cp, "zigzag")
        cp_group = mesh["cp"].get_group()
    set_context(model, positions, cp_group,
                mesh["tp"] if broken == "tp_unreduced" and layout.tp > 1 else None, device)
    apply_ac(model)                                                           # 4. recompute
    data_dims = {"none": "dp_cp", "no_reduce:dp": "cp", "no_reduce:cp": "dp"}.get(broken, "dp_cp")
    if mesh[data_dims].size() > 1:
        apply_fsdp2(model, mesh[data_dims])                                   # 5. FSDP2

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    stage = PipelineStage(model, coords["pp"], layout.pp, torch.device(device),
                          group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, run.microbatches, loss_fn=loss_fn,
                            scale_grads=broken != "pp_unscaled")
    return model, schedule


def tp_loss_context(layout: Layout):
    """Loss parallel under the sequence plan: the cross-entropy of vocabulary-sharded logits
    (its forward and the backward the schedule runs) computed on the shards. Entered around the
    whole schedule step, as torchtitan does: the loss and its backward run inside the schedule."""
    import contextlib

    if layout.sp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def train_composed(run: Run, layout: Layout, mesh, broken: str = "none",
                   device="cpu", start: int = 0, load: str | None = None,
                   save: str | None = None) -> dict:
    """Train `run.steps` steps on `layout`. Every rank returns losses (global means) and pre-clip
    norms; the ranks at dp = cp = tp = 0 return their stage's whole parameters."""
    assert broken in BROKEN, broken
    coords = {d: mesh[d].get_local_rank() for d in DIMS}
    model, schedule = build_composed(run, layout, mesh, broken, device)
    opt = make_optimizer(model.parameters(), run.lr)
    if load:
        dcp_load(model, opt, load)
    first, last = coords["pp"] == 0, coords["pp"] == layout.pp - 1
    losses, norms = [], []
    for step in range(start, start + run.steps):
        x, y = (t.to(device) for t in local_batch(run, layout, coords, step))
        mb_losses: list = []
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": mb_losses} if last else {}
        acts = ActivationCounter(model.layers.values())  # what autograd keeps, at its peak
        with CommCounter(mesh) as comm, tp_loss_context(layout):  # the last step's traffic
            schedule.step(*args, **kwargs)
            acts.remove()
            tp_grads_to_param_placements(model)
            norm = grad_norm(model.parameters(), mesh["pp"].get_group(),
                             over_pp=broken != "clip_local_stage", device=device)
            coef = torch.clamp(run.max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef.item())
            opt.step()
        state = state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        # the global loss: the mean of the last stage's micro-batch means over dp x cp
        # loss parallel's losses are replicated DTensors: their local value is the loss
        mb_losses = [t.to_local() if hasattr(t, "to_local") else t for t in mb_losses]
        mine = torch.stack(mb_losses).mean().detach() if last and coords["tp"] == 0 \
            else torch.zeros((), dtype=run.dtype, device=device)
        dist.all_reduce(mine)
        losses.append(mine.item() / (layout.dp * layout.cp))
        norms.append(norm.item())
    if save:
        dcp_save(model, opt, save)
    params = None
    if coords["dp"] == coords["cp"] == coords["tp"] == 0:
        params = full_params(model)
    elif any(getattr(layout, d) > 1 for d in ("dp", "cp", "tp")):
        full_params(model)  # the gathers are collectives: every rank of the stage takes part
    return {"losses": losses, "norms": norms, "params": params, "state_bytes": state,
            "coords": coords, "comm_bytes": comm.bytes, "comm_calls": comm.calls,
            "comm_scalar_bytes": comm.scalar_bytes,
            "activation_bytes": acts.peak}


def dcp_save(model, opt, path: str) -> None:
    """The composed model's and AdamW's state in DCP's sharded format: every rank writes its own
    shards (its stage, its tp slice, its dp x cp shard) under the parameters' full names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load(model, opt, path: str) -> None:
    """Load a DCP checkpoint saved by any layout into this rank's part of this layout: DCP
    reads, for each of this rank's shards, the pieces of the saved shards that overlap it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


@dataclass
class Config(RunConfig):
    steps: int = 3
    """Optimizer steps of the composed run (and of its one-process reference)."""
    dp: int = 0
    """Data-parallel degree (FSDP2, with cp); 0: what the world leaves, world / (tp*pp*cp)."""
    tp: int = 1
    """Tensor-parallel degree: divides the heads, the kv heads and the MLP width."""
    pp: int = 1
    """Pipeline stages (1F1B): divides the layers; at most --microbatches."""
    cp: int = 1
    """Context-parallel degree (ring attention, zigzag): --seq-len divisible by 2*cp."""
    tp_plan: str = "blocks"
    """Tensor-parallel plan: blocks (Megatron's split of the blocks; embedding, norms, head
    whole) or sequence (torchtitan's: sequence parallelism, embedding and head split by
    vocabulary, loss parallel; --seq-len divisible by 2*cp*tp)."""
    microbatches: int = 2
    """Micro-batches per step on every pipeline (1F1B needs at least --pp)."""
    micro_batch_size: int = 2
    """Sequences per micro-batch per data-parallel rank: global batch = dp*microbatches*this."""
    seq_len: int = 32
    """Tokens per sequence."""
    layers: int = 2
    """Decoder blocks of the Llama."""
    broken: str = "none"
    """A deliberate bug (a negative control): none, no_reduce:dp, no_reduce:cp, pp_unscaled,
    clip_local_stage or tp_unreduced; the parity checks must then fail."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "tp", "pp", "cp", "microbatches", "micro_batch_size",
                             "seq_len", "layers")
        if self.dp < 0:
            raise ValueError(f"--dp must be 0 (the rest of the world) or more, not {self.dp}")
        if self.broken not in BROKEN:
            raise ValueError(f"--broken must be one of {', '.join(BROKEN)}, not {self.broken!r}")
        if self.tp_plan not in TP_PLANS:
            raise ValueError(f"--tp-plan must be one of {', '.join(TP_PLANS)}, "
                             f"not {self.tp_plan!r}")
        if self.broken == "tp_unreduced" and self.tp_plan != "blocks":
            raise ValueError("--broken tp_unreduced is the blocks plan's control "
                             "(it drops the all-reduce that plan's column-parallel inputs do)")


def resolve(cfg: Config, world: int) -> tuple[Layout, Run]:
    others = cfg.tp * cfg.pp * cfg.cp
    dp = cfg.dp or max(1, world // others)
    layout = Layout(dp=dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, tp_plan=cfg.tp_plan)
    run = Run(cfg=Cfg(layers=cfg.layers), steps=cfg.steps, seq_len=cfg.seq_len,
              global_batch=dp * cfg.microbatches * cfg.micro_batch_size,
              microbatches=cfg.microbatches, seed=cfg.seed)
    return layout, run


def validate(cfg: Config, world_size: int) -> None:
    """Refuse, in one line before any rank starts, a layout the world or the model cannot hold."""
    layout, run = resolve(cfg, world_size)
    if error := layout_error(layout, run.cfg, run.global_batch, run.seq_len, run.microbatches,
                             world_size):
        raise ValueError(f"layout {layout.name()}: {error}")


def main(cfg: Config) -> int:
    from common.distributed import setup_distributed, teardown_distributed
    from common.log import log, setup_logging
    from common.results import RunRecorder

    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        layout, run = resolve(cfg, info.world_size)
        log.info("composed Llama on %s (world %d, %s/%s): %d steps, global batch %d x %d tokens, "
                 "%d micro-batches, float64%s", layout.name(), info.world_size, info.device,
                 info.backend, run.steps, run.global_batch, run.seq_len, run.microbatches,
                 "" if cfg.broken == "none" else f", BROKEN: {cfg.broken}")
        mesh = build_mesh(layout, info.device.type)
        result = train_composed(run, layout, mesh, cfg.broken, info.device)
        parts = [None] * info.world_size
        dist.all_gather_object(parts, {"params": result["params"]})
        composed = {"losses": result["losses"], "norms": result["norms"],
                    "params": merge_stages(parts)}
        for step, (loss, norm) in enumerate(zip(result["losses"], result["norms"])):
            rec.metrics(step, loss=loss, grad_norm=norm)
            log.info("step %d  loss %.12f  grad norm %.12f", step, loss, norm)
        record_checks(rec, run, layout, result, composed, info)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
