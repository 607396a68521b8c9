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

from common.models import MLP


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


def shard_per_layer(model: nn.Module) -> nn.Module:
    """FSDP2 as in chapter 06: `fully_shard` on every Linear, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def fsdp2_compiled_vs_eager(lr: float = 0.01, compiled_lr: float | None = None, steps: int = 3,
                            backend: str = "aot_eager", compiled_autograd: str = "off") -> dict:
    """On the initialised group: eager FSDP2 and torch.compile'd FSDP2 copies of one float64 MLP,
    each rank on its own data; the largest parameter (full tensors) and loss differences.

    compiled_autograd: "off"; "config" sets `torch._dynamo.config.compiled_autograd = True`
    before compiling; "enable" wraps the training loop in `compiled_autograd._enable`.
    """
    import contextlib

    import torch._dynamo
    from torch._dynamo import compiled_autograd as ca
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = MLP(8, 16, 1).double()
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    xs = torch.randn(steps, 4, 8, dtype=torch.float64, generator=gen)
    ys = torch.randn(steps, 4, 1, dtype=torch.float64, generator=gen)
    eager, comp = shard_per_layer(copy.deepcopy(model)), shard_per_layer(copy.deepcopy(model))
    eager_losses = sgd_steps(eager, eager, xs, ys, lr)

    graphs = []

    def counting(gm, example_inputs):  # every graph Dynamo hands to the backend
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.compiled_autograd = compiled_autograd == "config"
    try:
        step_model = torch.compile(comp, backend=counting)
        ctx = (ca._enable(torch.compile(backend=counting)) if compiled_autograd == "enable"
               else contextlib.nullcontext())
        with ctx:
            comp_losses = sgd_steps(comp, step_model, xs, ys, lr if compiled_lr is None else compiled_lr)
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()

    def full(p):  # a sharded DTensor, or what compiled autograd left behind
        return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
    param = max((full(a) - full(b)).abs().max().item()
                for a, b in zip(eager.parameters(), comp.parameters()))
    return {"max_param_diff": param,
            "max_loss_diff": max(abs(a - b) for a, b in zip(eager_losses, comp_losses)),
            "still_sharded": all(hasattr(p, "full_tensor") for p in comp.parameters()),
            "graphs": len(graphs), "breaks": sum(counters["graph_break"].values()),
            "ca_captures": counters["compiled_autograd"]["captures"]}


def fsdp2_compile_experiment() -> dict:
    """Run on every rank (common.launch.run_on_ranks): compiled FSDP2 beside eager FSDP2, a
    compiled copy trained with a 1 % larger lr (negative control), and compiled autograd."""
    return {"compiled": fsdp2_compiled_vs_eager(),
            "compiled, lr x 1.01": fsdp2_compiled_vs_eager(compiled_lr=0.0101),
            "compiled autograd via config": fsdp2_compiled_vs_eager(compiled_autograd="config"),
            "compiled autograd via _enable": fsdp2_compiled_vs_eager(compiled_autograd="enable")}
