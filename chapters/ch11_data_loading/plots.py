"""Figures for the chapter 11 lesson (`python tools/figures.py ch11`; `--rerun` re-measures).

The throughput figure is drawn from the timings `measure` recorded in figures/data.json; the
shard layouts are counted at draw time.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from chapters.ch11_data_loading.benchmark import Config, run_grid
from chapters.ch11_data_loading.sampling import ShardSampler, epoch_shards
from common.results import save_figure


def shard_layout(n: int = 11, world_size: int = 4, drop_last: bool = False, epochs: int = 2):
    """For each epoch, the rank that reads each position of the padded (or trimmed) list."""
    rows = []
    for epoch in range(epochs):
        shards = epoch_shards(lambda r: ShardSampler(n, world_size, r, drop_last=drop_last),
                              world_size, epoch)
        flat = [(i, r) for pos in range(len(shards[0])) for r, s in enumerate(shards) for i in [s[pos]]]
        rows.append(flat)
    return rows


MEASURE_S = 30


def measure() -> dict:
    """DataLoader throughput for 0, 1, 2 workers (and cached items), and this machine's cores."""
    torch.set_num_threads(1)
    rows = run_grid(Config(workers=[0, 1, 2], items=128, repeats=3), torch.device("cpu"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    keep = ("workers", "pin", "samples_s", "spread")
    return {"cores": cores, "rows": [{k: r[k] for k in keep if k in r} for r in rows]}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    rows, cores = data["rows"], data["cores"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    timed = [r for r in rows if r["workers"] != "cache" and not r["pin"]]
    pts = [(r["workers"], r["samples_s"]) for r in timed]
    ax.errorbar(*zip(*pts), yerr=[[r["samples_s"] - r["spread"][0] for r in timed],
                                  [r["spread"][1] - r["samples_s"] for r in timed]],
                marker="o", capsize=3, label="measured: median, min-max of 3 epochs (pin_memory: n/a on CPU)")
    zero = dict(pts)[0]
    ax.plot([w for w, _ in pts], [zero * min(w, cores) if w else zero for w, _ in pts], ls=":",
            marker="x", label=f"theory: min(w, {cores} cores) x rate at 0 workers")
    cached = next(r["samples_s"] for r in rows if r["workers"] == "cache")
    ax.plot([], [], " ", label=f"cached items, 0 workers: {cached:,.0f} samples/s")
    ax.set_ylim(0, None)
    ax.set_xticks(sorted({r["workers"] for r in rows if r["workers"] != "cache"}))
    ax.set_xlabel("num_workers")
    ax.set_ylabel("samples/s (median of 3 epochs)")
    ax.set_title(f"DataLoader throughput: one run, shared {cores}-core CPU (varies 2x between runs)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "loader_throughput.png")
    save_figure(fig, paths[-1])

    for drop_last, name in ((False, "shards_padded.png"), (True, "shards_drop_last.png")):
        layout = shard_layout(drop_last=drop_last)
        fig, ax = plt.subplots(figsize=(6.5, 1.9))
        colours = plt.get_cmap("tab10")
        for epoch, flat in enumerate(layout):
            seen = set()
            for pos, (i, r) in enumerate(flat):
                repeat = i in seen
                seen.add(i)
                ax.add_patch(plt.Rectangle((pos, -epoch - 0.45), 0.9, 0.9, color=colours(r),
                                           hatch="//" if repeat else None, fill=True, alpha=0.85))
                ax.text(pos + 0.45, -epoch, str(i), ha="center", va="center", fontsize=8,
                        color="white" if not repeat else "black")
        ax.set_xlim(0, 12)
        ax.set_ylim(-len(layout) + 0.4, 0.6)
        ax.set_yticks([-e for e in range(len(layout))], [f"epoch {e}" for e in range(len(layout))])
        ax.set_xticks([])
        mode = "drop_last=True: the tail is dropped" if drop_last else "padding: the head repeats (hatched)"
        ax.set_title(f"11 items on 4 ranks (colour = rank), {mode}", fontsize=9)
        fig.tight_layout()
        paths.append(fig_dir / name)
        save_figure(fig, paths[-1])
    return paths
