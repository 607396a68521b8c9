"""A hand-written DistributedDataParallel: gradient buckets, all-reduced asynchronously from
gradient hooks in reverse layer order, so communication overlaps the rest of backward.

Helper module of chapter 08 (the script is train.py). `BucketedDDP` wraps any `nn.Module`
the way `torch.nn.parallel.DistributedDataParallel` does, with the bucket size in MiB:

    model = BucketedDDP(module, bucket_cap_mb=25)
    loss = model(x).loss(...); loss.backward()   # buckets launch while backward still runs
    model.finish_gradient_sync()                  # wait for them, then average
    optimizer.step()

`BucketedDDP(..., overlap=False)` launches the very same buckets only in
`finish_gradient_sync`, after backward: the control that separates overlap from "fewer,
larger messages".

`EventLog` records, in order, when each gradient became ready, when each all-reduce was
launched (it watches `torch.distributed.all_reduce` itself, so no variant reports its own
launches) and when each was seen complete, and where backward ended. The overlap is proven on
that ordering, not on a wall clock: an all-reduce *hidden under backward* was launched, then
backward produced at least one more gradient, then it was seen complete, all before backward
ended. A wrapper that launches and then waits inside its own hook is seen complete before the
next gradient (`watch_wrapper` polls right after the wrapper's hooks), so it is not counted.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
from torch import nn

from common.distributed import broadcast_from_rank0, trainable_params

MiB = 2**20


class EventLog:
    """What happened during one step, in order. Kinds: "grad" (a gradient was accumulated),
    "launch" (an all-reduce was started), "done" (an all-reduce was seen complete),
    "backward_end" (the last thing inside `loss.backward()`).
    Each event carries `seq`, its position in the log, `grads_ready`, how many gradients
    existed at that moment, and `bytes` for launches.

    Completion is polled with `Work.is_completed()` at every gradient, after the wrapper's
    hooks (`watch_wrapper`) and at the end of backward, so a "done" event at position k means
    the all-reduce had finished by then. On CUDA that means the NCCL kernel had finished on the
    GPU; the host usually runs far ahead of the GPU, so few completions are seen inside backward
    there even when the kernels overlap: on GPUs the profiler trace is the evidence."""

    def __init__(self):
        self.events: list[dict] = []
        self.grads_ready = 0
        self._pending: list[tuple[str, dist.Work]] = []
        self._launched = 0
        self._in_backward = False
        self._lock = threading.Lock()

    def start_step(self) -> None:
        self.events, self.grads_ready, self._pending, self._launched = [], 0, [], 0

    def record(self, kind: str, what: str = "", **extra) -> None:
        with self._lock:
            self.events.append({"seq": len(self.events), "kind": kind, "what": what,
                                "grads_ready": self.grads_ready, **extra})

    def of_kind(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]

    # --- gradients and the end of backward -------------------------------------------------

    def watch(self, module: nn.Module) -> None:
        """Record a "grad" event each time one of `module`'s trainable gradients is ready, and a
        "backward_end" event as the last act of each backward. Call it before wrapping, so this
        hook runs before the wrapper's own."""
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p, name=name: self._grad(name))

    def watch_wrapper(self, module: nn.Module) -> None:
        """Poll once more right after the wrapper's own gradient hooks: call it *after* wrapping
        (hooks run in the order they were registered). An all-reduce that a wrapper launched and
        then waited for inside its hook is seen complete here, before the next gradient exists:
        it ran while backward stood still, which is not overlap."""
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p: self.poll())

    def _grad(self, name: str) -> None:
        if not self._in_backward:
            # Autograd runs the queued callbacks when the whole backward is done, still inside
            # `loss.backward()` (DDP waits for its buckets in one). Ours queues itself once more
            # from there, so it runs after every callback queued before it, DDP's included.
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.grads_ready += 1
        self.record("grad", name)
        self.poll()

    def _end_of_backward(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._really_end_of_backward)

    def _really_end_of_backward(self) -> None:
        self.poll()
        self.record("backward_end")
        self._in_backward = False

    # --- all-reduces -----------------------------------------------------------------------

    def poll(self) -> None:
        """Record "done" for every watched all-reduce that has completed since the last poll."""
        still = []
        for what, work in self._pending:
            if work.is_completed():
                self.record("done", what)
            else:
                still.append((what, work))
        self._pending = still

    @contextlib.contextmanager
    def observe_all_reduce(self):
        """Within the block, every `dist.all_reduce` call (chapter 03's loop, this wrapper, DDP's
        communication hook) is logged as a "launch" with the bytes of the tensor it was handed,
        and its `Work` is polled for completion. Blocking calls stay blocking: they are started
        asynchronously and waited for, which is what a blocking call does."""
        original = dist.all_reduce

        def watched(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = original(tensor, op=op, group=group, async_op=True)
            self._launched += 1
            what = f"all-reduce {self._launched}"
            self.record("launch", what, bytes=tensor.numel() * tensor.element_size())
            self._pending.append((what, work))
            if async_op:
                return work
            work.wait()
            self.poll()
            return None

        dist.all_reduce = watched
        try:
            yield self
        finally:
            dist.all_reduce = original


def build_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Pack parameters into buckets of at most `cap_bytes`, in REVERSE registration order:
    backward produces the last layer's gradients first, so bucket 0 fills first. A parameter
    larger than the cap gets a bucket of its own."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def cap_bytes_of(bucket_cap_mb: float) -> int:
    """MiB to bytes as DDP converts `bucket_cap_mb`: int(bucket_cap_mb · 1024 · 1024)."""
    return int(bucket_cap_mb * MiB)


class BucketedDDP(nn.Module):
    """Data parallelism that overlaps gradient all-reduces with backward.

    `bucket_cap_mb`: the largest bucket in MiB (DDP's argument of the same name; 25 by default,
    fractions allowed: 0.0625 is 64 KiB). `overlap=False` keeps the buckets but launches them
    only in `finish_gradient_sync`, after backward has returned: the same messages, no overlap.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, overlap: bool = True):
        super().__init__()
        self.bucket_cap_bytes = cap_bytes_of(bucket_cap_mb)
        if self.bucket_cap_bytes < 1:
            raise ValueError(f"bucket_cap_mb must give at least one byte, got {bucket_cap_mb}")
        self.module, self.overlap = module, overlap
        self.world_size = dist.get_world_size()
        broadcast_from_rank0(module)
        self.buckets = build_buckets(trainable_params(module.parameters()), self.bucket_cap_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.bytes_sent = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for b in self.buckets for p in b]
        self._reset()

    def _reset(self) -> None:
        self._missing = [len(b) for b in self.buckets]  # gradients each bucket still waits for
        self._ready: set[int] = set()
        self._next = 0  # the next bucket to launch: launches keep bucket order on every rank
        self._works: list[tuple[int, torch.Tensor, dist.Work]] = []

    def forward(self, *args, **kwargs):
        if self._ready:
            raise RuntimeError("the previous backward's gradients were never synchronised: call "
                               "finish_gradient_sync() after backward, before the optimizer step")
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: nn.Parameter) -> None:
        i = self._bucket_of[id(p)]
        if i < self._next or id(p) in self._ready:
            raise RuntimeError("a gradient arrived for a bucket already sent: a second backward "
                               "before finish_gradient_sync()")
        self._missing[i] -= 1
        self._ready.add(id(p))
        if self.overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Launch in bucket order only: gloo and NCCL match collectives by call order, so a
        # rank that sent bucket 1 before bucket 0 would pair its buffers with the wrong ones.
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch_bucket(self._next)
            self._next += 1

    def _launch_bucket(self, i: int) -> None:
        """Copy the bucket's gradients into one flat buffer and start its all-reduce."""
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)  # returns at once
        self._works.append((i, flat, work))
        self.bytes_sent += flat.numel() * flat.element_size()

    def finish_gradient_sync(self) -> None:
        """(Launch the buckets, if `overlap=False`;) wait for every bucket's all-reduce and write
        the averaged gradients back."""
        if not self.overlap:
            self._launch_ready_buckets()
        if self._next < len(self.buckets):
            stuck = [n for n, p in self.module.named_parameters()
                     if id(p) in self._bucket_of and id(p) not in self._ready]
            raise RuntimeError(f"bucket {self._next} never became ready: parameters {stuck} got "
                               "no gradient in this backward (unused parameters are not supported)")
        for i, flat, work in self._works:
            work.wait()  # CPU/gloo: blocks; CUDA/NCCL: makes the compute stream wait
            flat /= self.world_size
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._reset()
