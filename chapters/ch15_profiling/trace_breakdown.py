"""Read a torch.profiler Chrome trace and split each profiled step into compute, communication,
exposed communication and idle time, from the trace's own events; read the step's memory too.

A Chrome trace is JSON: {"traceEvents": [{"ph": "X", "name", "cat", "ts", "dur", "tid", ...}]},
times in microseconds. Per step span S (the `record_function` range named `train_step`):

    compute        = |∪ compute intervals ∩ S|          (aten ops on CPU, kernels on a GPU)
    communication  = |∪ collective intervals ∩ S|       (c10d::allreduce_, gloo:all_reduce, NCCL kernels)
    exposed comm   = |communication \\ compute|          (communication nothing else hides)
    idle           = |S \\ (compute ∪ communication)|    (Python, framework bookkeeping, waiting)

so compute + exposed comm + idle = |S|, and overlapped comm = communication − exposed comm.
This is the split of Holistic Trace Analysis: its temporal breakdown counts communication that
overlaps compute as compute and the rest as "non-compute"; its "communication-computation
overlap" is overlapped / communication.

Two timelines. On CPU (gloo) the work is the aten ops on the CPU threads and the collectives are
gloo's ranges on its worker thread. On a GPU the work is what the GPU ran: kernels (`cat:
kernel`), NCCL's among them, inside the GPU-side projection of each step (`cat:
gpu_user_annotation`); the CPU-side ops there are only launches.

Unions, not sums: ops nest (aten::linear holds aten::addmm) and run on several threads or streams
at once (gloo all-reduces on a worker thread while autograd computes on the main one).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Literal

import torch

Interval = tuple[float, float]
Timeline = Literal["cpu", "gpu"]
# Who launches or runs a collective: the dispatcher's c10d:: op (on the calling thread), gloo's and
# NCCL's CPU-side ranges, NCCL's GPU kernels (ncclKernel_..., ncclDevKernel_...).
COMM_PREFIXES = ("c10d::", "gloo:", "nccl:")
STEP_CATEGORY = {"cpu": "user_annotation", "gpu": "gpu_user_annotation"}


def load_events(path: str | Path) -> list[dict]:
    """Every event of a Chrome trace file (.json or .json.gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def load_trace(path: str | Path) -> list[dict]:
    """The complete events ("ph": "X": a name, a start and a duration) of a Chrome trace file."""
    return [e for e in load_events(path) if e.get("ph") == "X"]


def is_collective(event: dict) -> bool:
    """A collective's launch or transfer: c10d::allreduce_, gloo:all_reduce, nccl:all_reduce, or an
    NCCL kernel. Barriers are not communication of data; aten::broadcast_tensors is not a
    collective at all (matching "broadcast" anywhere in a name would count it)."""
    name = event["name"]
    if event.get("cat") == "kernel":
        return name.lower().startswith("nccl")
    return name.startswith(COMM_PREFIXES) and "barrier" not in name.lower()


def is_compute(event: dict, timeline: Timeline = "cpu") -> bool:
    """CPU timeline: an aten op on any CPU thread. GPU timeline: a GPU kernel that is not NCCL's."""
    if timeline == "gpu":
        return event.get("cat") == "kernel" and not is_collective(event)
    return event.get("cat") == "cpu_op" and event["name"].startswith("aten::")


def comm_events(events: list[dict], timeline: Timeline = "cpu") -> list[dict]:
    """The collectives of one timeline: CPU-side ranges on CPU, NCCL kernels on a GPU."""
    if timeline == "gpu":
        return [e for e in events if e.get("cat") == "kernel" and is_collective(e)]
    return [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and is_collective(e)]


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
    """The parts of the intervals inside [lo, hi]."""
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


def intervals_of(events: list[dict]) -> list[Interval]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events]


def spans(events: list[dict], name: str, category: str | None = "user_annotation") -> list[Interval]:
    """The intervals of the events called `name` in `category` (None: any category). A GPU trace
    holds each record_function range twice, on the CPU (user_annotation) and projected onto the
    GPU (gpu_user_annotation): matching the name alone counts every step twice."""
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["name"] == name and (category is None or e.get("cat") == category))


def step_spans(events: list[dict], step_name: str = "train_step", timeline: Timeline = "cpu") -> list[Interval]:
    """Each profiled step's interval on the chosen timeline. The GPU-side projection may come once
    per stream the step used; merged, they give one interval per step. A trace without GPU-side
    ranges falls back to the kernels the step launched (matched to their launch by the
    `correlation` id Kineto gives both): from the first one's start to the last one's end."""
    found = spans(events, step_name, STEP_CATEGORY[timeline])
    if timeline == "cpu":
        return found
    if found:
        return union(found)
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel"
               and e.get("args", {}).get("correlation") in launched]
    out = []
    for lo, hi in spans(events, step_name, STEP_CATEGORY["cpu"]):
        mine = [k for k in kernels if lo <= launched[k["args"]["correlation"]] <= hi]
        if mine:
            out.append((min(k["ts"] for k in mine), max(k["ts"] + k["dur"] for k in mine)))
    return union(out)


def breakdown(events: list[dict], step_name: str = "train_step", timeline: Timeline = "cpu") -> dict:
    """Compute, communication, exposed communication and idle microseconds, summed over the
    steps, by interval arithmetic; and the collective calls the CPU made inside its steps."""
    steps = step_spans(events, step_name, timeline)
    coll = intervals_of(comm_events(events, timeline))
    comp = intervals_of([e for e in events if is_compute(e, timeline)])
    total = {"steps": len(steps), "span_us": 0.0, "compute_us": 0.0, "comm_us": 0.0,
             "exposed_comm_us": 0.0, "idle_us": 0.0}
    for lo, hi in steps:
        comm = union(clip(coll, lo, hi))
        compute = union(clip(comp, lo, hi))
        busy = union(comm + compute)
        total["span_us"] += hi - lo
        total["compute_us"] += length(compute)
        total["comm_us"] += length(comm)
        total["exposed_comm_us"] += length(subtract(comm, compute))
        total["idle_us"] += length(subtract([(lo, hi)], busy))
    total["overlapped_comm_us"] = total["comm_us"] - total["exposed_comm_us"]
    cpu_steps = spans(events, step_name, STEP_CATEGORY["cpu"])
    total["collective_calls"] = sum(
        1 for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::")
        and is_collective(e) and any(lo <= e["ts"] <= hi for lo, hi in cpu_steps))
    return total


def _covered(intervals: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """For each point, whether any interval [start, end) holds it."""
    return ((intervals[:, 0][None, :] <= points[:, None]) & (points[:, None] < intervals[:, 1][None, :])).any(1)


def sweep_breakdown(events: list[dict], step_name: str = "train_step", timeline: Timeline = "cpu") -> dict:
    """The same four times, computed another way: cut each step at every event boundary into
    elementary segments, and ask of each segment's midpoint whether a compute or a collective
    event covers it. No merging, no subtraction: a bug in `union`, `clip` or `subtract` makes
    the two disagree (the script checks they agree)."""
    coll = torch.tensor(intervals_of(comm_events(events, timeline)) or [(0.0, 0.0)], dtype=torch.float64)
    comp = torch.tensor(intervals_of([e for e in events if is_compute(e, timeline)]) or [(0.0, 0.0)],
                        dtype=torch.float64)
    total = dict.fromkeys(("span_us", "compute_us", "comm_us", "exposed_comm_us", "idle_us"), 0.0)
    for lo, hi in step_spans(events, step_name, timeline):
        cuts = torch.cat([torch.tensor([lo, hi], dtype=torch.float64), coll.flatten(), comp.flatten()])
        cuts = torch.unique(cuts[(cuts >= lo) & (cuts <= hi)])  # sorted
        width, mid = cuts[1:] - cuts[:-1], (cuts[1:] + cuts[:-1]) / 2

        in_comp, in_comm = _covered(comp, mid), _covered(coll, mid)
        total["span_us"] += width.sum().item()
        total["compute_us"] += width[in_comp].sum().item()
        total["comm_us"] += width[in_comm].sum().item()
        total["exposed_comm_us"] += width[in_comm & ~in_comp].sum().item()
        total["idle_us"] += width[~in_comm & ~in_comp].sum().item()
    return total


def memory_by_step(events: list[dict], step_name: str = "train_step", device_type: int = 0) -> list[dict]:
    """From a trace recorded with `profile_memory=True`: per step, on one device type (0: CPU,
    1: CUDA), the allocator's running total at the step's start, peak and end, and the bytes the
    step allocated (the sum of its allocations, frees not subtracted). Each "[memory]" instant
    event carries one allocation (Bytes > 0) or free (Bytes < 0) and the running total. Use
    differences only: the total's zero is wherever the process's first memory profiling began,
    and frees of blocks allocated before that are not reported (so the first profiled step sees
    fewer frees than the next ones)."""
    mem = sorted((e for e in events if e.get("name") == "[memory]"
                  and e.get("args", {}).get("Device Type") == device_type), key=lambda e: e["ts"])
    out = []
    for lo, hi in spans(events, step_name, STEP_CATEGORY["cpu"]):
        inside = [e["args"] for e in mem if lo <= e["ts"] <= hi]
        if not inside:
            out.append({"start": 0, "peak": 0, "end": 0, "allocated": 0})
            continue
        out.append({"start": inside[0]["Total Allocated"] - inside[0]["Bytes"],
                    "peak": max(a["Total Allocated"] for a in inside),
                    "end": inside[-1]["Total Allocated"],
                    "allocated": sum(a["Bytes"] for a in inside if a["Bytes"] > 0)})
    return out
