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


# Dense (no sparsity) peak FLOP/s from NVIDIA's datasheets, per dtype. PaLM's MFU divides by this
# theoretical peak; a measured small matmul is launch-bound on a GPU and moves from run to run.
# Matched in order against torch.cuda.get_device_name(): the first pattern found in the name wins.
DATASHEET_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("B200", {"bfloat16": 2250, "float16": 2250, "float32": 80}),
    ("H200", {"bfloat16": 989, "float16": 989, "float32": 67}),
    ("H100 PCIe", {"bfloat16": 756, "float16": 756, "float32": 51}),
    ("H100 NVL", {"bfloat16": 835, "float16": 835, "float32": 60}),
    ("H100", {"bfloat16": 989, "float16": 989, "float32": 67}),   # SXM5
    ("A100", {"bfloat16": 312, "float16": 312, "float32": 19.5}),
    ("L40S", {"bfloat16": 362, "float16": 362, "float32": 91.6}),
    ("L4", {"bfloat16": 121, "float16": 121, "float32": 30.3}),
    ("V100", {"float16": 125, "float32": 15.7}),
]


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak FLOP/s of a GPU named `device_name` for `dtype`, or None."""
    key = str(dtype).removeprefix("torch.")
    for pattern, peaks in DATASHEET_PEAK_TFLOPS:
        if pattern in device_name:
            return peaks[key] * 1e12 if key in peaks else None
    return None


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.float32,
               matmul_size: int = 1024) -> tuple[float, str]:
    """The denominator of MFU and where it came from: the datasheet peak on a known GPU;
    otherwise (a CPU, an unlisted GPU) the best of a few n×n matmuls at the current thread count,
    labelled as measured: an optimistic-for-the-code, noisy stand-in (it varied 1.6× between runs
    on a shared 2-core CPU), not a peak the hardware promises."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_peak_flops(name, dtype)
        if peak is not None:
            return peak, f"datasheet, {name}, {str(dtype).removeprefix('torch.')}"
    measured = matmul_peak_flops(matmul_size, dtype=dtype, device=device)
    return measured, (f"measured {matmul_size}x{matmul_size} matmul, {torch.get_num_threads()} "
                      f"thread(s), {device.type}")


def mfu(model_flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOPs the model needs per step over what the device
    could do in that time at peak."""
    return model_flops_per_step / step_seconds / peak_flops
