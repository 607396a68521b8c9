"""Figures for the chapter 20 lesson (regenerate with `python tools/figures.py ch20`)."""

from __future__ import annotations

from pathlib import Path

import torch

from chapters.ch20_memory.offload import per_rank_bytes
from chapters.ch20_memory.recompute import STRATEGIES, ResidualMLP, predicted_saved_bytes
from chapters.ch20_memory.train import Config, measure_saved
from common.results import save_figure


def saved_bytes_table(cfg: Config) -> tuple[list[int], list[int]]:
    """(measured by saved-tensor hooks, formula) per strategy, one process, float64."""
    torch.manual_seed(cfg.seed)
    model = ResidualMLP(cfg.d_model, cfg.d_ff, cfg.n_layers).double()
    x = torch.randn(cfg.tokens, cfg.d_model, dtype=torch.float64)
    y = torch.randn(cfg.tokens, cfg.d_model, dtype=torch.float64)
    measured = [measure_saved(model, x, y, s)["saved"] for s in STRATEGIES]
    formula = [predicted_saved_bytes(s, cfg.tokens, cfg.d_model, cfg.d_ff, cfg.n_layers, 8)
               for s in STRATEGIES]
    return measured, formula


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    measured, formula = saved_bytes_table(Config())
    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs = range(len(STRATEGIES))
    ax.bar([x - 0.2 for x in xs], [b / 1024 for b in formula], 0.4, label="formula")
    ax.bar([x + 0.2 for x in xs], [b / 1024 for b in measured], 0.4, label="saved-tensor hooks")
    ax.set_xticks(list(xs), STRATEGIES)
    ax.set_ylabel("KiB held for backward")
    ax.set_title("Activation bytes kept per rank (4 blocks 32x128, 64 tokens)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [fig_dir / "saved_bytes.png"]
    save_figure(fig, paths[0])

    table = per_rank_bytes(psi=1_000_000_000, elem=4, world=8)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(table)
    ax.barh(names, [table[n][0] / 2**30 for n in names], label="device (GPU)")
    ax.barh(names, [table[n][1] / 2**30 for n in names], left=[table[n][0] / 2**30 for n in names],
            label="host (CPU)")
    ax.set_xlabel("GiB per rank: weights + grads + Adam moments")
    ax.set_title("1B parameters, fp32, 8 ranks (no activations)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "offload_bytes.png")
    save_figure(fig, paths[1])
    return paths
