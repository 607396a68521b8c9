"""nn.DataParallel on simulated CPU devices, for a machine without two GPUs: torch's own
DataParallel.forward, scatter, replicate and gather run unchanged; only the autograd Functions
that move tensors between devices (Scatter, Gather and Broadcast, which refuse CPU tensors) are
replaced while each call runs, and parallel_apply (torch's needs an accelerator) by a copy.
dataparallel.py wraps the model in SimulatedDataParallel when it has no two GPUs; counting.py
counts what either DataParallel moves.
"""

from __future__ import annotations

import importlib
import threading
from unittest import mock

import torch
from torch import nn
from torch._utils import ExceptionWrapper

# torch's replicate() module (torch.nn.parallel.replicate the name is the function).
_REPLICATE = importlib.import_module("torch.nn.parallel.replicate")
_SCATTER_GATHER = importlib.import_module("torch.nn.parallel.scatter_gather")

# scatter and gather are torch's own (DataParallel.scatter -> scatter_kwargs -> scatter, and
# DataParallel.gather -> gather, torch/nn/parallel/scatter_gather.py), with the two autograd
# Functions they apply, Scatter and Gather (torch/nn/parallel/_functions.py, which refuse CPU
# tensors), replaced by the simulated ones below while the call runs. replicate is torch's own
# with its broadcast replaced the same way. parallel_apply is a copy (torch's needs an accelerator).


class SimulatedScatter(torch.autograd.Function):
    """torch's Scatter on simulated devices. Forward: comm.scatter (torch/csrc/cuda/comm.cpp)
    cuts the tensor with `tensor.chunk(n, dim)` (5 rows over 4 devices make chunks of 2, 2, 1:
    only 3 devices get work), or by `chunk_sizes`, and moves each chunk to its device with
    `.to`, a copy unless it is there already; here every chunk is a copy (the batch is on the
    host). Backward: Gather of the chunks' gradients back into one tensor. Differences from
    torch's: no device index or background copy stream, no complex-number view."""

    @staticmethod
    def forward(ctx, target_gpus, chunk_sizes, dim, input):
        ctx.dim = dim
        chunks = input.split(list(chunk_sizes), dim) if chunk_sizes else \
            input.chunk(len(target_gpus), dim)
        return tuple(c.clone() for c in chunks)

    @staticmethod
    def backward(ctx, *grad_output):
        return None, None, None, torch.cat(grad_output, ctx.dim)


class SimulatedGather(torch.autograd.Function):
    """torch's Gather on simulated devices. Forward: comm.gather makes one new tensor on the
    output device and copies every piece into it (device 0's too); scalars become a vector,
    one per device, as torch's does (its warning left out). Backward: Scatter of the gradient
    back to the pieces' devices, in the pieces' sizes (a copy each)."""

    @staticmethod
    def forward(ctx, target_device, dim, *inputs):
        ctx.dim = dim
        ctx.unsqueezed_scalar = dim == 0 and all(t.dim() == 0 for t in inputs)
        if ctx.unsqueezed_scalar:
            inputs = tuple(t.view(1) for t in inputs)
        ctx.input_sizes = [t.size(dim) for t in inputs]
        return torch.cat(inputs, dim)

    @staticmethod
    def backward(ctx, grad_output):
        grads = tuple(g.clone() for g in grad_output.split(ctx.input_sizes, ctx.dim))
        if ctx.unsqueezed_scalar:
            grads = tuple(g[0] for g in grads)
        return (None, None, *grads)


class SimulatedBroadcast(torch.autograd.Function):
    """torch's Broadcast (what replicate applies to the parameters) on simulated devices.
    Forward: comm.broadcast_coalesced returns the tensors themselves for device 0 (replica 0
    shares the module's storage) and a copy for every other device. Backward: ONE node for
    every parameter of every replica, as torch's, whose ReduceAddCoalesced sums each
    parameter's gradients from all replicas into the module's (device 0); autograd runs it
    only when every replica's gradients exist, i.e. after the whole backward."""

    @staticmethod
    def forward(ctx, n_devices, *inputs):
        ctx.num_inputs = len(inputs)
        copies = [t.clone() for _ in range(1, n_devices) for t in inputs]
        ctx.mark_non_differentiable(*[c for i, c in enumerate(copies)
                                      if not ctx.needs_input_grad[1 + i % len(inputs)]])
        return (*inputs, *copies)

    @staticmethod
    def backward(ctx, *grad_outputs):
        n = ctx.num_inputs
        per_device = [grad_outputs[j:j + n] for j in range(0, len(grad_outputs), n)]
        return (None, *(sum(grads[1:], grads[0].clone()) for grads in zip(*per_device)))


def simulated_broadcast(tensors, devices, detach: bool = False) -> list[list[torch.Tensor]]:
    """torch's _broadcast_coalesced_reshape (torch/nn/parallel/replicate.py), the one call
    inside replicate() that needs GPUs, on simulated devices: SimulatedBroadcast, or without
    autograd (`detach`, under no_grad) the tensors themselves for device 0 and detached copies
    for the others, as comm.broadcast_coalesced."""
    if not tensors:
        return []
    n = len(tensors)
    if detach:
        return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]
    copies = SimulatedBroadcast.apply(len(devices), *tensors)
    return [list(copies[j:j + n]) for j in range(0, len(copies), n)]


def simulated_parallel_apply(modules, inputs, kwargs_tup) -> list:
    """A copy of torch.nn.parallel.parallel_apply (which needs an accelerator): replica i runs
    on inputs i in a thread of its own (in the caller's thread for a single replica), with the
    caller's grad mode and CPU autocast state (both are per thread); an exception in a replica
    is raised again here, naming the replica. Differences from torch's: no device index and no
    stream entered in each thread, and the autocast state is the CPU's, not the accelerator's."""
    grad_enabled = torch.is_grad_enabled()
    autocast_enabled = torch.is_autocast_enabled("cpu")
    lock, results = threading.Lock(), {}

    def worker(i: int, module, args, kwargs) -> None:
        torch.set_grad_enabled(grad_enabled)
        try:
            with torch.amp.autocast("cpu", enabled=autocast_enabled):
                output = module(*(args if isinstance(args, (list, tuple)) else (args,)), **kwargs)
            with lock:
                results[i] = output
        except Exception:
            with lock:
                results[i] = ExceptionWrapper(where=f"in replica {i} on simulated device {i}")

    jobs = list(zip(modules, inputs, kwargs_tup, strict=True))
    if len(jobs) > 1:
        threads = [threading.Thread(target=worker, args=(i, *job)) for i, job in enumerate(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        worker(0, *jobs[0])
    outputs = []
    for i in range(len(jobs)):
        if isinstance(results[i], ExceptionWrapper):
            results[i].reraise()
        outputs.append(results[i])
    return outputs


class SimulatedDataParallel(nn.DataParallel):
    """torch's nn.DataParallel over n simulated devices on the CPU. `forward`, `scatter` and
    `gather` are torch's own: forward checks the module's device, calls scatter, replicate,
    parallel_apply and gather, and returns the gathered output. Only the autograd Functions
    that move tensors between devices are replaced while each call runs (Scatter, Gather,
    Broadcast: torch's raise on CPU tensors), and parallel_apply by a copy. (The replacement
    patches torch's module globals for the duration of the call: one DataParallel at a time.)"""

    def __init__(self, module: nn.Module, n_devices: int):
        nn.Module.__init__(self)  # not DataParallel.__init__: without GPUs it keeps no devices
        self.module = module
        self.dim = 0
        self.device_ids = list(range(n_devices))
        self.output_device = 0
        self.src_device_obj = torch.device("cpu")

    def scatter(self, inputs, kwargs, device_ids):
        with mock.patch.object(_SCATTER_GATHER, "Scatter", SimulatedScatter):
            return super().scatter(inputs, kwargs, device_ids)

    def replicate(self, module, device_ids):
        with mock.patch.object(_REPLICATE, "_broadcast_coalesced_reshape", simulated_broadcast):
            return super().replicate(module, device_ids)

    def parallel_apply(self, replicas, inputs, kwargs):
        return simulated_parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        with mock.patch.object(_SCATTER_GATHER, "Gather", SimulatedGather):
            return super().gather(outputs, output_device)
