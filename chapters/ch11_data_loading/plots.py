"""Figures for the chapter 11 lesson (`python tools/figures.py ch11`; `--rerun` re-measures).

The throughput figure is drawn from the timings `measure` recorded in figures/data.json (every
run, with its spread and the machine's load); the shard layouts are counted at draw time.
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


RUNS = 5
MEASURE_S = 60


def measure() -> dict:
    """DataLoader throughput and stall for 0, 1, 2 workers (and cached items), RUNS times in a
    row, each with the machine's 1-minute load average before and after it: on a shared machine
    the runs differ, and the figure shows every one."""
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    keep = ("workers", "pin", "samples_s", "spread", "stall")
    runs = []
    for _ in range(RUNS):
        before = os.getloadavg()[0]
        rows = run_grid(Config(workers=[0, 1, 2], items=128, repeats=3), torch.device("cpu"))
        runs.append({"load_1min": [round(before, 2), round(os.getloadavg()[0], 2)],
                     "rows": [{k: r[k] for k in keep if k in r} for r in rows]})
    return {"cores": cores, "runs": runs}


def run_table(data: dict) -> list[dict]:
    """Per run: samples/s and stall at 0, 1, 2 workers, the 2-vs-0 ratio, the cached rate and
    the load (what the lesson's table quotes)."""
    table = []
    for run in data["runs"]:
        by = {r["workers"]: r for r in run["rows"]}
        table.append({"samples_s": [by[w]["samples_s"] for w in (0, 1, 2)],
                      "stall": [by[w]["stall"] for w in (0, 1, 2)],
                      "ratio_2_vs_0": by[2]["samples_s"] / by[0]["samples_s"],
                      "cached": by["cache"]["samples_s"], "load_1min": run["load_1min"]})
    return table


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import statistics

    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    cores, runs = data["cores"], data["runs"]
    fig, ax = plt.subplots(figsize=(8.6, 3.6))
    workers = [0, 1, 2]
    for i, run in enumerate(runs):
        by = {r["workers"]: r for r in run["rows"]}
        x = [w + (i - (len(runs) - 1) / 2) * 0.06 for w in workers]  # side by side, not on top
        y = [by[w]["samples_s"] for w in workers]
        err = [[by[w]["samples_s"] - by[w]["spread"][0] for w in workers],
               [by[w]["spread"][1] - by[w]["samples_s"] for w in workers]]
        a, b = run["load_1min"]
        ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=2, lw=1,
                    label=f"run {i + 1} (load {a:.1f} → {b:.1f})")
    zero = statistics.median(next(r["samples_s"] for r in run["rows"] if r["workers"] == 0)
                             for run in runs)
    ax.plot(workers, [zero * min(w, cores) if w else zero for w in workers], ls=":", color="k",
            marker="x", label=f"theory: min(w, {cores} cores) x median rate at 0 workers")
    cached = [next(r["samples_s"] for r in run["rows"] if r["workers"] == "cache") for run in runs]
    ax.plot([], [], " ", label=f"cached items, 0 workers: {min(cached):,.0f}-{max(cached):,.0f} "
                               "samples/s")
    ax.set_ylim(0, None)
    ax.set_xticks(workers)
    ax.set_xlabel("num_workers (pin_memory: n/a on CPU)")
    ax.set_ylabel("samples/s: median, min-max of 3 epochs")
    ax.set_title(f"DataLoader throughput: {len(runs)} runs in a row on a shared {cores}-core CPU\n"
                 "(load: the machine's 1-minute load average before and after each run)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside, not over
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
