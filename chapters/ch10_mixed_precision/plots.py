"""Figures for the chapter 10 lesson (`python tools/figures.py ch10`; `--rerun` re-measures).

`measure` trains the script's model in one process (four precisions) and traces three loss
scalers; figures/data.json holds what it recorded and the figures are drawn from it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from chapters.ch10_mixed_precision import checks, loss_scaler, train
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.models import MLP
from common.results import save_figure


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


MEASURE_S = 20
INF_STEPS = (5, 6, 12)
SCALERS = (("GradScaler", "-o"), ("hand scaler", "--x"), ("never backs off (broken)", ":"))


def scale_traces(cfg: train.Config) -> dict[str, dict]:
    """Loss scale per step and steps skipped of each scaler on the script's data and model
    (seed 0), its first TRACE_STEPS steps, with an inf injected at INF_STEPS."""
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed)
    X = X.view(cfg.steps, -1, cfg.d_in)[:checks.TRACE_STEPS]
    Y = Y.view(cfg.steps, -1, 1)[:checks.TRACE_STEPS]
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1)
    scalers = {"GradScaler": torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3),
               "hand scaler": loss_scaler.DynamicLossScaler(2.0**12, growth_interval=3),
               "never backs off (broken)": loss_scaler.DynamicLossScaler(
                   2.0**12, backoff_factor=1.0, growth_interval=3)}
    traces = {}
    for name, scaler in scalers.items():
        trace = loss_scaler.scaler_trace(model, X, Y, scaler, set(INF_STEPS))
        traces[name] = {"scales": [float(x) for x in trace["scales"]], "skipped": trace["skipped"]}
    return traces


def measure() -> dict:
    cfg = train.Config()
    return {"loss_curves": {k: [float(x) for x in v] for k, v in loss_curves(cfg).items()},
            "scale_traces": scale_traces(cfg)}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    curves = data["loss_curves"]
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(losses, label=name, ls="--" if "no master" in name else "-", color=f"C{i}")
        if name != "fp32":
            gap.semilogy([abs(a - b) / b + 1e-9 for a, b in zip(losses, curves["fp32"])],
                         label=name, color=f"C{i}")
    gap.axhline(checks.LOSS_TOL["bf16"], color="grey", ls=":", label="bf16 tolerance")
    ax.set(xlabel="step", ylabel="training loss", title="Same model, same data, four precisions")
    gap.set(xlabel="step", ylabel="|loss − fp32 loss| / fp32 loss", title="Gap to fp32")
    ax.legend(fontsize=8)
    gap.legend(fontsize=8)
    fig.tight_layout()
    paths = [fig_dir / "loss_curves.png"]
    save_figure(fig, paths[0])

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name, style in SCALERS:
        trace = data["scale_traces"][name]
        ax.semilogy(trace["scales"], style, label=f"{name}, skipped {trace['skipped']}", ms=4)
    for s in INF_STEPS:
        ax.axvline(s, color="red", alpha=0.2)
    ax.set(xlabel="step", ylabel="loss scale", title="Dynamic loss scaling (red: injected inf)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(fig_dir / "loss_scale.png")
    save_figure(fig, paths[1])
    return paths
