"""Figures for the chapter 16 lesson (`python tools/figures.py ch16`; `--rerun` re-measures).

The running sums are computed at draw time; the accumulation errors and the training run with
its skipped steps are recorded by `measure` in figures/data.json and drawn from there.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from chapters.ch16_stability import precision
from chapters.ch16_stability.train import Config, train
from common.data import regression_data
from common.models import MLP
from common.results import save_figure


def one_process_run(cfg: Config) -> dict:
    """The script's training loop as a world of one (no collectives), for the loss figure."""
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed,
                           dtype=torch.float64)
    X = X.view(cfg.steps, cfg.global_batch_size, cfg.d_in)
    Y = Y.view(cfg.steps, cfg.global_batch_size, 1)
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1).double()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    return train(model, opt, X, Y, cfg, 0, 1, sharded=False)


MEASURE_S = 15


def measure() -> dict:
    run = one_process_run(Config())
    return {"accumulation_errors": precision.accumulation_errors(100_000),
            "run": {"every_loss": [float(x) for x in run["every_loss"]],
                    "skipped_bad": list(run["skipped_bad"]), "spikes": list(run["spikes"])}}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    v, n = 2.0**-10, 2000
    s16, s32 = precision.running_sums(v, n)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(range(1, n + 1), s32, label="fp32 running sum")
    ax.plot(range(1, n + 1), s16, label="bf16 running sum")
    ax.axhline(precision.stagnation_point(v), ls=":", color="gray", label="2⁸·v: stagnation point")
    ax.set_xlabel("terms added (each v = 2⁻¹⁰)")
    ax.set_ylabel("running sum")
    ax.set_title("A bf16 running sum stops growing at 2⁸·v")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "running_sum.png")
    save_figure(fig, paths[-1])

    errors = {k: {**e, "bound": math.inf if e["bound"] is None else e["bound"]}  # JSON: inf -> null
              for k, e in data["accumulation_errors"].items()}
    names = list(errors)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [errors[k]["rel_error"] for k in names], 0.4, label="measured")
    bounded = [x for x, k in zip(xs, names) if errors[k]["bound"] < 1]
    ax.bar([x + 0.2 for x in bounded], [errors[names[x]]["bound"] for x in bounded], 0.4,
           label="worst-case bound (Higham)")
    for x, k in zip(xs, names):
        if errors[k]["bound"] >= 1:
            ax.text(x + 0.2, 1.5e-3, "bound\n≥ 1:\nnone", ha="center", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [k.replace(", ", ",\n").replace(" ", "\n", 1) for k in names], fontsize=7)
    ax.set_ylabel("relative error")
    ax.set_title("Summing 10⁵ values in [0, 10⁻³)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "accumulation_errors.png")
    save_figure(fig, paths[-1])

    run = data["run"]
    losses = [float("nan") if x is None else x for x in run["every_loss"]]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.semilogy(range(len(losses)), [x if math.isfinite(x) else float("nan") for x in losses],
                marker="o", ms=3, label="global loss")
    cfg = Config()
    for s in run["skipped_bad"]:
        what = "inf in a gradient shard" if s == cfg.grad_fault_step else "NaN in a batch"
        ax.axvline(s, color="red" if s == cfg.poison_step else "purple", ls="--",
                   label=f"step {s}: {what}, skipped by all ranks")
    for s in run["spikes"]:
        ax.plot([s], [losses[s]], "x", color="black", ms=9, label=f"step {s}: spike, skipped")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Bad steps are detected and skipped; training goes on")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "loss_skips.png")
    save_figure(fig, paths[-1])
    return paths
