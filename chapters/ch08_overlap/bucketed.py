"""A hand-written DistributedDataParallel: gradient buckets, all-reduced asynchronously from
gradient hooks in reverse layer order, so communication overlaps the rest of backward.

Helper module of chapter 08 (the script is train.py). `BucketedDDP` wraps any `nn.Module`
the way `torch.nn.parallel.DistributedDataParallel` does:

    model = BucketedDDP(module, bucket_cap_bytes=64 * 1024)
    loss = model(x).loss(...); loss.backward()   # buckets launch while backward still runs
    model.finish_gradient_sync()                  # wait for them, then average
    optimizer.step()

`EventLog` records, in order, when each gradient became ready and when each bucket's
all-reduce was launched, so the overlap is proven on an ordering, not on a wall clock.
"""

import torch
import torch.distributed as dist
from torch import nn


class EventLog:
    """What happened during one step, in order. Kinds: "grad" (a gradient was accumulated),
    "launch" (an all-reduce was started), "wait" (it was waited for), "backward_end"
    (`loss.backward()` returned). Each event carries `seq`, its position in the log, and
    `grads_ready`, how many gradients existed at that moment."""

    def __init__(self):
        self.events: list[dict] = []
        self.grads_ready = 0

    def start_step(self) -> None:
        self.events, self.grads_ready = [], 0

    def record(self, kind: str, what: str = "") -> None:
        self.events.append({"seq": len(self.events), "kind": kind, "what": what,
                            "grads_ready": self.grads_ready})

    def watch(self, module: nn.Module) -> None:
        """Record a "grad" event each time one of `module`'s trainable gradients is ready.
        Call it before wrapping, so this hook runs before the wrapper's own."""
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p, name=name: self._grad(name))

    def _grad(self, name: str) -> None:
        self.grads_ready += 1
        self.record("grad", name)

    def of_kind(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Each parameter that needs a gradient, once. A tied weight is one Parameter object
    reached from two modules: one gradient (autograd sums both uses), so one hook."""
    seen, params = set(), []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


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


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers (frozen ones too)."""
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=0)


class BucketedDDP(nn.Module):
    """Data parallelism that overlaps gradient all-reduces with backward."""

    def __init__(self, module: nn.Module, bucket_cap_bytes: int = 25 * 2**20,
                 events: EventLog | None = None):
        super().__init__()
        if bucket_cap_bytes < 1:
            raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
        self.module, self.events = module, events
        self.world_size = dist.get_world_size()
        broadcast_from_rank0(module)
        self.buckets = build_buckets(trainable_parameters(module), bucket_cap_bytes)
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
        if self._next:
            raise RuntimeError("the previous backward's gradients were never synchronised: call "
                               "finish_gradient_sync() after backward, before the optimizer step")
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: nn.Parameter) -> None:
        i = self._bucket_of[id(p)]
        if i < self._next:
            raise RuntimeError("a gradient arrived for a bucket already sent: a second backward "
                               "before finish_gradient_sync()")
        self._missing[i] -= 1
        self._ready.add(id(p))
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
        if self.events is not None:
            self.events.record("launch", f"bucket {i}")

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce and write the averaged gradients back."""
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
            if self.events is not None:
                self.events.record("wait", f"bucket {i}")
        self._reset()
