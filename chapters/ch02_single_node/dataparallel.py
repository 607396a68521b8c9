"""nn.DataParallel, counted: ONE process drives every device. Each forward scatters the batch,
replicates the module onto every device, runs the replicas in threads and gathers the outputs
on device 0; the backward sums every replica's gradients back onto device 0's parameters.

    python chapters/ch02_single_node/dataparallel.py                  # every GPU if 2+, else CPU
    python chapters/ch02_single_node/dataparallel.py --devices 4      # 4 GPUs, or 4 simulated

With two GPUs or more (`--device auto`, or `--device cuda`, which refuses fewer) the model is
wrapped in torch's own nn.DataParallel, and the same global batch is then trained by DDP
(spawn.py, one process per GPU) for the timing comparison. Without two GPUs
torch's DataParallel just calls the module, so on the CPU the script runs torch's own
DataParallel.forward (not a copy of it) over simulated devices: SimulatedDataParallel only
supplies the four device operations forward calls (scatter, replicate, parallel_apply,
gather), done on the CPU. Either way MechanismTap counts, at those four calls, what was
copied, and the run checks the counts against their closed forms and the parameters against
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
from common.timing import Timer

# torch's replicate() module (torch.nn.parallel.replicate the name is the function).
_REPLICATE = importlib.import_module("torch.nn.parallel.replicate")
PHASES = ("scatter", "replicate", "parallel_apply", "gather")  # DataParallel.forward's order


@dataclass
class Config(TaskConfig):
    """dataparallel.py's options: the shared task's plus DataParallel's devices."""

    devices: int = 0
    """DataParallel's devices: 0 = every GPU with --device cuda, else 2 simulated CPU devices."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.devices == 1 or self.devices < 0:
            raise ValueError(f"--devices must be 0 (all) or at least 2, got {self.devices} (with "
                             "one device DataParallel just calls the module)")


def validate(cfg: Config, world_size: int) -> None:
    """One process by design; its world is its devices (what torchrun says is ignored, as for
    spawn.py). Real DataParallel needs two GPUs: `--device cuda` with fewer is refused here,
    before anything starts (so `./course gpu-check` reports it n/a on a one-GPU machine)."""
    if cfg.device == "cuda":
        gpus = torch.cuda.device_count()
        wanted = cfg.devices or gpus
        if gpus < 2 or wanted > gpus:
            raise ValueError(f"--device cuda: nn.DataParallel needs {max(wanted, 2)} GPUs and torch "
                             f"sees {gpus}; --device cpu simulates the devices")


def data_parallel_devices(cfg: Config) -> tuple[str, int]:
    """('cuda', n) for torch's DataParallel over n GPUs, or ('cpu', n) for n simulated devices.
    `--device auto` takes the GPUs when there are two or more."""
    gpus = torch.cuda.device_count()
    if cfg.device == "cuda" or (cfg.device == "auto" and gpus >= 2):
        return "cuda", cfg.devices or gpus
    return "cpu", cfg.devices or 2


# --- the four device operations, on simulated CPU devices -----------------------------------------

def simulated_scatter(obj, n: int, dim: int = 0):
    """torch.nn.parallel.scatter over n simulated devices. A tensor is cut as comm.scatter
    (torch/csrc/cuda/comm.cpp) cuts it without chunk sizes, `tensor.chunk(n, dim)` (so 5 rows
    over 4 devices make chunks of 2, 2, 1: only 3 devices get work), and each chunk moved to
    its device with `.to`, a copy unless it is there already (here a fresh CPU tensor: from
    the host, every chunk is a copy); tuples, lists and dicts are scattered element by
    element; anything else is handed to every device as it is."""
    if isinstance(obj, torch.Tensor):
        return tuple(c.clone(memory_format=torch.contiguous_format) for c in obj.chunk(n, dim))
    if isinstance(obj, tuple) and obj:
        return list(zip(*(simulated_scatter(o, n, dim) for o in obj)))
    if isinstance(obj, list) and obj:
        return [list(i) for i in zip(*(simulated_scatter(o, n, dim) for o in obj))]
    if isinstance(obj, dict) and obj:
        return [type(obj)(i) for i in zip(*(simulated_scatter(kv, n, dim) for kv in obj.items()))]
    return [obj for _ in range(n)]


def simulated_scatter_kwargs(inputs: tuple, kwargs: dict | None, n: int, dim: int = 0):
    """torch.nn.parallel.scatter_kwargs: the positional inputs and the keyword inputs scattered
    alike, padded so that every device that got work has both."""
    scattered_inputs = simulated_scatter(inputs, n, dim) if inputs else []
    scattered_kwargs = simulated_scatter(kwargs, n, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(scattered_inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def simulated_broadcast(tensors, devices, detach: bool = False) -> list[list[torch.Tensor]]:
    """comm.broadcast_coalesced on simulated devices, in place of the one CUDA-only call inside
    torch's replicate(): device 0 keeps the tensors themselves (torch's replica on device 0
    shares storage with the module), every other device gets a copy. Without `detach` the
    copies stay in the autograd graph, so the backward adds every replica's gradient into
    the module's parameter: the reduction onto device 0 (torch's ReduceAddCoalesced)."""
    if not tensors:
        return []
    source = [t.detach() for t in tensors] if detach else list(tensors)
    return [[t.view_as(t) if j == 0 else t.clone() for t in source] for j in range(len(devices))]


def simulated_replicate(module: nn.Module, n: int, detach: bool = False) -> list[nn.Module]:
    """torch.nn.parallel.replicate itself (its module copies, `_replicate_for_data_parallel`),
    with its broadcast of the parameters and buffers done on simulated devices."""
    with mock.patch.object(_REPLICATE, "_broadcast_coalesced_reshape", simulated_broadcast):
        return _REPLICATE.replicate(module, list(range(n)), detach)


def simulated_parallel_apply(modules, inputs, kwargs_tup) -> list:
    """torch.nn.parallel.parallel_apply without devices and streams: replica i runs on inputs
    i in a thread of its own (one for a single replica), with the caller's grad mode; an
    exception in a replica is raised again here, naming the replica."""
    grad_enabled = torch.is_grad_enabled()
    lock, results = threading.Lock(), {}

    def worker(i: int, module, args, kwargs) -> None:
        torch.set_grad_enabled(grad_enabled)
        try:
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


def simulated_gather(outputs: list, dim: int = 0):
    """torch.nn.parallel.gather onto device 0: tensors concatenated along `dim` into one new
    tensor (comm.gather copies every piece, device 0's too), dicts, tuples and lists
    gathered element by element, None kept."""
    out = outputs[0]
    if isinstance(out, torch.Tensor):
        if dim == 0 and all(t.dim() == 0 for t in outputs):
            outputs = [t.view(1) for t in outputs]  # scalars become a vector, one per device
        return torch.cat(outputs, dim)
    if out is None:
        return None
    if isinstance(out, dict):
        return type(out)((k, simulated_gather([d[k] for d in outputs], dim)) for k in out)
    return type(out)(simulated_gather(list(parts), dim) for parts in zip(*outputs, strict=True))


class SimulatedDataParallel(nn.DataParallel):
    """torch's nn.DataParallel over n simulated devices on the CPU. `forward` is torch's own
    (not overridden): it checks the module's device, calls scatter, replicate, parallel_apply
    and gather, and returns the gathered output. Only those four device operations are
    replaced, by the simulated ones above (torch's raise on CPU tensors)."""

    def __init__(self, module: nn.Module, n_devices: int):
        nn.Module.__init__(self)  # not DataParallel.__init__: without GPUs it keeps no devices
        self.module = module
        self.dim = 0
        self.device_ids = list(range(n_devices))
        self.output_device = 0
        self.src_device_obj = torch.device("cpu")

    def scatter(self, inputs, kwargs, device_ids):
        return simulated_scatter_kwargs(inputs, kwargs, len(device_ids), self.dim)

    def replicate(self, module, device_ids):
        return simulated_replicate(module, len(device_ids), not torch.is_grad_enabled())

    def parallel_apply(self, replicas, inputs, kwargs):
        return simulated_parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        return simulated_gather(outputs, self.dim)


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
    replica_grad_bytes: int = 0  # gradient bytes the copied replicas' parameters received
    forwards: list[tuple[int, str, int]] = field(default_factory=list)  # (pid, thread, rows)
    seconds: dict[str, float] = field(default_factory=dict)


class MechanismTap:
    """Counts what DataParallel does, at the four methods its forward calls: wraps the
    instance's scatter, replicate, parallel_apply and gather (torch's own on GPUs, the
    simulated ones on the CPU) and measures what each returned: bytes of the tensors in new
    storage (numel × element size; for parameters, holding their current values), replicas
    and their devices, rows per device. A forward
    pre-hook on the module, which the replicas share, notes which process and thread ran each
    replica; a hook on every copied parameter measures the gradient it sends back to device 0."""

    def __init__(self, dp: nn.DataParallel):
        self.dp, self.records = dp, []
        self.lock = threading.Lock()
        self.params = dict(dp.module.named_parameters())
        self.devices = sorted({p.device for p in self.params.values()}, key=str)
        for name in PHASES:
            setattr(dp, name, self._wrap(name, getattr(dp, name)))  # an instance attribute wins
        self.hook = dp.module.register_forward_pre_hook(self._forward_seen)

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
            rec.seconds[name] = time.perf_counter() - t0
            getattr(self, f"_after_{name}")(rec, args, out)
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
                if _storage(t) in mine:
                    rec.shared_param_bytes += _nbytes(t)
                    continue
                # A copy made now holds the parameters' current values (a replica kept from
                # an earlier step would hold old ones, and is not counted).
                if torch.equal(t.detach(), p.detach().to(t.device)):
                    rec.copied_param_bytes += _nbytes(t)
                if t.requires_grad:
                    t.register_hook(lambda g, rec=rec: self._gradient_seen(rec, g))
            rec.replica_devices.append(",".join(sorted(devices)))

    def _gradient_seen(self, rec: ForwardRecord, grad: torch.Tensor) -> None:
        with self.lock:
            rec.replica_grad_bytes += _nbytes(grad)

    def _after_parallel_apply(self, rec: ForwardRecord, args, out) -> None:
        pass  # the forwards are noted by the pre-hook, from inside the replicas' threads

    def _after_gather(self, rec: ForwardRecord, args, out) -> None:
        gathered = _tensors(out)
        rec.gathered_bytes = sum(_nbytes(t) for t in gathered)
        rec.gathered_device = str(gathered[0].device) if gathered else ""

    def remove(self) -> None:
        self.hook.remove()
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
    scattered (B · d_in elements), the whole output gathered (B · d_out), and R − 1 sets of
    P gradients summed back onto device 0."""
    B, P = cfg.global_batch_size, n_params(cfg)
    R = used_devices(B, devices)
    return {"replicas": R, "forwards": R, "rows": B,
            "copied_param_bytes": (R - 1) * P * itemsize, "shared_param_bytes": P * itemsize,
            "scattered_bytes": B * cfg.d_in * itemsize, "gathered_bytes": B * 1 * itemsize,
            "replica_grad_bytes": (R - 1) * P * itemsize}


def measured_per_step(rec: ForwardRecord) -> dict[str, int]:
    """The same quantities as `expected_per_step`, from a tap's record. The replica forwards
    count only if every one ran in this process, each on a thread of its own (with several
    replicas, none on the caller's: parallel_apply starts one thread per replica)."""
    caller = threading.main_thread().name  # names are unique per thread (ids are reused)
    threads = {t for pid, t, _ in rec.forwards if pid == os.getpid()}
    own = len(threads) == len(rec.forwards) and (len(threads) == 1 or caller not in threads)
    return {"replicas": rec.replicas, "forwards": len(threads) if own else 0,
            "rows": sum(r for _, _, r in rec.forwards),
            "copied_param_bytes": rec.copied_param_bytes,
            "shared_param_bytes": rec.shared_param_bytes, "scattered_bytes": rec.scattered_bytes,
            "gathered_bytes": rec.gathered_bytes, "replica_grad_bytes": rec.replica_grad_bytes}


CHECKED = {  # measured_per_step's key -> the check's name (summed over the steps)
    "replicas": "replicas built",
    "forwards": "replica forwards, a thread each",
    "rows": "rows through the replicas",
    "scattered_bytes": "batch bytes scattered",
    "copied_param_bytes": "parameter bytes copied",
    "shared_param_bytes": "device 0 replica: shared bytes",
    "gathered_bytes": "output bytes gathered",
    "replica_grad_bytes": "gradient bytes to device 0",
}


def train_data_parallel(cfg: Config, kind: str, n: int, dp_class=None, count: bool = True):
    """cfg.steps SGD steps of the shared task with the model wrapped in DataParallel over n
    devices (`dp_class(model, n)` instead, for the tests' broken variants; n = 1 and
    `dp_class=None`: the bare model on device 0). The batch stays on the host (DataParallel
    scatters it), the targets go to device 0 where the output is gathered. With `count` a
    MechanismTap counts every forward. Returns (model, tap or None, losses, step seconds)."""
    src = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    X, Y = build_data(cfg, torch.device("cpu"))
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
            with Timer(src) as timer:
                loss = train_step(dp, opt, X[idx], Y[idx].to(src))
            seconds.append(timer.elapsed)
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
    # Timed without the tap (it synchronises every device around each call and compares the
    # copies with the parameters), and one device alone on the same global batch.
    seconds = train_data_parallel(cfg, kind, n, count=False)[3]
    alone = train_data_parallel(cfg, kind, 1, count=False)[3]
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
    median, spread = _ms(seconds)
    rec.figure("step time, DataParallel (median)", measured=median, unit="ms", spread=spread)
    rec.figure("step time, one device (median)", measured=_ms(alone)[0], unit="ms",
               spread=_ms(alone)[1])
    overhead = [sum(r.seconds[p] for p in ("scatter", "replicate", "gather")) / s
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
