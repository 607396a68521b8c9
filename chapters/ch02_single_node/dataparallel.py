"""nn.DataParallel, counted: ONE process drives every device. Each forward scatters the batch,
replicates the module onto every device, runs the replicas in threads and gathers the outputs
on device 0; the backward sums every replica's gradients back onto device 0's parameters.

    python chapters/ch02_single_node/dataparallel.py                  # every GPU if 2+, else CPU
    python chapters/ch02_single_node/dataparallel.py --devices 4      # 4 GPUs, or 4 simulated

With two GPUs or more (`--device auto`, or `--device cuda`, which refuses fewer; either refuses
`--devices` beyond the GPUs) the model is wrapped in torch's own nn.DataParallel, and the same
global batch is then trained by DDP (spawn.py, one process per GPU) for the timing comparison.
Without two GPUs torch's DataParallel does not replicate, so on the CPU the script runs torch's
own DataParallel.forward, scatter, replicate and gather (not copies of them) over simulated
devices: SimulatedDataParallel replaces only the autograd Functions that move tensors between
devices (Scatter, Gather, Broadcast) and parallel_apply (torch's needs an accelerator). Either
way MechanismTap counts, at those four calls and at both ends of the backward, what was copied
and summed, and the run checks the counts against their closed forms and the parameters against
one process on the whole batch. Start it with plain `python`: it is one process by design
(under torchrun every rank would run its own DataParallel job).
"""
# launch: python   (./course run 02 dataparallel starts this script with python, not torchrun)

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch._utils import ExceptionWrapper

from chapters.ch02_single_node.task import (
    PARITY_TOLERANCE,
    TaskConfig,
    build_data,
    build_model,
    build_optimizer,
    global_batch_indices,
    max_param_diff,
    reference_state,
    train_step,
)
from common.checkpoint import save_checkpoint
from common.config import parse_config
from common.distributed import DistInfo
from common.log import log, setup_logging
from common.results import RunRecorder

# torch's replicate() module (torch.nn.parallel.replicate the name is the function).
_REPLICATE = importlib.import_module("torch.nn.parallel.replicate")
_SCATTER_GATHER = importlib.import_module("torch.nn.parallel.scatter_gather")
PHASES = ("scatter", "replicate", "parallel_apply", "gather")  # DataParallel.forward's order


@dataclass
class Config(TaskConfig):
    """dataparallel.py's options: the shared task's plus DataParallel's devices."""

    devices: int = 0
    """DataParallel's devices: 0 = every GPU (2 or more, --device auto or cuda), else 2 simulated
    CPU devices."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.devices == 1 or self.devices < 0:
            raise ValueError(f"--devices must be 0 (all) or at least 2, got {self.devices} (with "
                             "one device DataParallel just calls the module)")


def validate(cfg: Config, world_size: int) -> None:
    """One process by design; its world is its devices (what torchrun says is ignored, as for
    spawn.py). Real DataParallel needs two GPUs: `--device cuda` with fewer is refused here,
    before anything starts (so `./course gpu-check` reports it n/a on a one-GPU machine), and
    so is `--devices N` beyond the GPUs that `--device auto` would use (2 or more GPUs)."""
    gpus = torch.cuda.device_count()
    if cfg.device == "cuda" or (cfg.device == "auto" and gpus >= 2):
        wanted = cfg.devices or gpus
        if gpus < 2 or wanted > gpus:
            raise ValueError(f"--device {cfg.device}: nn.DataParallel needs {max(wanted, 2)} GPUs "
                             f"and torch sees {gpus}; --device cpu simulates the devices")


def data_parallel_devices(cfg: Config) -> tuple[str, int]:
    """('cuda', n) for torch's DataParallel over n GPUs, or ('cpu', n) for n simulated devices.
    `--device auto` takes the GPUs when there are two or more."""
    gpus = torch.cuda.device_count()
    if cfg.device == "cuda" or (cfg.device == "auto" and gpus >= 2):
        return "cuda", cfg.devices or gpus
    return "cpu", cfg.devices or 2


# --- the four device operations, on simulated CPU devices -----------------------------------------
#
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


def wrap_data_parallel(model: nn.Module, kind: str, n: int) -> nn.DataParallel:
    """torch's DataParallel over n GPUs, or the simulated one over n CPU devices."""
    if kind == "cuda":
        return nn.DataParallel(model, device_ids=list(range(n)))
    return SimulatedDataParallel(model, n)


# --- counting, at the four calls DataParallel.forward makes ----------------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


@dataclass
class ForwardRecord:
    """What one DataParallel forward (and the backward through it) moved, as measured."""

    calls: list[str] = field(default_factory=list)
    chunk_rows: list[int] = field(default_factory=list)  # rows of each device's input
    scattered_bytes: int = 0  # bytes of input chunks that are copies of the batch
    replicas: int = 0
    replica_devices: list[str] = field(default_factory=list)
    copied_param_bytes: int = 0  # parameter bytes copied this step (replicas 1..)
    shared_param_bytes: int = 0  # parameter bytes sharing the module's storage (replica 0)
    gathered_bytes: int = 0
    gathered_device: str = ""
    replica_grad_bytes: int = 0  # gradient bytes the copied replicas' parameters computed
    replica_grads_seen: int = 0  # gradients of replica parameters (every replica), so far
    summed_grad_bytes: int = 0  # copies' gradient bytes found summed in device 0's gradients
    grad_sum_error: float = 0.0  # max |device 0's gradient - sum of the replicas' gradients|
    seen_at_receipt: list[int] = field(default_factory=list)  # replica grads seen per receipt
    forwards: list[tuple[int, str, int]] = field(default_factory=list)  # (pid, thread, rows)
    seconds: dict[str, float] = field(default_factory=dict)
    tap_seconds: float = 0.0  # the tap's own bookkeeping (not the calls it wraps)
    grad_sums: dict = field(default_factory=dict, repr=False)  # name -> [sum, replicas]


SUM_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}  # summation order only


class MechanismTap:
    """Counts what DataParallel does, at the four methods its forward calls: wraps the
    instance's scatter, replicate, parallel_apply and gather (torch's own on GPUs, the
    simulated ones on the CPU) and measures what each returned: bytes of the tensors in new
    storage (numel × element size; for parameters, holding their current values), replicas
    and their devices, rows per device. A forward pre-hook on the module, which the replicas
    share, notes which process and thread ran each replica. The backward is measured at both
    ends: a hook on every replica's parameters sees the gradient each replica computed, and a
    post-accumulate hook on the module's own parameters (device 0) sees what arrived there,
    which must be the sum of every replica's gradient, and when it arrived."""

    def __init__(self, dp: nn.DataParallel):
        self.dp, self.records = dp, []
        self.lock = threading.Lock()
        self.params = dict(dp.module.named_parameters())
        self.devices = sorted({p.device for p in self.params.values()}, key=str)
        for name in PHASES:
            setattr(dp, name, self._wrap(name, getattr(dp, name)))  # an instance attribute wins
        self.hooks = [dp.module.register_forward_pre_hook(self._forward_seen)]
        self.hooks += [p.register_post_accumulate_grad_hook(
            lambda p, name=name: self._gradient_received(name, p))
            for name, p in self.params.items()]

    def _sync(self) -> None:
        if self.dp.device_ids and torch.cuda.is_available() and self.devices[0].type == "cuda":
            for d in self.dp.device_ids:
                torch.cuda.synchronize(d)

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            if name == "scatter":  # DataParallel.forward starts with it
                self.records.append(ForwardRecord())
            rec = self.records[-1]
            rec.calls.append(name)
            self._sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            t1 = time.perf_counter()
            rec.seconds[name] = t1 - t0
            getattr(self, f"_after_{name}")(rec, args, out)
            rec.tap_seconds += time.perf_counter() - t1
            return out

        return counted

    def _forward_seen(self, module, args) -> None:
        rows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else 0
        with self.lock:
            if self.records:
                self.records[-1].forwards.append((os.getpid(), threading.current_thread().name,
                                                  rows))

    def _after_scatter(self, rec: ForwardRecord, args, out) -> None:
        sources = {_storage(t) for t in _tensors(args[:2])}
        inputs, _ = out
        rec.chunk_rows = [_tensors(per_device)[0].shape[0] if _tensors(per_device) else 0
                          for per_device in inputs]
        rec.scattered_bytes = sum(_nbytes(t) for t in _tensors(out) if _storage(t) not in sources)

    def _after_replicate(self, rec: ForwardRecord, args, replicas) -> None:
        rec.replicas = len(replicas)
        mine = {_storage(p) for p in self.params.values()}
        for replica in replicas:
            devices = set()
            for name, p in self.params.items():
                owner, _, leaf = name.rpartition(".")
                t = getattr(replica.get_submodule(owner), leaf)
                devices.add(str(t.device))
                copied = _storage(t) not in mine
                if copied:
                    # A copy made now holds the parameters' current values (a replica kept
                    # from an earlier step would hold old ones, and is not counted).
                    if torch.equal(t.detach(), p.detach().to(t.device)):
                        rec.copied_param_bytes += _nbytes(t)
                else:
                    rec.shared_param_bytes += _nbytes(t)
                if t.requires_grad:
                    t.register_hook(lambda g, rec=rec, name=name, copied=copied:
                                    self._gradient_seen(rec, name, copied, g))
            rec.replica_devices.append(",".join(sorted(devices)))

    def _gradient_seen(self, rec: ForwardRecord, name: str, copied: bool, grad) -> None:
        """A replica's parameter got its gradient: count it, and add it to this parameter's
        running sum on device 0 (what the module's gradient must equal)."""
        if grad is None:  # no gradient flowed to this tensor
            return
        t0 = time.perf_counter()
        with self.lock:
            rec.replica_grads_seen += 1
            if copied:
                rec.replica_grad_bytes += _nbytes(grad)
            g = grad.detach().to(self.params[name].device)
            if name in rec.grad_sums:
                rec.grad_sums[name][0].add_(g)
                rec.grad_sums[name][1] += 1
            else:
                rec.grad_sums[name] = [g.clone(), 1]
            rec.tap_seconds += time.perf_counter() - t0

    def _gradient_received(self, name: str, p: torch.Tensor) -> None:
        """The module's parameter (on device 0) has its gradient: it must be the sum of every
        replica's gradient; the copies' bytes count as summed into device 0 only if it is."""
        t0 = time.perf_counter()
        with self.lock:
            rec = self.records[-1] if self.records else None
            entry = rec.grad_sums.pop(name, None) if rec else None
            if entry is None:  # a backward outside DataParallel
                return
            total, replicas = entry
            error = (p.grad - total).abs().max().item()
            rec.grad_sum_error = max(rec.grad_sum_error, error)
            if error <= SUM_TOLERANCE.get(p.dtype, 1e-5):
                rec.summed_grad_bytes += (replicas - 1) * _nbytes(p.grad)
            rec.seen_at_receipt.append(rec.replica_grads_seen)
            rec.tap_seconds += time.perf_counter() - t0

    def _after_parallel_apply(self, rec: ForwardRecord, args, out) -> None:
        pass  # the forwards are noted by the pre-hook, from inside the replicas' threads

    def _after_gather(self, rec: ForwardRecord, args, out) -> None:
        gathered = _tensors(out)
        rec.gathered_bytes = sum(_nbytes(t) for t in gathered)
        rec.gathered_device = str(gathered[0].device) if gathered else ""

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for name in PHASES:
            delattr(self.dp, name)


def n_params(cfg: TaskConfig) -> int:
    """The MLP's parameter count from its shape: first layer, hidden layers, output layer."""
    h = cfg.d_hidden
    return (cfg.d_in * h + h) + (cfg.n_layers - 2) * (h * h + h) + (h + 1)


def used_devices(batch: int, devices: int) -> int:
    """Devices that get rows: torch.chunk makes chunks of ceil(B / n) rows, so only
    ceil(B / ceil(B / n)) chunks exist (5 rows over 4 devices: 3)."""
    return math.ceil(batch / math.ceil(batch / devices))


def expected_per_step(cfg: TaskConfig, devices: int, itemsize: int) -> dict[str, int]:
    """Closed forms for one step of DataParallel over `devices` devices, batch on the host:
    R = used_devices replicas, R − 1 of them copies of the P parameters, the whole batch
    scattered (B · d_in elements), the whole output gathered (B · d_out), R − 1 sets of P
    gradients computed by the copies and summed into device 0's, none of them before the
    backward has ended (one autograd node reduces them all). These count elements created
    and summed, not bytes on a particular link (which depend on NCCL; see the lesson)."""
    B, P = cfg.global_batch_size, n_params(cfg)
    R = used_devices(B, devices)
    return {"replicas": R, "forwards": R, "rows": B,
            "copied_param_bytes": (R - 1) * P * itemsize, "shared_param_bytes": P * itemsize,
            "scattered_bytes": B * cfg.d_in * itemsize, "gathered_bytes": B * 1 * itemsize,
            "replica_grad_bytes": (R - 1) * P * itemsize,
            "summed_grad_bytes": (R - 1) * P * itemsize, "early_reductions": 0}


def measured_per_step(rec: ForwardRecord) -> dict[str, int]:
    """The same quantities as `expected_per_step`, from a tap's record. The replica forwards
    count only if every one ran in this process, each on a thread of its own (with several
    replicas, none on the caller's: parallel_apply starts one thread per replica). A
    parameter reduced early is one whose gradient reached device 0 before the last replica
    gradient of the step had been computed (DDP's buckets do that on purpose)."""
    caller = threading.main_thread().name  # names are unique per thread (ids are reused)
    threads = {t for pid, t, _ in rec.forwards if pid == os.getpid()}
    own = len(threads) == len(rec.forwards) and (len(threads) == 1 or caller not in threads)
    return {"replicas": rec.replicas, "forwards": len(threads) if own else 0,
            "rows": sum(r for _, _, r in rec.forwards),
            "copied_param_bytes": rec.copied_param_bytes,
            "shared_param_bytes": rec.shared_param_bytes, "scattered_bytes": rec.scattered_bytes,
            "gathered_bytes": rec.gathered_bytes, "replica_grad_bytes": rec.replica_grad_bytes,
            "summed_grad_bytes": rec.summed_grad_bytes,
            "early_reductions": sum(s < rec.replica_grads_seen for s in rec.seen_at_receipt)}


CHECKED = {  # measured_per_step's key -> the check's name (summed over the steps)
    "replicas": "replicas built",
    "forwards": "replica forwards, a thread each",
    "rows": "rows through the replicas",
    "scattered_bytes": "batch bytes scattered",
    "copied_param_bytes": "parameter bytes copied",
    "shared_param_bytes": "device 0 replica: shared bytes",
    "gathered_bytes": "output bytes gathered",
    "replica_grad_bytes": "gradient bytes the copies computed",
    "summed_grad_bytes": "gradient bytes summed into device 0",
    "early_reductions": "parameters reduced during the backward",
}


def synchronize(kind: str, n: int) -> None:
    """Wait for every device's queued work (a no-op on the CPU). Waiting for cuda:0 alone
    would do here (its NCCL reduce cannot finish before every replica's backward has, and the
    optimizer step runs on it), but every device is cheaper to argue about."""
    if kind == "cuda":
        for d in range(n):
            torch.cuda.synchronize(d)


def train_data_parallel(cfg: Config, kind: str, n: int, dp_class=None, count: bool = True,
                        batch_on_host: bool = True):
    """cfg.steps SGD steps of the shared task with the model wrapped in DataParallel over n
    devices (`dp_class(model, n)` instead, for the tests' broken variants; n = 1 and
    `dp_class=None`: the bare model on device 0). The batch stays on the host, where
    DataParallel scatters it from (what the closed forms count), or with `batch_on_host=False`
    lives on device 0, as DDP's lives on its device (the timed runs); the targets are on device
    0, where the output is gathered. Each step is timed between synchronisations of every
    device. With `count` a MechanismTap counts every forward. Returns (model, tap or None,
    losses, step seconds)."""
    src = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    X, Y = build_data(cfg, torch.device("cpu") if batch_on_host else src)
    model = build_model(cfg, src)
    if dp_class is not None:
        dp = dp_class(model, n)
    else:
        dp = wrap_data_parallel(model, kind, n) if n > 1 else model
    tap = MechanismTap(dp) if count else None
    opt = build_optimizer(model, cfg)
    losses, seconds = [], []
    # A simulated device is a thread, as a GPU is one device: no intra-op threads besides
    # (on a busy 2-core machine they wait for each other at every operation).
    threads = torch.get_num_threads()
    if kind == "cpu":
        torch.set_num_threads(1)
    try:
        for step in range(cfg.steps):
            idx = global_batch_indices(step, cfg.global_batch_size, cfg.n_samples)
            synchronize(kind, n)
            t0 = time.perf_counter()
            loss = train_step(dp, opt, X[idx], Y[idx].to(src))
            synchronize(kind, n)
            seconds.append(time.perf_counter() - t0)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return model, tap, losses, seconds


def ddp_step_time(cfg: Config, n: int, out: Path, device: str = "cuda") -> float | None:
    """DDP on the same task, batch and n GPUs, one process each (spawn.py's run): its median
    step time in ms, or None if it failed."""
    from chapters.ch02_single_node import spawn

    task = {f.name: getattr(cfg, f.name) for f in fields(TaskConfig)}
    ddp = spawn.Config(**{**task, "out": str(out), "device": device, "nprocs": n})
    if spawn.main(ddp) != 0:
        return None
    summary = json.loads((out / "summary.json").read_text())
    return summary["figures"]["step time (median)"]["measured"]


def _ms(seconds: list[float]) -> tuple[float, tuple[float, float]]:
    return statistics.median(seconds) * 1e3, (min(seconds) * 1e3, max(seconds) * 1e3)


def train(cfg: Config, script_file: str = __file__) -> int:
    setup_logging()
    kind, n = data_parallel_devices(cfg)
    src = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=src,
                    backend="none", launcher="single")
    rec = RunRecorder(cfg, script_file, info)
    what = f"torch's nn.DataParallel over {n} GPUs" if kind == "cuda" else \
        f"torch's DataParallel.forward over {n} simulated CPU devices"
    log.info("%s, one process (pid %d)", what, os.getpid())
    model, tap, losses, counted_seconds = train_data_parallel(cfg, kind, n)
    save_checkpoint(rec.out / "final_params.pt", model.state_dict())
    # Timed without the tap (it synchronises every device around each call, compares the
    # copies with the parameters and sums the replicas' gradients again), with the batch on
    # device 0 as DDP's is on its device; and one device alone on the same global batch.
    seconds = train_data_parallel(cfg, kind, n, count=False, batch_on_host=False)[3]
    alone = train_data_parallel(cfg, kind, 1, count=False, batch_on_host=False)[3]
    for step, loss in enumerate(losses):
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            log.info("step %3d  loss %.6f", step, loss)
            r = tap.records[step]
            rec.metrics(step, loss=loss, lr=cfg.lr, replicas=r.replicas,
                        copied_param_bytes=r.copied_param_bytes, chunk_rows=r.chunk_rows)
    itemsize = next(model.parameters()).element_size()
    expected = expected_per_step(cfg, n, itemsize)
    measured = [measured_per_step(r) for r in tap.records]
    rec.figure("final loss", measured=losses[-1], unit="MSE")
    rec.figure("parameters P", measured=sum(p.numel() for p in model.parameters()),
               expected=n_params(cfg), unit="elements")
    rec.figure("rows per device, step 0", measured=tap.records[0].chunk_rows, unit="rows")
    rec.figure("replica devices, step 0", measured=tap.records[0].replica_devices, unit="",
               table=False)
    rec.figure("per step, measured", measured=measured, table=False)
    rec.figure("device 0 grad - sum of replicas' (max)",
               measured=max(r.grad_sum_error for r in tap.records), unit="")
    median, spread = _ms(seconds)
    rec.figure("step time, DataParallel (median)", measured=median, unit="ms", spread=spread)
    rec.figure("step time, one device (median)", measured=_ms(alone)[0], unit="ms",
               spread=_ms(alone)[1])
    # The share of a counted step spent in scatter, replicate and gather (each timed between
    # device synchronisations), the tap's own bookkeeping taken out of the step's time.
    overhead = [sum(r.seconds[p] for p in ("scatter", "replicate", "gather")) / (s - r.tap_seconds)
                for r, s in zip(tap.records, counted_seconds)]
    rec.figure("scatter+replicate+gather / step", measured=statistics.median(overhead) * 100,
               unit="%", spread=(min(overhead) * 100, max(overhead) * 100))
    reference = reference_state(cfg, src)
    if kind == "cuda":
        ddp = ddp_step_time(cfg, n, rec.out / "ddp")
        rec.figure(f"step time, DDP on {n} GPUs (median)", measured=ddp, unit="ms")
        if ddp is not None:
            rec.check("DataParallel step slower than DDP's", "timing", measured=median,
                      expected=ddp, compare=">")
    else:
        rec.figure("DataParallel vs DDP on GPUs", measured="not measured (CPU)", unit="")
    steps = len(tap.records)
    for key, name in CHECKED.items():
        rec.check(f"{name} ({steps} steps)", "count", measured=sum(m[key] for m in measured),
                  expected=steps * expected[key])
    rec.check("DataParallel == one process on the batch", "parity",
              measured=max_param_diff(model.state_dict(), reference), expected=0.0,
              tolerance=PARITY_TOLERANCE[cfg.dtype])
    return rec.finish()


def main(cfg: Config) -> int:
    try:
        validate(cfg, 1)
    except ValueError as e:  # one clear line (parse_config already refused this on the CLI)
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        return 2
    return train(cfg)


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
