"""torch.compile beside eager: graph breaks found by torch._dynamo.explain, and a compiled
training step compared with the eager one from the same weights.

On CPU, the default `inductor` backend generates and compiles C++ (gcc): tens of seconds for
even a tiny model, once per process. `aot_eager` captures the same graphs (Dynamo, AOTAutograd)
and runs them without code generation: what the tests use to stay fast.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def graph_breaks(fn, *args) -> dict:
    """How many graphs Dynamo captured from `fn(*args)`, how many breaks, and why."""
    import torch._dynamo

    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    return {"graphs": ex.graph_count, "breaks": ex.graph_break_count,
            "reasons": [str(b.reason).splitlines()[0] for b in ex.break_reasons]}


def item_in_forward(model: nn.Module):
    """A forward that reads a tensor into a Python float (`.item()`, as logging code does):
    Dynamo cannot keep a Python number in the graph, so it breaks the graph there."""
    layers = list(model)

    def fn(x):
        h = layers[0](x)
        scale = h.abs().max().item()  # graph break: a data-dependent Python scalar
        for layer in layers[1:]:
            h = layer(h)
        return h / scale
    return fn


def sgd_steps(model: nn.Module, step_model, xs, ys, lr: float) -> list[float]:
    """Plain SGD on `model`'s parameters, calling `step_model` (eager, compiled, DDP...)."""
    losses = []
    for x, y in zip(xs, ys):
        for p in model.parameters():
            p.grad = None
        loss = F.mse_loss(step_model(x), y)
        loss.backward()  # not autograd.grad: DDP averages gradients only through .backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        losses.append(loss.item())
    return losses


def compiled_vs_eager(model: nn.Module, xs, ys, lr: float = 0.01, backend: str = "inductor",
                      wrap=lambda m: m) -> dict:
    """Train two copies of `model` from the same weights, one through torch.compile; return
    the largest parameter and loss differences. `wrap` puts each copy in DDP (or leaves it)."""
    eager, comp = copy.deepcopy(model), copy.deepcopy(model)
    eager_losses = sgd_steps(eager, wrap(eager), xs, ys, lr)
    compiled = torch.compile(wrap(comp), backend=backend)
    comp_losses = sgd_steps(comp, compiled, xs, ys, lr)
    param = max((a - b).abs().max().item() for a, b in zip(eager.parameters(), comp.parameters()))
    loss = max(abs(a - b) for a, b in zip(eager_losses, comp_losses))
    return {"max_param_diff": param, "max_loss_diff": loss}
