"""Chapter 04's hand-written GPipe on the wall clock: its timeline, its bubble, and whether the
stages really overlap.

Every rank records when each of its forward and backward computations starts and ends (after
synchronising the device: CUDA kernels are asynchronous). The bubble is the share of
ranks × step time not spent computing: waiting for a neighbour and communication both count as
idle. `record_timings` (called by `train.main`) times two kinds of stage:
- real layers: the ranks need cores to compute at once, and every operation pays a message hop
  and the rank's own bookkeeping (`concurrency`, `message_hops`, `host_gaps` measure all three),
  so on a busy CPU the measured bubble sits far above (p−1)/(m+p−1) (reported, never asserted);
- fixed-sleep stages (`SleepStage`): each forward and backward of a micro-batch is a sleep
  of fixed length, which needs no core, so the schedule alone sets the step time and the
  measured bubble tracks (p−1)/(m+p−1) within a band (the one timing check the tests assert).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from chapters.ch04_model_parallel.gpipe import build_stage, gpipe_step, serial_step
from chapters.ch04_model_parallel.schedule import Event, bubble_formula, gpipe_order, simulate
from common.distributed import reduce_number
from common.log import progress
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import synchronize


@dataclass
class Timed:
    """The bubble of repeated steps (median, min, max), the timeline of the last one, and the
    timelines of all the timed ones."""

    median: float
    min: float
    max: float
    timeline: list[Event]
    timelines: list[list[Event]]


def one_machine(info) -> bool:
    """Do all ranks share one machine, hence one monotonic clock (`time.perf_counter` is
    CLOCK_MONOTONIC on Linux, the same for every process)?"""
    return info.local_world_size == info.world_size


def timed_step(step_fn, stage, x, info, n_micro: int) -> list[Event]:
    """Run one step of `step_fn` (`gpipe_step` or `serial_step`) and return every rank's compute
    intervals in seconds from the step's start. On one machine all ranks read the same clock, so
    the intervals of different ranks compare exactly; across machines each rank counts from its
    own start after a barrier (good to the barrier's skew, about a message latency)."""
    events: list = []
    dist.barrier()
    synchronize(info.device)  # the step starts once the device has nothing queued
    start = time.perf_counter()
    step_fn(stage, x, x, info.rank, info.world_size, x, n_micro, events=events)
    origin = reduce_number(start, "min") if one_machine(info) else start
    mine = [Event(info.rank, kind, mb, info.rank, a - origin, b - origin) for kind, mb, a, b in events]
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, mine)  # plain floats, no tensors
    return [e for rank_events in gathered for e in rank_events]


def bubble(timeline: list[Event], n_ranks: int) -> float:
    """1 − busy time / (ranks × step time): the idle share of the step."""
    makespan = max(e.end for e in timeline)
    busy = sum(e.end - e.start for e in timeline)
    return 1 - busy / (n_ranks * makespan)


def overlapping_forwards(timeline: list[Event], n_ranks: int) -> int:
    """How many micro-batches i have rank 0 start the forward of i+1 before the last stage has
    finished the forward of i. In GPipe all m−1 do (rank 0 moves on at once); when micro-batches
    run one after another none can, whatever the clocks: the last stage's forward of i, its
    backward, and every backward message back to rank 0 must all come first. It shows that the
    schedule lets rank 0 run ahead, not that two ranks computed at once (a CPU too busy to run
    both can serialise them anyway): `concurrency` measures that."""
    start = {e.mb: e.start for e in timeline if e.rank == 0 and e.kind == "F"}
    end = {e.mb: e.end for e in timeline if e.rank == n_ranks - 1 and e.kind == "F"}
    return sum(1 for i in end if i + 1 in start and start[i + 1] < end[i])


def concurrency(timeline: list[Event]) -> float:
    """Share of the step during which two or more ranks compute at once: the stages overlap in
    time. A rank runs one operation at a time, so two intervals that intersect are two ranks."""
    points = sorted([(e.start, 1) for e in timeline] + [(e.end, -1) for e in timeline])
    depth, both, last = 0, 0, 0  # at equal times an end comes first: touching is not overlapping
    for t, step in points:
        if depth >= 2:
            both += t - last
        depth, last = depth + step, t
    return both / max(e.end for e in timeline)


def message_hops(timeline: list[Event], kind: str | None = None, mb: int | None = None) -> list[float]:
    """Seconds from the end of an operation to the start of the one on the neighbouring rank that
    needed its message (forward i on rank r, then on r+1; backward i on r+1, then on r), for the
    operations of `kind` and micro-batch `mb` (None: all). Where the receiver sat waiting (always
    in the serial control; for micro-batch 0's forward in GPipe) that is one message's latency
    plus the receiver's waking up; elsewhere it also holds the receiver's own busy time."""
    end = {(e.kind, e.mb, e.rank): e.end for e in timeline}
    hops = []
    for e in timeline:
        sender = (e.kind, e.mb, e.rank - 1 if e.kind == "F" else e.rank + 1)
        if sender in end and kind in (None, e.kind) and mb in (None, e.mb):
            hops.append(e.start - end[sender])
    return hops


def host_gaps(timeline: list[Event], rank: int, kind: str) -> list[float]:
    """Seconds between consecutive `kind` operations of `rank`. GPipe's rank 0 never waits for a
    message during its forwards, so there each gap is its own bookkeeping (send, clock, Python)."""
    mine = sorted((e.start, e.end) for e in timeline if e.rank == rank and e.kind == kind)
    return [b[0] - a[1] for a, b in zip(mine, mine[1:])]


def compute_per_micro_batch(timeline: list[Event]) -> float:
    """Median seconds of one micro-batch's forward + backward on one stage."""
    f = {(e.rank, e.mb): e.end - e.start for e in timeline if e.kind == "F"}
    b = {(e.rank, e.mb): e.end - e.start for e in timeline if e.kind == "B"}
    return statistics.median(f[k] + b[k] for k in f)


def measure(step_fn, stage, x, info, n_micro: int, repeats: int) -> Timed:
    """Bubble of `repeats` timed steps after one warm-up step."""
    bubbles, timelines = [], []
    for _ in range(repeats + 1):
        timelines.append(timed_step(step_fn, stage, x, info, n_micro))
        bubbles.append(bubble(timelines[-1], info.world_size))
    timed = bubbles[1:]
    return Timed(statistics.median(timed), min(timed), max(timed), timelines[-1], timelines[1:])


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps `forward_s` and whose backward sleeps `backward_s`."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage whose work per micro-batch is a fixed sleep: its layers still run (tiny ones),
    but forward takes `forward_s` and backward `backward_s` whatever the cores are doing, so
    the schedule alone decides the step time. A sleeping rank needs no core: two cores can
    host any number of such stages."""

    def __init__(self, layers: nn.Module, forward_s: float, backward_s: float):
        super().__init__()
        self.layers, self.forward_s, self.backward_s = layers, forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.layers(x), self.forward_s, self.backward_s)


def real_stage(cfg, info, max_micro: int):
    """This rank's stage of a wider float32 MLP, and an input for up to `max_micro` micro-batches."""
    seed_everything(cfg.seed)
    n_layers = info.world_size * cfg.layers_per_stage
    model = MLP(cfg.time_width, cfg.time_width, cfg.time_width, n_layers).to(info.device)
    x = torch.randn(max_micro * cfg.time_micro_batch_size, cfg.time_width, device=info.device)
    return build_stage(model, info.rank, info.world_size), x


def sleep_stage(cfg, info, max_micro: int):
    """This rank's stage of a small MLP wrapped in fixed sleeps (`sleep_ms` for every forward
    and every backward of a micro-batch), and an input for up to `max_micro` micro-batches."""
    seed_everything(cfg.seed)
    n_layers = info.world_size * cfg.layers_per_stage
    model = MLP(cfg.d_hidden, cfg.d_hidden, cfg.d_hidden, n_layers).to(info.device)
    stage = SleepStage(build_stage(model, info.rank, info.world_size), cfg.sleep_ms / 1e3, cfg.sleep_ms / 1e3)
    x = torch.randn(max_micro * cfg.micro_batch_size, cfg.d_hidden, device=info.device)
    return stage, x


def record_timings(cfg, info, rec: RunRecorder, m: int) -> None:
    """Time GPipe on real layers and on fixed-sleep stages, for m in {1, 2, m, 2m} (`cfg`: the
    run's `train.Config`, `m` its micro-batch count); record what a message and a rank's own
    bookkeeping cost (the overheads the formula leaves out)."""
    p = info.world_size
    counts = sorted({1, 2, m, 2 * m})
    stage, x = real_stage(cfg, info, max(counts))
    for k in progress(counts, len(counts), "timing GPipe on real layers, m values", info.is_main, 1):
        run = measure(gpipe_step, stage, x[: k * cfg.time_micro_batch_size], info, k, cfg.time_repeats)
        rec.figure(f"real layers: bubble, m={k}", run.median, float(bubble_formula(p, k)), spread=(run.min, run.max))
        if k == m:
            rec.figure(f"real layers: compute per micro-batch (F+B), m={k}",
                       compute_per_micro_batch(run.timeline) * 1e3, unit="ms")
            rec.figure(f"real layers: forwards that start early (rank 0 runs ahead), m={k}",
                       overlapping_forwards(run.timeline, p), m - 1)
            rec.figure(f"real layers: share of the step with two stages computing, m={k}",
                       statistics.median(concurrency(t) for t in run.timelines),
                       concurrency(simulate(gpipe_order(p, k), 1, 2)))
            _record_ms(rec, f"real layers: micro-batch 0's forward hop (median), m={k}",
                       [h for t in run.timelines for h in message_hops(t, "F", 0)])
            if info.is_main:
                (rec.out / "timeline.json").write_text(json.dumps([e.__dict__ for e in run.timeline]))
    if not cfg.sleep_ms:
        return
    stage, x = sleep_stage(cfg, info, max(counts))
    band = cfg.sleep_band
    for k in progress(counts, len(counts), "timing GPipe on fixed sleeps, m values", info.is_main, 1):
        run = measure(gpipe_step, stage, x[: k * cfg.micro_batch_size], info, k, cfg.time_repeats)
        formula = float(bubble_formula(p, k))
        rec.figure(f"fixed-sleep GPipe: bubble, m={k}", run.median, formula, spread=(run.min, run.max))
        rec.check(f"fixed-sleep GPipe bubble, m={k}: (p-1)/(m+p-1) +- {band:g}", "timing", run.median,
                  [max(0.0, formula - band), formula + band], compare="between")
        if k == m:
            rec.check(f"fixed-sleep GPipe: forwards that start early (rank 0 runs ahead), m={k}", "count",
                      overlapping_forwards(run.timeline, p), m - 1)
            both = concurrency(run.timeline)
            rec.figure(f"fixed-sleep GPipe: share of the step with two stages computing, m={k}", both,
                       concurrency(simulate(gpipe_order(p, k))))
            rec.check(f"fixed-sleep GPipe: two stages compute at the same time, m={k}", "count",
                      both, 0.0, compare=">")
            _record_ms(rec, f"fixed-sleep GPipe: rank 0's gap between two forwards (median), m={k}",
                       [g for t in run.timelines for g in host_gaps(t, 0, "F")])
            if info.is_main:
                (rec.out / "timeline_sleep.json").write_text(json.dumps([e.__dict__ for e in run.timeline]))
    serial = measure(serial_step, stage, x[: m * cfg.micro_batch_size], info, m, 1)
    rec.check(f"control, serial micro-batches: no forward starts early, m={m}", "count",
              overlapping_forwards(serial.timeline, p), 0)
    # exactly 0 on one machine (one clock; each interval ends before the message that lets the
    # next one start); across machines the clocks differ by about a barrier's skew
    rec.check(f"control, serial micro-batches: two stages never compute at once, m={m}", "count",
              concurrency(serial.timeline), 0.0, 0.0 if one_machine(info) else 0.01)
    rec.figure(f"control, serial micro-batches: bubble, m={m}", serial.median, (p - 1) / p)
    _record_ms(rec, f"control, serial micro-batches: one message hop (median), m={m}",
               message_hops(serial.timeline))


def _record_ms(rec: RunRecorder, name: str, seconds: list[float]) -> None:
    """A figure in ms: the median of `seconds`, with their min and max."""
    ms = [s * 1e3 for s in seconds]
    rec.figure(name, statistics.median(ms), unit="ms", spread=(min(ms), max(ms)))
