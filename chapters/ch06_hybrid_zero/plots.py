"""Figures for the chapter 06 lesson (regenerate with `python tools/figures.py ch06`)."""

from __future__ import annotations

from pathlib import Path

import torch

from chapters.ch06_hybrid_zero import memory, zeropp

PARTS = (("params", "parameters"), ("grads", "gradients"), ("optim", "optimizer states"))


def stage_bars(ax, psi: int, world: int, b: float, k: float, scale: float, unit: str, title: str):
    """Stacked bars of per-rank bytes (parameters, gradients, optimizer states) per stage."""
    bottoms = [0.0] * 4
    for key, label in PARTS:
        heights = [memory.per_rank_bytes(s, psi, world, b, b, k)[key] / scale for s in range(4)]
        ax.bar(memory.STAGES, heights, bottom=bottoms, label=label)
        bottoms = [a + h for a, h in zip(bottoms, heights)]
    for x, total in enumerate(bottoms):
        ax.annotate(f"{total:.3g}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    from chapters.ch06_hybrid_zero.train import Config, build_model, global_batches

    fig_dir.mkdir(parents=True, exist_ok=True)
    cfg = Config()
    _, _, vocab = global_batches(cfg, torch.device("cpu"))
    psi = sum(p.numel() for p in build_model(cfg, vocab, torch.device("cpu")).parameters()
              if p.requires_grad)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    stage_bars(axes[0], int(7.5e9), 64, 2, 12, 1e9, "GB per device",
               "ZeRO paper: Ψ = 7.5B, N_d = 64, fp16 + Adam (K = 12)")
    stage_bars(axes[1], psi, 2, 8, 16, 1e3, "kB per rank",
               f"This chapter: tiny GPT, Ψ = {psi}, 2 ranks, float64 Adam (K = 16)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths = [fig_dir / "memory_per_stage.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, generator=g, dtype=torch.float64) * torch.linspace(0.1, 2, 512, dtype=torch.float64)
    q, scale = zeropp.quantize_blockwise(x, 64)
    err = (x - zeropp.dequantize_blockwise(q, scale, 512, torch.float64)).abs()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(err.numpy(), ".", ms=2, label="|x − x̂| (int8, blocks of 64)")
    ax.step(range(512), (scale.double().repeat_interleave(64) / 2).numpy(), where="post",
            color="C3", label="bound: scale / 2 = max|x| / 254 per block")
    ax.set_xlabel("weight index")
    ax.set_ylabel("absolute error")
    ax.set_title("ZeRO++ qwZ: block-wise int8 weights stay within half a step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "qwz_error.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
