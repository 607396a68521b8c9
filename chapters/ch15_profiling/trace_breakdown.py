"""Read a torch.profiler Chrome trace and split each profiled step into compute,
communication and idle time, from the trace's own events.

A Chrome trace is JSON: {"traceEvents": [{"ph": "X", "name", "cat", "ts", "dur", "tid", ...}]},
times in microseconds. Per step span (a `record_function` range named `train_step`):

    communication = union of the collective events' intervals (c10d::allreduce_, gloo:all_reduce,
                    NCCL kernels: any name containing allreduce, allgather, reducescatter, ...)
    compute       = union of aten ops and GPU kernels, minus the communication intervals
    idle          = span − communication − compute   (Python, DDP bookkeeping, waiting)

Unions, not sums: ops nest (aten::linear holds aten::addmm) and run on several threads at once
(gloo all-reduces on a worker thread while autograd computes on the main one).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall")
Interval = tuple[float, float]


def load_trace(path: str | Path) -> list[dict]:
    """The complete events ("ph": "X") of a Chrome trace file (.json or .json.gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def is_collective(event: dict) -> bool:
    """c10d::allreduce_, gloo:all_reduce, ncclDevKernel_AllReduce_...: one test for all."""
    name = event["name"].lower().replace("_", "")
    return any(c in name for c in COLLECTIVES)


def is_compute(event: dict) -> bool:
    """An aten op on any CPU thread or a GPU kernel that is not a collective."""
    return ((event.get("cat") == "cpu_op" and event["name"].startswith("aten::"))
            or event.get("cat") == "kernel") and not is_collective(event)


def union(intervals: list[Interval]) -> list[Interval]:
    """Merge overlapping intervals into disjoint ones, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if a < hi and b > lo]


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of the disjoint intervals `a` not covered by the disjoint intervals `b`."""
    out = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
        if start < end:
            out.append((start, end))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def spans(events: list[dict], name: str) -> list[Interval]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == name]


def breakdown(events: list[dict], step_name: str = "train_step") -> dict:
    """Per-step compute / communication / idle microseconds (summed over the steps) and the
    number of collective calls the main thread made (the dispatcher's c10d:: ops)."""
    steps = sorted(spans(events, step_name))
    coll = [(e["ts"], e["ts"] + e["dur"]) for e in events if is_collective(e)]
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in events if is_compute(e)]
    total = {"steps": len(steps), "span_us": 0.0, "comm_us": 0.0, "compute_us": 0.0, "idle_us": 0.0}
    for lo, hi in steps:
        comm = union(clip(coll, lo, hi))
        compute = subtract(union(clip(comp, lo, hi)), comm)
        total["span_us"] += hi - lo
        total["comm_us"] += length(comm)
        total["compute_us"] += length(compute)
        total["idle_us"] += (hi - lo) - length(comm) - length(compute)
    total["collective_calls"] = sum(
        1 for e in events if e["name"].startswith("c10d::") and is_collective(e)
        and any(lo <= e["ts"] <= hi for lo, hi in steps))
    return total
