"""Timing, throughput and MFU, by one protocol: warm-up, repeats, median with min–max,
thread count noted. CUDA work is asynchronous, so every timer synchronises the device."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (a no-op on CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TimingStats:
    median: float
    min: float
    max: float
    repeats: int
    threads: int

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"{self.median * 1e3:.2f} ms (min {self.min * 1e3:.2f}, max {self.max * 1e3:.2f}, "
                f"{self.repeats} repeats, {self.threads} threads)")


def benchmark(fn: Callable[[], object], warmup: int = 2, repeats: int = 5,
              device: torch.device | str | None = None) -> TimingStats:
    """Time `fn()`: `warmup` untimed calls, then the median of `repeats` timed calls."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return TimingStats(statistics.median(times), min(times), max(times), repeats,
                       torch.get_num_threads())


class Timer:
    """`with Timer(device) as t: ...` then `t.elapsed` seconds."""

    def __init__(self, device: torch.device | str | None = None):
        self.device, self.elapsed = device, 0.0

    def __enter__(self) -> Timer:
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.elapsed = time.perf_counter() - self._t0


def throughput(items: float, seconds: float) -> float:
    """Items (samples, tokens) per second."""
    return items / seconds if seconds > 0 else float("nan")


def matmul_peak_flops(n: int = 1024, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu", repeats: int = 5) -> float:
    """Achievable FLOP/s of an n×n matmul on `device` with the current thread count:
    the denominator of MFU on a machine whose datasheet peak is unknown (a CPU)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    stats = benchmark(lambda: a @ b, warmup=2, repeats=repeats, device=device)
    return 2 * n**3 / stats.min


def mfu(model_flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOPs the model needs per step over what the device
    could do in that time at peak."""
    return model_flops_per_step / step_seconds / peak_flops
