"""Figures for the chapter 05 lesson (regenerate with `python tools/figures.py ch05`)."""

from __future__ import annotations

from pathlib import Path

COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]


def ring_bytes_per_layer(t: int, B: int, S: int, h: int, b: int) -> float:
    """Bytes one rank sends per layer, forward + backward, on a ring: four all-reduces of
    B·S·h elements at 2(t−1)/t each (with SP: four all-gathers and four reduce-scatters at
    (t−1)/t each, the same total)."""
    return 8 * (t - 1) / t * B * S * h * b


def norm_region_bytes(t: int, B: int, S: int, h: int, b: int, sequence_parallel: bool) -> float:
    """Activations one rank keeps for the LayerNorm + dropout regions of a layer (two
    LayerNorm inputs, two dropout outputs and masks ≈ 4·B·S·h values): replicated without SP,
    1/t of them with SP."""
    return 4 * B * S * h * b / (t if sequence_parallel else 1)


def _split_panel(ax, t: int) -> None:
    """X (B·S × h) times A (h × 4h, split by columns) then B (4h × h, split by rows)."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    ax.add_patch(Rectangle((0, 0), 1.0, 2.0, color="#999999"))
    ax.text(0.5, 2.15, "X\n(replicated)", ha="center", fontsize=8)
    for r in range(t):  # A: columns per rank
        ax.add_patch(Rectangle((1.6 + r * 2.0 / t, 0.5), 2.0 / t, 1.0, color=COLORS[r], ec="white"))
    ax.text(2.6, 1.65, "A = [A₁ A₂ …] column split", ha="center", fontsize=8)
    for r in range(t):  # B: rows per rank
        ax.add_patch(Rectangle((4.4, 1.5 - (r + 1) * 2.0 / t + 0.5), 1.0, 2.0 / t, color=COLORS[r], ec="white"))
    ax.text(4.9, 2.65, "B = [B₁; B₂; …]\nrow split", ha="center", fontsize=8)
    ax.add_patch(Rectangle((6.2, 0), 1.0, 2.0, color="#999999"))
    ax.text(6.7, 2.15, "Y = Σ_r GeLU(X A_r) B_r", ha="center", fontsize=8)
    ax.add_patch(FancyArrowPatch((3.65, 1.0), (4.35, 1.0), arrowstyle="-|>", mutation_scale=12))
    ax.text(4.0, 0.2, "GeLU\nlocal", ha="center", fontsize=7)
    for x0, x1, label in ((1.05, 1.55, "f"), (5.5, 6.15, "g")):
        ax.add_patch(FancyArrowPatch((x0, 1.0), (x1, 1.0), arrowstyle="-|>", mutation_scale=12))
        ax.text((x0 + x1) / 2, 0.7, label, ha="center", fontsize=11, style="italic")
    ax.text(3.7, -0.45, "f: identity forward, all-reduce backward    "
            "g: all-reduce forward, identity backward", ha="center", fontsize=8)
    ax.set_xlim(-0.2, 7.6)
    ax.set_ylim(-0.7, 3.2)
    ax.axis("off")
    ax.set_title(f"Megatron MLP on {t} ranks: one all-reduce per forward", fontsize=10)


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    _split_panel(ax, 2)
    fig.tight_layout()
    paths = [fig_dir / "column_row_split.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    B, S, h, b = 8, 2048, 4096, 2  # a 7B-sized layer in bf16
    degrees = [1, 2, 4, 8, 16]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot(degrees, [ring_bytes_per_layer(t, B, S, h, b) / 2**20 for t in degrees], "o-",
              label="TP = TP+SP (ring)")
    left.set_xscale("log", base=2)
    left.set_xlabel("tensor-parallel degree t")
    left.set_ylabel("MiB sent per rank per layer")
    left.set_title("Communication: 8(t−1)/t · B·S·h·b", fontsize=10)
    left.legend(fontsize=8)
    for sp, style in ((False, "o-"), (True, "s--")):
        right.plot(degrees, [norm_region_bytes(t, B, S, h, b, sp) / 2**20 for t in degrees], style,
                   label="with sequence parallelism" if sp else "TP only (replicated)")
    right.set_xscale("log", base=2)
    right.set_xlabel("tensor-parallel degree t")
    right.set_ylabel("MiB per rank per layer")
    right.set_title("LayerNorm/dropout activations held", fontsize=10)
    right.legend(fontsize=8)
    fig.suptitle(f"B={B}, S={S}, h={h}, bf16", fontsize=9)
    fig.tight_layout()
    paths.append(fig_dir / "bytes_vs_degree.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
