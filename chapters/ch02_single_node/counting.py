"""What nn.DataParallel moves, counted. MechanismTap wraps the four calls DataParallel.forward
makes (scatter, replicate, parallel_apply, gather) and hooks both ends of the backward, on torch's
own DataParallel over GPUs and on simulated_devices.py's over CPU devices alike;
expected_per_step holds the closed forms the counts must equal, measured_per_step reads the same
quantities off a record, and CHECKED names the checks dataparallel.py records from them.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from chapters.ch02_single_node.task import TaskConfig

PHASES = ("scatter", "replicate", "parallel_apply", "gather")  # DataParallel.forward's order


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
