"""Figures for the chapter 17 lesson (regenerate with `python tools/figures.py ch17`)."""

from __future__ import annotations

from pathlib import Path

from chapters.ch04_model_parallel.plots import draw_timeline
from chapters.ch04_model_parallel.schedule import (
    bubble_fraction,
    gpipe_order,
    one_f_one_b_order,
    simulate,
)
from chapters.ch17_pipeline_balance.partition import (
    balanced_partition,
    stage_costs,
    uniform_partition,
)
from chapters.ch17_pipeline_balance.schedules import interleaved_order, peak_in_flight
from chapters.ch17_pipeline_balance.train import Config, block_flops, model_widths
from common.results import save_figure


def partition_timelines(p: int = 2, m: int = 4):
    """1F1B on the default skewed model, uniform vs balanced cut, costs in MFLOPs per sample
    (backward = 2 × forward): {label: (bounds, events)}."""
    cfg = Config()
    flops = [f / 3e6 for f in block_flops(model_widths(cfg, p), cfg.d_model)]  # forward: 1/3 of fwd+bwd
    out = {}
    for label, bounds in (("uniform", uniform_partition(len(flops), p)),
                          ("balanced", balanced_partition(flops, p))):
        costs = stage_costs(flops, bounds)
        out[label] = bounds, simulate(one_f_one_b_order(p, m), f_cost=costs, b_cost=[2 * c for c in costs])
    return out


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(2, 1, figsize=(9, 3.4), sharex=True)
    for ax, (label, (bounds, events)) in zip(axes, partition_timelines().items()):
        span = max(e.end for e in events)
        draw_timeline(ax, events, 2, f"1F1B, {label} cut {bounds}: step {span:.2f} MFLOP-units, "
                                     f"bubble {float(bubble_fraction(events, 2)):.2f}")
    axes[-1].set_xlabel("time (forward cost of each stage in MFLOPs per sample; backward = 2x)")
    fig.tight_layout()
    paths.append(fig_dir / "partition.png")
    save_figure(fig, paths[-1])

    p, m, v = 4, 8, 2
    runs = [("GPipe", simulate(gpipe_order(p, m)), 1),
            ("1F1B", simulate(one_f_one_b_order(p, m)), 1),
            (f"interleaved 1F1B, v={v} (chunk = half a stage)", simulate(interleaved_order(p, m, v), 0.5, 0.5), v)]
    fig, axes = plt.subplots(3, 1, figsize=(9, 6.4), sharex=True)
    for ax, (name, events, chunks) in zip(axes, runs):
        peak = max(peak_in_flight(events, r, chunks) for r in range(p))
        draw_timeline(ax, events, p, f"{name}, p={p}, m={m}: bubble {float(bubble_fraction(events, p)):.3f}, "
                                     f"peak activations {peak:g} micro-batches", labels=chunks == 1)
    axes[-1].set_xlabel("time (a full stage's forward or backward = 1 unit)")
    fig.tight_layout()
    paths.append(fig_dir / "schedules.png")
    save_figure(fig, paths[-1])
    return paths
