"""Figures for the chapter 15 lesson (`python tools/figures.py ch15`; `--rerun` re-measures).

They come from real runs of `train.py` on two CPU processes (gloo), recorded by `measure` in
figures/data.json (the events the figures draw, and each run's breakdown): DDP's default single bucket,
and `--bucket-cap-mb 0.1` (two buckets, the first all-reduce launched while backward still runs).
The notebook draws the same pictures from its own run with these functions.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from chapters.ch15_profiling import train
from chapters.ch15_profiling.trace_breakdown import (
    breakdown,
    is_collective,
    is_compute,
    load_events,
    step_spans,
)
from common.results import save_figure

MEASURE_S = 40
RUNS = (("1 bucket (default)", []), ("2 buckets (--bucket-cap-mb 0.1)", ["--bucket-cap-mb", "0.1"]))
COLOURS = {"compute": "tab:blue", "exposed comm": "tab:red", "idle": "0.75"}


def draw_step_timeline(ax, events: list[dict], step: int = 0, timeline: str = "cpu") -> None:
    """One profiled step: a row per thread (or stream), aten ops (or kernels) in blue, collectives
    in red, positioned in milliseconds from the step's start."""
    lo, hi = step_spans(events, "train_step", timeline)[step]
    shown = [e for e in events if e.get("ph") == "X" and e["ts"] < hi and e["ts"] + e["dur"] > lo
             and (is_collective(e) or is_compute(e, timeline))]
    rows = sorted({e["tid"] for e in shown}, key=str)
    for e in shown:
        start, end = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        colour = COLOURS["exposed comm"] if is_collective(e) else COLOURS["compute"]
        ax.barh(rows.index(e["tid"]), (end - start) / 1e3, left=(start - lo) / 1e3, color=colour,
                height=0.6)
    names = ["main" if i == 0 else f"thread {i}" for i in range(len(rows))]
    ax.set_yticks(range(len(rows)), names)
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel("ms into the step (blue: aten ops, red: collectives)")


def draw_breakdown(ax, parts: dict[str, dict]) -> None:
    """One bar per run: compute, exposed communication and idle per step (they add up to the
    step), and beside it the communication split into overlapped and exposed."""
    right = 0.0
    for row, b in enumerate(parts.values()):
        n = b["steps"]
        left = 0.0
        for key, name in (("compute_us", "compute"), ("exposed_comm_us", "exposed comm"),
                          ("idle_us", "idle")):
            width = b[key] / n / 1e3
            ax.barh(row, width, left=left, color=COLOURS[name], height=0.5,
                    label=name if row == 0 else None)
            left += width
        overlapped = b["overlapped_comm_us"] / n / 1e3
        ax.text(left * 1.01, row, f"comm {b['comm_us'] / n / 1e3:.2f} ms, overlapped {overlapped:.2f}",
                va="center", fontsize=8)
        right = max(right, left)
    ax.set_yticks(range(len(parts)), list(parts))
    ax.set_xlim(0, right * 1.5)
    ax.set_xlabel("ms per step (compute + exposed comm + idle = the step)")
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45))


def draw_memory(ax, events: list[dict], grad_bytes: int, device_type: int = 0) -> None:
    """The allocator's running total over the profiled steps (from the [memory] events), the steps
    shaded, the gradients' size as a reference line."""
    mem = sorted((e for e in events if e.get("name") == "[memory]"
                  and e["args"].get("Device Type") == device_type), key=lambda e: e["ts"])
    steps = step_spans(events, "train_step", "cpu")
    t0 = steps[0][0]
    ax.step([(e["ts"] - t0) / 1e3 for e in mem], [e["args"]["Total Allocated"] / 2**10 for e in mem],
            where="post", color="tab:purple", label="allocator total (zero: where memory profiling began)")
    for i, (lo, hi) in enumerate(steps):
        ax.axvspan((lo - t0) / 1e3, (hi - t0) / 1e3, color="0.92", label="train_step" if i == 0 else None)
    ax.axhline(grad_bytes / 2**10, ls=":", color="black", label="gradients (4 bytes x params)")
    ax.set_xlabel("ms since the first profiled step")
    ax.set_ylabel("KiB")
    ax.legend(fontsize=8, loc="lower right")


def drawn_events(events: list[dict], memory: bool) -> list[dict]:
    """The events the figures draw: the step annotations, the aten ops and collectives inside the
    first step, and (with memory) the allocator's [memory] events, with only the fields drawn."""
    lo, hi = step_spans(events, "train_step", "cpu")[0]
    keys = ("ph", "name", "cat", "ts", "dur", "tid")
    kept = []
    for e in events:
        if e.get("name") == "train_step" or (
                e.get("ph") == "X" and e["ts"] < hi and e["ts"] + e["dur"] > lo
                and (is_collective(e) or is_compute(e, "cpu"))):
            kept.append({k: e[k] for k in keys if k in e})
        elif memory and e.get("name") == "[memory]":
            args = {k: e["args"][k] for k in ("Device Type", "Total Allocated") if k in e["args"]}
            kept.append({"name": e["name"], "ph": e.get("ph"), "ts": e["ts"], "args": args})
    return kept


def measure() -> dict:
    """Two profiled runs (one bucket, two buckets): the events drawn and each run's breakdown."""
    from common.launch import run_torchrun

    runs = {}
    with tempfile.TemporaryDirectory(prefix="ch15-") as tmp:
        for i, (label, args) in enumerate(RUNS):
            out = Path(tmp) / str(i)
            run_torchrun(Path(train.__file__), nproc=2, out_dir=out, args=args, timeout=300)
            events = load_events(out / "trace.json.gz")
            runs[label] = {"events": drawn_events(events, memory=i == 0), "breakdown": breakdown(events)}
    return {"runs": runs}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    cfg = train.Config()
    dims = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layers - 1) + [1]
    n_params = sum(a * b + b for a, b in zip(dims, dims[1:]))
    runs = {label: data["runs"][label]["events"] for label, _ in RUNS}

    fig, axes = plt.subplots(3, 1, figsize=(10, 7), gridspec_kw={"height_ratios": [1, 1, 1.3]})
    for ax, (label, events) in zip(axes, runs.items()):
        draw_step_timeline(ax, events)
        ax.set_title(f"rank 0, first profiled step, {label}", fontsize=9)
    draw_breakdown(axes[2], {label: data["runs"][label]["breakdown"] for label in runs})
    axes[2].set_title("rank 0, mean of the profiled steps: where a step's time goes", fontsize=9)
    fig.tight_layout()
    paths = [fig_dir / "timeline.png"]
    save_figure(fig, paths[-1])

    fig, ax = plt.subplots(figsize=(8, 3))
    draw_memory(ax, runs["1 bucket (default)"], 4 * n_params)
    ax.set_title("CPU memory during three profiled DDP steps (profile_memory=True)", fontsize=9)
    fig.tight_layout()
    paths.append(fig_dir / "memory.png")
    save_figure(fig, paths[-1])
    return paths
