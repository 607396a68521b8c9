"""Figures for the chapter 08 lesson (`python tools/figures.py ch08`; `--rerun` re-measures).

The timeline is an ordering, not a clock: each row is one training step's event log on rank 0
(a tick per gradient made ready, a marker per all-reduce launched and per all-reduce seen
complete, a line where backward ended), with the x axis the position in the log. It is drawn
from a real two-process run with a fixed sleep in each block's backward (`--backward-sleep-ms
20`), so that the early buckets have time to finish while backward still runs; `measure` records
its event logs in figures/data.json; the notebook draws the same picture from its own run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from chapters.ch08_overlap.train import VARIANTS
from common.results import save_figure

LABELS = {"naive": "naive (ch03)", "deferred": "same buckets,\nafter backward",
          "bucketed": "BucketedDDP", "ddp": "torch DDP"}
MEASURE_S = 25
FIGURE_ARGS = ["--backward-sleep-ms", "20", "--steps", "3", "--profile-steps", "0", "--sweep-kb", "64"]


def draw_timeline(ax, logs: dict[str, list[dict]]) -> None:
    """One row per variant: grey ticks = gradients ready, blue = all-reduce launched,
    green = all-reduce seen complete, red line = end of backward."""
    for row, kind in enumerate(reversed(VARIANTS)):
        events = logs[kind]
        y = row
        grads = [e["seq"] for e in events if e["kind"] == "grad"]
        ax.vlines(grads, y - 0.25, y + 0.25, color="0.6", lw=1)
        launches = [e["seq"] for e in events if e["kind"] == "launch"]
        ax.scatter(launches, [y + 0.12] * len(launches), marker="v", s=30, color="tab:blue", zorder=3,
                   label="all-reduce launched" if row == 0 else None)
        done = [e["seq"] for e in events if e["kind"] == "done"]
        ax.scatter(done, [y - 0.18] * len(done), marker="^", s=22, color="tab:green", zorder=3,
                   label="all-reduce seen complete" if row == 0 else None)
        end = next(e["seq"] for e in events if e["kind"] == "backward_end")
        ax.vlines([end], y - 0.45, y + 0.45, color="tab:red", lw=2,
                  label="end of backward" if row == 0 else None)
    ax.vlines([], 0, 0, color="0.6", label="a gradient is ready")
    ax.set_yticks(range(len(VARIANTS)), [LABELS[k] for k in reversed(VARIANTS)], fontsize=8)
    ax.set_xlabel("position in the step's event log (order, not time)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def measure() -> dict:
    """Rank 0's event log of one step per variant, from a real two-process run."""
    from common.launch import run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(__file__).with_name("train.py")
        run_torchrun(script, nproc=2, args=FIGURE_ARGS, out_dir=tmp, timeout=300)
        logs = json.loads((Path(tmp) / "events.json").read_text())
    return {"events": {k: [{"kind": e["kind"], "seq": e["seq"]} for e in logs[k]] for k in VARIANTS}}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    logs = data["events"]
    fig, ax = plt.subplots(figsize=(10.5, 3.6))
    draw_timeline(ax, logs)
    ax.set_title("One step on rank 0 of 2 (64 KiB buckets, 20 ms sleep per block in backward): "
                 "order, not time", fontsize=9)
    fig.tight_layout()
    path = fig_dir / "timeline.png"
    save_figure(fig, path)
    return [path]
