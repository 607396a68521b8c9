"""Counting all-reduces where they happen, not where the code says it made them (chapter 03).

A counter that the training loop increments itself proves nothing: delete the all-reduce, keep
the `calls += 1`, and it still reports every call. `AllReduceTap` counts at the boundary: while
`with AllReduceTap() as tap:` runs, `torch.distributed.all_reduce` is replaced by a wrapper that
records the bytes of the tensor it was handed (`numel × element_size`) and then calls the real
function, whoever the caller is: the hand-written loop, DDP's communication hook, the token count.

    with AllReduceTap() as tap:
        loss.backward()            # DDP's comm hook calls dist.all_reduce in here
    tap.calls, tap.nbytes

It sees calls made through the module (`dist.all_reduce(...)`), from any thread. It does not see
C++: DDP *without* a communication hook all-reduces from its C++ reducer, so the scripts register
`default_hooks.allreduce_hook` (DDP's default all-reduce, written in Python); the tests count the
C++ path too, with a `TorchDispatchMode` that sees every `c10d` operator. Chapter 09's `WireTap`
is the general version (every collective, dtypes, point-to-point).
"""

from __future__ import annotations

import threading

import torch.distributed as dist


class AllReduceTap:
    """Record every `torch.distributed.all_reduce` call made while the block runs."""

    def __init__(self):
        self.sizes: list[int] = []  # bytes handed to each call, in call order
        self._lock = threading.Lock()  # DDP may call from the autograd engine's thread
        self._original = None

    def __enter__(self) -> AllReduceTap:
        original = self._original = dist.all_reduce

        def tapped(tensor, *args, **kwargs):
            with self._lock:
                self.sizes.append(tensor.numel() * tensor.element_size())
            return original(tensor, *args, **kwargs)

        dist.all_reduce = tapped
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original  # restored also when the block raises

    @property
    def calls(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)
