"""Figures for the chapter 21 lesson (redraw: `python tools/figures.py ch21`; re-measure:
`python tools/figures.py --rerun ch21`)."""

from __future__ import annotations

from pathlib import Path

from chapters.ch21_hyperparameters import schedules as S
from common.results import save_figure

MEASURE_S = 10


def measure() -> dict:
    """The batch-size experiment of train.py's defaults, in one process."""
    from chapters.ch21_hyperparameters.train import (
        Config,
        closed_form_noise_scales,
        fit_critical_batch,
        scaling_experiment,
        target_point,
    )

    cfg = Config()
    exp = scaling_experiment(cfg, 0, 1)
    steps = {b: v["best_steps"] for b, v in exp["table"].items()}
    s_min, b_crit = fit_critical_batch(steps)
    closed = closed_form_noise_scales(cfg, target_point(cfg))
    return {"batch": list(steps), "steps": list(steps.values()),
            "linear": [exp["linear"][b] for b in steps], "s_min": s_min, "b_crit": b_crit,
            "b_simple_at_target": closed["b_simple"], "b_noise_at_target": closed["b_noise"]}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    steps = range(101)
    ax.plot(steps, [S.linear_warmup(s, 1.0, 10) for s in steps], label="linear warm-up (10)")
    ax.plot(steps, [S.cosine(s, 1.0, 100, 10, 0.1) for s in steps], label="warm-up + cosine")
    ax.plot(steps, [S.wsd(s, 1.0, 100, 10, 20, 0.1) for s in steps], "--", label="WSD (decay 20)")
    ax.set_xlabel("step")
    ax.set_ylabel("lr / peak")
    ax.set_title("Schedules (train.py's checks use these parameters)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [fig_dir / "schedules.png"]
    save_figure(fig, paths[0])

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    b, s = data["batch"], data["steps"]
    ax.loglog(b, s, "o-", label="measured, best lr per batch")
    lin = [(x, y) for x, y in zip(b, data["linear"]) if y is not None]
    ax.loglog(*zip(*lin), "s--", label="linear-scaled lr (diverges beyond)")
    fit = [data["s_min"] * (1 + data["b_crit"] / x) for x in b]
    ax.loglog(b, fit, ":", color="gray", label=f"S_min(1+B_crit/B), B_crit={data['b_crit']:.1f}")
    ax.axvline(data["b_simple_at_target"], color="red", lw=0.8,
               label=f"B_simple at target = {data['b_simple_at_target']:.1f} (closed form)")
    ax.axvline(data["b_noise_at_target"], color="purple", lw=0.8, ls="--",
               label=f"B_noise at target = {data['b_noise_at_target']:.1f} (closed form)")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("steps to target loss")
    ax.set_title("Steps to target against batch size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(fig_dir / "batch_scaling.png")
    save_figure(fig, paths[1])
    return paths
