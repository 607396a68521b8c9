"""Figures for the chapter 10 lesson (regenerate with `python tools/figures.py ch10`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from chapters.ch10_mixed_precision import loss_scaler, train
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.models import MLP


def loss_curves(cfg: train.Config) -> dict[str, list[float]]:
    """fp32, bf16, fp16 and bf16 without master weights, one process (a world of one)."""
    info = setup_distributed("cpu")
    try:
        X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed)
        X, Y = X.view(cfg.steps, -1, cfg.d_in), Y.view(cfg.steps, -1, 1)
        torch.manual_seed(cfg.seed)
        model = MLP(cfg.d_in, cfg.d_hidden, 1)
        curves = {p: train.train_ddp(copy.deepcopy(model), X, Y, cfg, info, p)["losses"]
                  for p in ("fp32", "bf16", "fp16")}
        curves["bf16 weights, no master copy"] = train.train_ddp(
            copy.deepcopy(model), X, Y, cfg, info, "bf16", master_weights=False)["losses"]
        return curves
    finally:
        teardown_distributed()


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    cfg = train.Config()
    curves = loss_curves(cfg)
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(losses, label=name, ls="--" if "no master" in name else "-", color=f"C{i}")
        if name != "fp32":
            gap.semilogy([abs(a - b) / b + 1e-9 for a, b in zip(losses, curves["fp32"])],
                         label=name, color=f"C{i}")
    gap.axhline(train.LOSS_TOL["bf16"], color="grey", ls=":", label="bf16 tolerance")
    ax.set(xlabel="step", ylabel="training loss", title="Same model, same data, four precisions")
    gap.set(xlabel="step", ylabel="|loss − fp32 loss| / fp32 loss", title="Gap to fp32")
    ax.legend(fontsize=8)
    gap.legend(fontsize=8)
    fig.tight_layout()
    paths = [fig_dir / "loss_curves.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    # the script's data and model (seed 0), its first TRACE_STEPS steps
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed)
    X = X.view(cfg.steps, -1, cfg.d_in)[:train.TRACE_STEPS]
    Y = Y.view(cfg.steps, -1, 1)[:train.TRACE_STEPS]
    torch.manual_seed(cfg.seed)
    model, inf_steps = MLP(cfg.d_in, cfg.d_hidden, 1), {5, 6, 12}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name, scaler, style in (
            ("GradScaler", torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3), "-o"),
            ("hand scaler", loss_scaler.DynamicLossScaler(2.0**12, growth_interval=3), "--x"),
            ("never backs off (broken)", loss_scaler.DynamicLossScaler(
                2.0**12, backoff_factor=1.0, growth_interval=3), ":")):
        trace = loss_scaler.scaler_trace(model, X, Y, scaler, inf_steps)
        ax.semilogy(trace["scales"], style, label=f"{name}, skipped {trace['skipped']}", ms=4)
    for s in inf_steps:
        ax.axvline(s, color="red", alpha=0.2)
    ax.set(xlabel="step", ylabel="loss scale", title="Dynamic loss scaling (red: injected inf)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(fig_dir / "loss_scale.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
