"""Figures for the chapter 04 lesson (regenerate with `python tools/figures.py ch04`)."""

from __future__ import annotations

from pathlib import Path

from chapters.ch04_model_parallel.schedule import (
    Event,
    bubble_formula,
    bubble_fraction,
    gpipe_order,
    one_f_one_b_order,
    simulate,
)
from common.results import save_figure

COLOURS = {"F": "#4c72b0", "B": "#dd8452"}


def draw_timeline(ax, events: list[Event], n_ranks: int, title: str = "", labels: bool = True) -> None:
    """One row per rank, one box per operation (blue forward, orange backward), idle left white."""
    span = max(e.end for e in events)
    for e in events:
        ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8, color=COLOURS[e.kind],
                edgecolor="white", linewidth=0.5)
        if labels and e.end - e.start >= 0.025 * span:  # skip boxes too narrow for a label
            ax.text((e.start + e.end) / 2, e.rank, f"{e.kind}{e.mb}", ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_ylim(n_ranks - 0.5, -0.5)
    ax.set_title(title, fontsize=10)


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    p, m = 4, 8
    fig, axes = plt.subplots(3, 1, figsize=(9, 6.4), sharex=True)
    for ax, (name, order, n_micro) in zip(axes, [("naive split", gpipe_order, 1),
                                                 ("GPipe", gpipe_order, m),
                                                 ("1F1B", one_f_one_b_order, m)]):
        events = simulate(order(p, n_micro))
        bubble = bubble_fraction(events, p)
        draw_timeline(ax, events, p, f"{name}, p={p}, m={n_micro}: bubble {bubble} = {float(bubble):.2f}")
    axes[-1].set_xlabel("time (one forward or backward = 1 unit)")
    fig.tight_layout()
    paths = [fig_dir / "timelines.png"]
    save_figure(fig, paths[0])

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ms = list(range(1, 33))
    for p in (2, 4, 8):
        counted = [float(bubble_fraction(simulate(gpipe_order(p, k)), p)) for k in ms]
        ax.plot(ms, [float(bubble_formula(p, k)) for k in ms], color="grey", linewidth=0.8)
        ax.plot(ms, counted, "o", markersize=3, label=f"p={p} (counted)")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_title("Counted from the timeline (dots) vs (p−1)/(m+p−1) (lines)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "bubble.png")
    save_figure(fig, paths[1])
    return paths
