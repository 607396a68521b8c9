"""The checks of chapter 04's run: one step of every pipeline (naive split, hand-written GPipe,
the serial control, and `torch.distributed.pipelining`'s ScheduleGPipe and Schedule1F1B) against
the unsplit model, and the hand-written GPipe's training run against it, step for step.

Expected values are the unsplit model's loss and gradients, computed on every rank (the model is
tiny); the tolerance is the cost of adding the same terms in another order.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from common.checkpoint import save_checkpoint
from common.distributed import broadcast_number, reduce_number

# One step of a split model differs from the unsplit one only in the order of additions: the m
# micro-batch gradients are summed in another order than the batch's B samples. Reordering a sum
# of B terms moves it by at most about B·u·sum|terms| (u: 2^-53 in float64, 2^-24 in float32);
# with B <= 128 and terms of order 1 that is ~1e-14 in float64, ~1e-5 worst case in float32
# (errors of random sign grow like sqrt(B): ~1e-6). The lesson derives it.
PARITY_TOL = {"float64": 1e-12, "float32": 1e-5}


def pipelining_step(stage, x, y, info, n_micro, schedule_cls) -> float:
    """The same step with torch.distributed.pipelining (a PipelineStage and a schedule): the
    production API, one more version checked against the unsplit model."""
    pipe_stage = PipelineStage(stage, info.rank, info.world_size, info.device)
    schedule = schedule_cls(pipe_stage, n_microbatches=n_micro, loss_fn=F.mse_loss)
    if info.rank == 0:
        schedule.step(x)
    elif info.rank == info.world_size - 1:
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses)
        return torch.stack(losses).mean().item()
    else:
        schedule.step()
    return 0.0


def stage_diff(model: nn.Module, stage: nn.Module, reference: nn.Module, grads: bool = True) -> float:
    """Largest |grad − reference grad| (or |param − reference param|) over this stage's
    parameters, maximised over ranks; a parameter that got no gradient counts as zero."""
    ref = dict(reference.named_parameters())
    mine = {id(p) for p in stage.parameters()}
    diff = 0.0
    for name, p in model.named_parameters():
        if id(p) in mine:
            a, b = (p.grad if p.grad is not None else torch.zeros_like(p), ref[name].grad) if grads else (p, ref[name])
            diff = max(diff, (a - b).abs().max().item())
    return reduce_number(diff, "max")  # on the communication device: NCCL takes CUDA tensors only


def record_step_parity(rec, model, reference, x, y, methods: dict, build_stage, info, tol: float) -> None:
    """One step of each method on a fresh copy of `model`, split into stages by `build_stage`:
    its loss (known on the last stage) and its stage's gradients against the unsplit model's."""
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward()
    for name, step in methods.items():
        copy_ = copy.deepcopy(model)
        stage = build_stage(copy_, info.rank, info.world_size)
        loss = broadcast_number(float(step(stage, x, y)), src=info.world_size - 1)
        rec.check(f"{name}: loss == unsplit", "parity", abs(loss - ref_loss.item()), 0.0, tol)
        rec.check(f"{name}: grads == unsplit (max |dgrad|)", "parity",
                  stage_diff(copy_, stage, reference), 0.0, tol)


def record_training_parity(rec, max_loss_diff: float, model, stage, reference, steps: int,
                           tol: float) -> None:
    """GPipe training beside the unsplit model: losses and final parameters."""
    train_tol = tol * max(1.0, steps / 20)  # each step adds at most one step's reordering
    rec.check("GPipe training: losses == unsplit (max diff)", "parity", max_loss_diff, 0.0, train_tol)
    rec.check("GPipe training: params == unsplit (max |dparam|)", "parity",
              stage_diff(model, stage, reference, grads=False), 0.0, train_tol)


def save_final_params(rec, model, stage, info) -> None:
    """Every stage's trained parameters, gathered into one file that the tests compare with
    their own single-process training."""
    mine = {id(p) for p in stage.parameters()}
    params = {n: p.detach().cpu() for n, p in model.named_parameters() if id(p) in mine}
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, params)  # CPU tensors: pickled, whatever the backend
    if info.is_main:
        save_checkpoint(rec.out / "final_params.pt",
                        {"params": {n: t for d in gathered for n, t in d.items()}})
