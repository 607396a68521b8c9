"""How fast does a DataLoader feed the model, over `num_workers` and `pin_memory`?

Each item costs CPU time (decoding and augmenting an image), so with `num_workers=0` the
training loop waits for every batch; worker processes prepare batches in parallel and ahead of
time. The benchmark times one epoch per setting (warm-up, repeats, median), checks that every
setting yields the same batches, and measures how long a training step stalls waiting for data.

Run:
    python chapters/ch11_data_loading/benchmark.py                      # CPU, workers 0 1 2
    python chapters/ch11_data_loading/benchmark.py --workers 0 2 4 8 --items 2048 --work 8   # a GPU host
    srun --ntasks=1 --cpus-per-task=16 python chapters/ch11_data_loading/benchmark.py --workers 0 4 8 16
It is a single-process benchmark by design (one loader per GPU is what matters); under torchrun
(`torchrun --standalone --nproc_per_node=2 ...`, or `--nnodes=2 --nproc_per_node=8
--rdzv-backend=c10d --rdzv-endpoint=HOST:29500`) every rank would benchmark its own loader.
On a 2-core machine workers beyond 1–2 cannot help: there is no core left to run them.
"""
# launch: python

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.utils.data import DataLoader

from chapters.ch11_data_loading.datasets import AugmentedImages, CachedDataset
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.timing import benchmark, synchronize, throughput


@dataclass
class Config(RunConfig):
    workers: list[int] = field(default_factory=lambda: [0, 1, 2])
    """num_workers settings to time (each with pin_memory off and, on CUDA, on)."""
    items: int = 128
    """Images per epoch."""
    batch_size: int = 16
    """Images per batch."""
    image_size: int = 32
    """Side of each image in pixels."""
    work: int = 32
    """Blur passes per image: the per-item CPU cost (stands for decoding and augmentation; at 4 a worker's per-batch overhead outweighs it)."""
    warmup: int = 1
    """Untimed epochs per setting (they also start persistent workers and fill the cache)."""
    repeats: int = 3
    """Timed epochs per setting; the median is reported."""
    compute_ms: float = 10.0
    """Simulated training step (a sleep, so it uses no CPU) for the stall measurement."""
    start_method: Literal["fork", "spawn", "forkserver"] = "fork"
    """How workers start: fork is Linux's default and cheap; spawn (macOS, Windows) re-imports torch per worker."""
    persistent_workers: bool = True
    """Keep the workers between epochs (--no-persistent-workers: every epoch starts them again)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.workers or min(self.workers) < 0:
            raise ValueError("--workers must list worker counts of at least 0")
        require_at_least_one(self, "items", "batch_size", "image_size", "repeats")
        if self.work < 0 or self.warmup < 0 or self.compute_ms < 0:
            raise ValueError("--work, --warmup and --compute-ms must not be negative")


def make_loader(dataset, cfg: Config, num_workers: int, pin_memory: bool) -> DataLoader:
    """Persistent workers start once, in the warm-up, not in every timed epoch."""
    extra = dict(persistent_workers=cfg.persistent_workers, prefetch_factor=2,
                 multiprocessing_context=cfg.start_method) if num_workers else {}
    return DataLoader(dataset, batch_size=cfg.batch_size, shuffle=False, num_workers=num_workers,
                      pin_memory=pin_memory, **extra)


def read_epoch(loader: DataLoader, device: torch.device, compute_s: float = 0.0) -> dict:
    """One pass: copy each batch to the device (asynchronously from pinned memory) and
    optionally 'train' for compute_s. Returns the images seen and the seconds spent waiting."""
    seen, pinned, wait = [], 0, 0.0
    # `wait` times the host waiting for the loader, which does no device work; the copies may
    # still run on a GPU meanwhile, as they would in training. The epoch's total is synchronised.
    t = time.perf_counter()
    for images, _ in loader:
        wait += time.perf_counter() - t
        pinned += int(images.is_pinned())
        seen.append(images.to(device, non_blocking=True))
        if compute_s:
            time.sleep(compute_s)
        t = time.perf_counter()
    synchronize(device)
    return {"images": torch.cat(seen).cpu(), "pinned": pinned, "wait_s": wait,
            "batches": len(seen)}


def stall_fraction(wait_s: float, batches: int, compute_s: float) -> float:
    """Measured share of the step time spent waiting: wait / (wait + steps x compute)."""
    return wait_s / (wait_s + batches * compute_s)


def time_setting(dataset, cfg: Config, device, num_workers: int, pin_memory: bool) -> dict:
    """Samples/s of one (num_workers, pin_memory) setting by the course's timing protocol."""
    loader = make_loader(dataset, cfg, num_workers, pin_memory)
    last = {}
    stats = benchmark(lambda: last.update(read_epoch(loader, device)),
                      warmup=cfg.warmup, repeats=cfg.repeats, device=device)
    stall = read_epoch(loader, device, cfg.compute_ms / 1e3)
    n = len(dataset)
    return {"workers": num_workers, "pin": pin_memory, "samples_s": throughput(n, stats.median),
            "spread": (throughput(n, stats.max), throughput(n, stats.min)),
            "stats": stats, "images": last["images"], "pinned": last["pinned"],
            "stall": stall_fraction(stall["wait_s"], stall["batches"], cfg.compute_ms / 1e3)}


def validate(cfg: Config, world_size: int) -> None:
    """Any world size: one loader per rank is what a data-parallel job runs; under torchrun every
    rank benchmarks its own loader on its share of the cores, and rank 0 reports."""


def run_grid(cfg: Config, device: torch.device) -> list[dict]:
    """Every (workers, pin_memory) setting, then a cached dataset read by the main process.
    pin_memory=True only where it does something: with CUDA."""
    dataset = AugmentedImages(cfg.items, cfg.image_size, cfg.work, seed=cfg.seed)
    rows = []
    pins = (False, True) if device.type == "cuda" else (False,)
    for w in cfg.workers:
        for pin in pins:
            rows.append(time_setting(dataset, cfg, device, w, pin))
            log.info("workers %d  pin_memory %-5s  %8.1f samples/s  stalled %.0f%% of a %g ms step",
                     w, pin, rows[-1]["samples_s"], 100 * rows[-1]["stall"], cfg.compute_ms)
            log.info("  %s", rows[-1]["stats"])
    cached = time_setting(CachedDataset(dataset), cfg, device, 0, False)
    rows.append({**cached, "workers": "cache"})
    log.info("cached (workers 0)        %8.1f samples/s", cached["samples_s"])
    return rows


def expected_stall(workers: int, cores: int, cfg: Config, zero: dict | None) -> float | None:
    """The share of a step spent waiting for data, in theory. A batch costs t_d of CPU (measured
    with 0 workers) and a step t_c of compute. 0 workers: the loop does both in turn,
    t_d / (t_c + t_d). w workers on c cores supply a batch every t_d / min(w, c): no stall if
    that is shorter than t_c, else 1 - min(w, c) t_c / t_d. It ignores what moving a batch from a
    worker process costs the main loop (shared memory, a queue, unpickling)."""
    if zero is None:
        return None
    t_d, t_c = cfg.batch_size / zero["samples_s"], cfg.compute_ms / 1e3
    if workers == 0:
        return t_d / (t_c + t_d)
    return max(0.0, 1 - min(workers, cores) * t_c / t_d)


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        torch.manual_seed(cfg.seed)
        # One thread in the main process, as each worker has (DataLoader sets it) and as torchrun
        # gives each rank: otherwise workers=0 pays thread overhead on tiny ops, not data cost.
        torch.set_num_threads(1)
        if info.device.type != "cuda":
            log.info("no CUDA: pin_memory=True would do nothing here; only pin_memory=False is timed")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        log.info("%d images of %d px, %d blur passes each, batch %d, %d cores, device %s",
                 cfg.items, cfg.image_size, cfg.work, cfg.batch_size, cores, info.device)
        rows = run_grid(cfg, info.device)
        base = next(r for r in rows if r["workers"] == cfg.workers[0] and not r["pin"])
        zero = next((r for r in rows if r["workers"] == 0 and not r["pin"]), None)
        for i, r in enumerate(rows):
            name = "cached dataset" if r["workers"] == "cache" else f"workers={r['workers']} pin={r['pin']}"
            # Theory: w workers decode in parallel on at most `cores` cores (the timed loop
            # itself only waits); a real training loop keeps one core busy driving the device.
            expected = None
            if zero and r["workers"] != "cache" and r["workers"] > 0:
                expected = zero["samples_s"] * min(r["workers"], cores)
            rec.figure(f"samples/s, {name}", r["samples_s"], expected=expected, unit="samples/s",
                       spread=None if r["workers"] == "cache" else r["spread"])  # (slowest-fastest)
            if r["workers"] != "cache":
                rec.figure(f"stall fraction, {name}", r["stall"], unit="of step time",
                           expected=expected_stall(r["workers"], cores, cfg, zero))
            diff = (r["images"] - base["images"]).abs().max().item()
            rec.check(f"same batches: {name}", "parity", diff, 0.0, 0.0)
            rec.metrics(i, samples_s=r["samples_s"], workers=str(r["workers"]),
                        pin_memory=r["pin"], stall=r.get("stall"), loss=None, lr=None)
        n_batches = -(-cfg.items // cfg.batch_size)
        if info.device.type == "cuda":  # every batch of a pin_memory=True loader is pinned
            for r in rows:
                if r["workers"] != "cache":
                    rec.check(f"pinned batches, workers={r['workers']} pin={r['pin']}", "count",
                              r["pinned"], n_batches if r["pin"] else 0)
        else:
            rec.figure("pin_memory", "n/a on CPU")
        most = max(cfg.workers)
        if zero and most > 0:
            fast = next(r for r in rows if r["workers"] == most and not r["pin"])
            rec.check(f"{most} workers faster than 0", "timing", fast["samples_s"] / zero["samples_s"],
                      1.0, compare=">")
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
