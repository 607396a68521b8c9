"""torch.compile beside eager: graph breaks found by torch._dynamo.explain, and a compiled
training step compared with the eager one from the same weights; `compile_check` records both
in a run's checks table.

On CPU, the default `inductor` backend generates and compiles C++ (gcc): tens of seconds for
even a tiny model, once per process. `aot_eager` captures the same graphs (Dynamo, AOTAutograd)
and runs them without code generation: what the tests use to stay fast.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.log import library_output, log
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


def compile_then_shard(model: nn.Module, backend, in_place: bool = False) -> nn.Module:
    """torchtitan's order: compile each block (here each Linear; torchtitan: each transformer
    block, after activation checkpointing), THEN `fully_shard` it, then the root. FSDP2's hooks
    land on the outside of the compiled region and run eagerly around it.

    `torch.compile(block)` returns a wrapper module whose call is compiled; `fully_shard` on the
    wrapper puts the hooks outside. `in_place=True` uses `block.compile()` instead, which compiles
    the block's own `__call__`, hooks included: the hooks `fully_shard` adds next end up inside the
    compiled call, where Dynamo cannot trace them (see the lesson for what that costs)."""
    from torch.distributed.fsdp import fully_shard

    for i, layer in enumerate(list(model)):
        if isinstance(layer, nn.Linear):
            if in_place:
                layer.compile(backend=backend)
                block = layer
            else:
                block = torch.compile(layer, backend=backend, fullgraph=True)
                model[i] = block  # as torchtitan did with register_module before March 2026
            fully_shard(block)
    return fully_shard(model)


ORDERS = ("root after sharding", "torchtitan", "in place")


def fsdp2_compiled_vs_eager(order: str = "torchtitan", lr: float = 0.01, steps: int = 3,
                            backend: str = "aot_eager", compiled_autograd: str = "off") -> dict:
    """On the initialised group: eager FSDP2 and a torch.compile'd FSDP2 copy of one float64 MLP
    (3 Linear layers), each rank on its own data; the largest parameter (full tensors) and loss
    differences, and how many graphs reached the backend. The negative control compares the
    compiled copy with eager FSDP2 trained at lr x 1.01 (`control_param_diff`): the parity
    check must reject it.

    order: "root after sharding" (fully_shard every Linear and the root, then torch.compile the
    root), "torchtitan" (`compile_then_shard`), "in place" (the same with `block.compile()`).
    compiled_autograd: "off", or "enable": wrap the training loop in `compiled_autograd._enable`
    (the backward, FSDP2's hooks included, captured by Dynamo).
    """
    import contextlib

    import torch._dynamo
    from torch._dynamo import compiled_autograd as ca
    from torch._dynamo.utils import counters

    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    torch.manual_seed(0)
    model = MLP(8, 16, 1).double()
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    xs = torch.randn(steps, 4, 8, dtype=torch.float64, generator=gen)
    ys = torch.randn(steps, 4, 1, dtype=torch.float64, generator=gen)
    eager = shard_per_layer(copy.deepcopy(model))
    eager_losses = sgd_steps(eager, eager, xs, ys, lr)
    control = shard_per_layer(copy.deepcopy(model))
    sgd_steps(control, control, xs, ys, lr * 1.01)

    graphs = []

    def counting(gm, example_inputs):  # every graph Dynamo hands to the backend
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    try:
        comp = copy.deepcopy(model)
        if order == "root after sharding":
            step_model = torch.compile(shard_per_layer(comp), backend=counting)
        else:
            step_model = compile_then_shard(comp, counting, in_place=order == "in place")
        ctx = (ca._enable(torch.compile(backend=counting)) if compiled_autograd == "enable"
               else contextlib.nullcontext())
        with ctx:
            comp_losses = sgd_steps(comp, step_model, xs, ys, lr)
    finally:
        torch._dynamo.reset()

    def full(p):  # a sharded DTensor, or what compiled autograd left behind
        return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()

    def max_diff(m):
        return max((full(a) - full(b)).abs().max().item() for a, b in zip(m.parameters(), comp.parameters()))
    return {"max_param_diff": max_diff(eager), "control_param_diff": max_diff(control),
            "max_loss_diff": max(abs(a - b) for a, b in zip(eager_losses, comp_losses)),
            "still_sharded": all(hasattr(p, "full_tensor") for p in comp.parameters()),
            "graphs": len(graphs), "breaks": sum(counters["graph_break"].values()),
            "ops_per_graph": [sum(n.op == "call_function" for n in g.graph.nodes) for g in graphs],
            "ca_captures": counters["compiled_autograd"]["captures"]}


def fsdp2_compile_experiment() -> dict:
    """Run on every rank (common.launch.run_on_ranks): compiled FSDP2 beside eager FSDP2 in the
    three orders, and compiled autograd around torchtitan's order. Also records whether this
    torch still has `torch._dynamo.config.skip_fsdp_hooks`."""
    import torch._dynamo

    return {"root after sharding": fsdp2_compiled_vs_eager("root after sharding"),
            "torchtitan": fsdp2_compiled_vs_eager("torchtitan"),
            "in place": fsdp2_compiled_vs_eager("in place"),
            "compiled autograd via _enable": fsdp2_compiled_vs_eager("torchtitan", compiled_autograd="enable"),
            "skip_fsdp_hooks": getattr(torch._dynamo.config, "skip_fsdp_hooks", None),
            "torch": torch.__version__}


def compile_check(model, X, Y, cfg, info, rec) -> None:
    """torch.compile on the DDP model (DDPOptimizer splits the graph at bucket boundaries)
    against eager DDP from the same weights, and Dynamo's graph-break report of the model."""
    log.info("torch.compile (%s): tracing and compiling the model (may take a minute the first "
             "time) ...", cfg.compile_backend)
    with library_output():  # Dynamo's and inductor's warnings and the C++ compiler's output
        report = graph_breaks(model, X[0])
        demo = graph_breaks(item_in_forward(model), X[0])
    rec.figure("graph breaks with .item() in forward", demo["breaks"], expected=1)
    # Sibling of the zero-count check below: the same counter, on a forward that must break.
    rec.check("graph breaks counted in a forward with .item()", "count", demo["breaks"], 1, compare=">=")
    rec.check("graph breaks in the model's forward", "count", report["breaks"], 0)
    ids = [info.device.index] if info.device.type == "cuda" else None
    with library_output():
        diff = compiled_vs_eager(model, X, Y, cfg.lr, cfg.compile_backend,
                                 wrap=lambda m: DDP(m, device_ids=ids))
    log.info("torch.compile (%s) vs eager DDP: %s", cfg.compile_backend, diff)
    # float32, 2 steps: fusion reorders sums of up to d_hidden products (see the lesson's bound)
    rec.check("compiled DDP == eager DDP (max |dparam|)", "parity", diff["max_param_diff"], 0.0, 1e-5)
