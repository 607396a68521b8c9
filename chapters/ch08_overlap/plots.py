"""Figures for the chapter 08 lesson (regenerate with `python tools/figures.py ch08`).

The timeline is an ordering, not a clock: each row is one training step's event log (a tick per
gradient made ready, a marker per all-reduce launched or waited for, a line where backward
returned). The order of events does not depend on the number of ranks, so the committed figure
is drawn from a world of one process, in-process; the notebook draws the same picture from the
real two-process run.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from chapters.ch08_overlap.train import VARIANTS, Config, build_model, global_batches, train_variant
from common.distributed import setup_distributed, teardown_distributed

LABELS = {"naive": "naive (ch03)", "bucketed": "BucketedDDP", "ddp": "torch DDP"}


def draw_timeline(ax, logs: dict[str, list[dict]]) -> None:
    """One row per variant: grey ticks = gradients ready, blue = all-reduce launched,
    green = waited for, red line = backward returned."""
    for row, kind in enumerate(reversed(VARIANTS)):
        events = logs[kind]
        y = row
        grads = [e["seq"] for e in events if e["kind"] == "grad"]
        ax.vlines(grads, y - 0.25, y + 0.25, color="0.6", lw=1)
        launches = [e["seq"] for e in events if e["kind"] == "launch"]
        ax.scatter(launches, [y] * len(launches), marker="v", s=45, color="tab:blue", zorder=3,
                   label="all-reduce launched" if row == 0 else None)
        waits = [e["seq"] for e in events if e["kind"] == "wait"]
        ax.scatter(waits, [y - 0.32] * len(waits), marker="^", s=25, color="tab:green", zorder=3,
                   label="waited for" if row == 0 else None)
        end = next(e["seq"] for e in events if e["kind"] == "backward_end")
        ax.vlines([end], y - 0.45, y + 0.45, color="tab:red", lw=2,
                  label="backward returned" if row == 0 else None)
    ax.vlines([], 0, 0, color="0.6", label="a gradient is ready")
    ax.set_yticks(range(len(VARIANTS)), [LABELS[k] for k in reversed(VARIANTS)])
    ax.set_xlabel("position in the step's event log (order, not time)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def one_step_logs(cfg: Config) -> dict[str, list[dict]]:
    """The last step's event log of each variant, on whatever process group is current."""
    info = setup_distributed("cpu", "gloo", cfg.timeout)
    X, Y, vocab = global_batches(cfg, info.device)
    init = build_model(cfg, vocab, info.device)
    return {kind: train_variant(kind, init, X, Y, cfg, info, cfg.bucket_kb * 1024)["events"]
            for kind in VARIANTS}


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    owned = not dist.is_initialized()
    try:
        logs = one_step_logs(Config(steps=2))
    finally:
        if owned:
            teardown_distributed()
    fig, ax = plt.subplots(figsize=(10.5, 3.2))
    draw_timeline(ax, logs)
    ax.set_title("When each all-reduce is launched, relative to backward (64 KiB buckets)")
    fig.tight_layout()
    path = fig_dir / "timeline.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
