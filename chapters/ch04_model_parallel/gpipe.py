"""The pipeline by hand: one stage of the model per rank, the four messages between stages
(activations forward, their gradients backward, by send/recv), and one training step three ways:
the naive split (the whole batch through the stages in turn), GPipe (m micro-batches, all
forwards then all backwards) and the serial control (the same micro-batches one after another).

train.py trains with these and checks them against the unsplit model; wallclock.py times them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.models import MLP
from common.timing import synchronize


def build_stage(model: MLP, rank: int, n_stages: int) -> nn.Sequential:
    """Stage `rank` of `n_stages`: an equal, contiguous run of the MLP's Linear(+ReLU) layers.
    The modules are shared with `model`, so gradients land in `model`'s parameters."""
    children = list(model)
    per_stage = (len(children) + 1) // 2 // n_stages  # Linear layers per stage
    return nn.Sequential(*children[2 * per_stage * rank: 2 * per_stage * (rank + 1)])


def send_forward(act: torch.Tensor, rank: int) -> dist.Work:
    """Send without waiting (`isend`): this stage goes on with its next micro-batch while the
    message travels. A blocking `send` would still let GPipe's stages overlap, but it couples
    them more tightly: on gloo it returns only once the receiver has posted its `recv`, so a
    sender cannot run ahead of a receiver that is still busy with the previous micro-batch."""
    return dist.isend(act.contiguous(), dst=rank + 1)


def recv_forward(like: torch.Tensor, rank: int) -> torch.Tensor:
    act = torch.empty_like(like)
    dist.recv(act, src=rank - 1)
    return act.requires_grad_()  # so its .grad can be sent back to the previous stage


def send_backward(grad: torch.Tensor, rank: int) -> dist.Work:
    return dist.isend(grad.contiguous(), dst=rank - 1)


def recv_backward(like: torch.Tensor, rank: int) -> torch.Tensor:
    grad = torch.empty_like(like)
    dist.recv(grad, src=rank + 1)
    return grad


def _now(device: torch.device) -> float:
    """The clock, read after the device's queued work is done (CUDA kernels are asynchronous)."""
    synchronize(device)
    return time.perf_counter()


def stage_forward(stage, x, y, rank, world, act_like, loss_scale, pending, events=None, mb=0):
    """Receive (or read) the input, run the stage, send the output on (the send's handle goes
    to `pending`). Returns (input, output): on the last stage the output is the loss times
    `loss_scale`, ready for backward. With `events`, appends ("F", mb, start, end) of the compute."""
    inp = x if rank == 0 else recv_forward(act_like, rank)
    t0 = _now(inp.device) if events is not None else 0.0
    out = stage(inp)
    if rank == world - 1:
        out = F.mse_loss(out, y) * loss_scale
    if events is not None:
        events.append(("F", mb, t0, _now(out.device)))
    if rank < world - 1:
        pending.append(send_forward(out.detach(), rank))
    return inp, out


def stage_backward(inp, out, rank, world, pending, events=None, mb=0) -> None:
    """Receive the output's gradient (the loss needs none), backpropagate, send the input's back."""
    grad = None if rank == world - 1 else recv_backward(out, rank)
    t0 = _now(out.device) if events is not None else 0.0
    out.backward(grad)
    if events is not None:
        events.append(("B", mb, t0, _now(out.device)))
    if rank > 0:
        pending.append(send_backward(inp.grad, rank))


def naive_step(stage, x, y, rank, world, act_like) -> float:
    """Naive model parallelism: the whole batch forward through the stages, then backward."""
    pending: list[dist.Work] = []
    inp, out = stage_forward(stage, x, y, rank, world, act_like, 1.0, pending)
    stage_backward(inp, out, rank, world, pending)
    for work in pending:
        work.wait()
    return out.item() if rank == world - 1 else 0.0


def gpipe_step(stage, x, y, rank, world, act_like, n_micro, loss_scale=None, events=None) -> float:
    """GPipe: all m micro-batches forward, then all backward; gradients add up in .grad.
    Each micro-batch loss is scaled by 1/m so the sum is the whole batch's mean loss."""
    scale = 1.0 / n_micro if loss_scale is None else loss_scale
    xs, ys = x.chunk(n_micro), y.chunk(n_micro)
    act_like = act_like[: len(xs[0])]
    pending: list[dist.Work] = []
    saved = [stage_forward(stage, xs[i], ys[i], rank, world, act_like, scale, pending, events, i)
             for i in range(n_micro)]
    for i, (inp, out) in enumerate(saved):
        stage_backward(inp, out, rank, world, pending, events, i)
    for work in pending:
        work.wait()
    return sum(out.item() for _, out in saved) / (scale * n_micro) if rank == world - 1 else 0.0


def serial_step(stage, x, y, rank, world, act_like, n_micro, events=None) -> float:
    """The control: the same micro-batches and the same 1/m, but one after another (micro-batch
    i goes forward and backward through every stage before i+1 starts). It accumulates GPipe's
    gradients exactly, so every parity check passes, yet no two stages ever work at once."""
    scale = 1.0 / n_micro
    xs, ys = x.chunk(n_micro), y.chunk(n_micro)
    act_like = act_like[: len(xs[0])]
    pending: list[dist.Work] = []
    total = 0.0
    for i in range(n_micro):
        inp, out = stage_forward(stage, xs[i], ys[i], rank, world, act_like, scale, pending, events, i)
        stage_backward(inp, out, rank, world, pending, events, i)
        total += out.item() if rank == world - 1 else 0.0
    for work in pending:
        work.wait()
    return total / (scale * n_micro)
