"""Figures for the chapter 28 lesson (redraw with `python tools/figures.py ch28`). Both are
counted schedules computed at draw time from train.py's default workload: nothing timed."""

from __future__ import annotations

from pathlib import Path

from chapters.ch28_inference import paged as P
from chapters.ch28_inference.train import Config, expected_ratio
from common.results import save_figure


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    cfg = Config()
    fig_dir.mkdir(parents=True, exist_ok=True)
    outs = [o for _, o in P.workload(cfg.requests, cfg.max_out, cfg.seed)]
    paths = []
    batches = [1, 2, 4, 8, 16, 32]
    measured = [P.static_schedule(outs, b)["steps"] / P.continuous_schedule(outs, b)["steps"] for b in batches]
    theory = [expected_ratio(cfg.max_out, b) for b in batches]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(batches, measured, "o-", label=f"counted on the default workload ({cfg.requests} requests)")
    ax.plot(batches, theory, "k--", label="E[max of B] / E[mean], outputs uniform on 1..64")
    ax.axhline(1.5, c="gray", ls=":", label="goal 1.5")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch slots B")
    ax.set_ylabel("continuous / static (decode steps)")
    ax.set_title("Continuous batching gains what static batching pads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "batching.png")
    save_figure(fig, paths[-1])

    s, c = P.static_schedule(outs, cfg.batch), P.continuous_schedule(outs, cfg.batch)
    fig, ax = plt.subplots(figsize=(6.5, 3.0))
    names = ["static", "continuous"]
    ax.barh(names, [s["tokens"], c["tokens"]], label="useful token slots")
    ax.barh(names, [s["padded"], c["padded"]], left=[s["tokens"], c["tokens"]], label="padded / idle slots")
    ax.set_xlabel(f"slots = decode steps x {cfg.batch}")
    ax.set_title(f"{s['steps']} vs {c['steps']} decode steps for the same {s['tokens']} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "slots.png")
    save_figure(fig, paths[-1])
    return paths
