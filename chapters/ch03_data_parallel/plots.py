"""Figures for the chapter 03 lesson (regenerate with `python tools/figures.py ch03`)."""

from __future__ import annotations

from pathlib import Path

import torch

from chapters.ch03_data_parallel.data_parallel import micro_batches
from chapters.ch03_data_parallel.token_loss import token_batches
from chapters.ch03_data_parallel.train import Config, scaled_lr
from common.results import save_figure


def token_weights(cfg: Config, world_size: int) -> tuple[list[str], list[float], list[float], float]:
    """Weight of one token in the step's loss, per (rank, micro-batch): naive per-batch mean
    1/(world·k·n_j) against the global-token normalisation 1/N (what one process uses)."""
    _, _, mask = token_batches(cfg, torch.device("cpu"))
    k = cfg.grad_accum_steps
    total = mask[0].sum().item()
    labels, counts = [], []
    for r in range(world_size):
        for j, m in enumerate(micro_batches(mask[0], r, world_size, k)):
            labels.append(f"rank {r}\nmicro {j}")
            counts.append(m.sum().item())
    naive = [1 / (world_size * k * n) for n in counts]
    return labels, counts, naive, 1 / total


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    cfg = Config(steps=1, global_batch_size=16)
    labels, counts, naive, correct = token_weights(cfg, world_size=2)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [w * 1e3 for w in naive], 0.4, label="naive per-batch mean")
    ax.bar([x + 0.2 for x in xs], [correct * 1e3] * len(xs), 0.4, label="global token count")
    for x, n in zip(xs, counts):
        ax.annotate(f"{int(n)} tokens", (x, 0), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8, color="white")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("weight of one token (×10⁻³)")
    ax.set_title("Uneven micro-batches: who counts how much in the loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [fig_dir / "token_weights.png"]
    save_figure(fig, paths[0])

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for batch in (256, 1024, 4096):
        c = Config(base_lr=0.1, base_batch_size=256, global_batch_size=batch, warmup_steps=20)
        ax.plot(range(40), [scaled_lr(s, c) for s in range(40)], label=f"global batch {batch}")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("Linear scaling rule with warm-up (base: lr 0.1 at batch 256)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "lr_schedule.png")
    save_figure(fig, paths[1])
    return paths
