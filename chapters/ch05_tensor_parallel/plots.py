"""Figures for the chapter 05 lesson (regenerate with `python tools/figures.py ch05`)."""

from __future__ import annotations

from pathlib import Path

from common.results import save_figure

COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]


def ring_bytes_per_layer(t: int, B: int, S: int, h: int, b: int) -> float:
    """Bytes one rank sends per layer, forward + backward, on a ring: four all-reduces of
    B·S·h elements at 2(t−1)/t each (with SP: four all-gathers and four reduce-scatters at
    (t−1)/t each, the same total)."""
    return 8 * (t - 1) / t * B * S * h * b


def activation_bytes(t: int, s: int, b: int, h: int, a: int, sequence_parallel: bool) -> float:
    """Bytes one rank keeps for one layer, by Korthikanti et al.'s breakdown (16-bit
    activations, 1-byte dropout masks): see `activations.layer_activation_bytes`."""
    from chapters.ch05_tensor_parallel.activations import layer_activation_bytes

    return layer_activation_bytes(s, b, h, a, t, sequence_parallel)


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


def _sp_panel(ax, t: int = 2) -> None:
    """One layer under sequence parallelism: sequence shards around the TP regions."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    def shards(x, label, seq):
        """A (sequence × hidden) activation: t horizontal slices (seq) or t vertical (heads)."""
        for r in range(t):
            if seq:
                ax.add_patch(Rectangle((x, 2.0 - (r + 1) * 2.0 / t), 0.9, 2.0 / t, color=COLORS[r], ec="white"))
            else:
                ax.add_patch(Rectangle((x + r * 0.9 / t, 0), 0.9 / t, 2.0, color=COLORS[r], ec="white"))
        ax.text(x + 0.45, 2.15, label, ha="center", va="bottom", fontsize=7.5)

    boxes = [(0.0, "LayerNorm\n(S/t rows)", True), (2.2, "X gathered\n(all S rows)", None),
             (3.6, "attention:\nh/t heads", False), (5.8, "dropout +\nresidual\n(S/t rows)", True),
             (7.0, "LayerNorm\n(S/t rows)", True), (9.2, "X gathered", None), (10.6, "MLP:\n4h/t units", False),
             (12.8, "dropout +\nresidual", True)]
    for x, label, seq in boxes:
        if seq is None:
            ax.add_patch(Rectangle((x, 0), 0.9, 2.0, color="#999999"))
            ax.text(x + 0.45, 2.15, label, ha="center", va="bottom", fontsize=7.5)
        else:
            shards(x, label, seq)
    arrows = [(0.95, 2.15, "f̄: all-gather\n(bwd: reduce-scatter)"), (3.15, 3.55, ""),
              (4.55, 5.75, "ḡ: reduce-scatter\n(bwd: all-gather)"), (6.75, 6.95, ""),
              (7.95, 9.15, "f̄"), (10.15, 10.55, ""), (11.55, 12.75, "ḡ")]
    for x0, x1, label in arrows:
        ax.add_patch(FancyArrowPatch((x0, 1.0), (x1, 1.0), arrowstyle="-|>", mutation_scale=10))
        if label:
            ax.text((x0 + x1) / 2, -0.25, label, ha="center", va="top", fontsize=7, style="italic")
    ax.text(6.9, -1.25, f"colours: the {t} ranks. Sequence-sharded regions hold S/t rows of B·S×h; "
            "TP regions hold all rows and 1/t of the heads or MLP units.", ha="center", fontsize=7.5)
    ax.set_xlim(-0.2, 13.9)
    ax.set_ylim(-1.5, 3.0)
    ax.axis("off")
    ax.set_title("Sequence parallelism: one layer, each all-reduce becomes all-gather + reduce-scatter",
                 fontsize=10)


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        fig.tight_layout()
        paths.append(fig_dir / name)
        save_figure(fig, paths[-1])

    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    _split_panel(ax, 2)
    save(fig, "column_row_split.png")

    fig, ax = plt.subplots(figsize=(10, 3.0))
    _sp_panel(ax, 2)
    save(fig, "sequence_parallel.png")

    B, S, h, a, b = 1, 2048, 4096, 32, 2  # a 7B-sized layer, bf16, one sequence per micro-batch
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
        right.plot(degrees, [activation_bytes(t, S, B, h, a, sp) / 2**20 for t in degrees], style,
                   label="TP + SP: (34 + 5as/h)/t" if sp else "TP: 10 + (24 + 5as/h)/t")
    right.axhline(10 * S * B * h / 2**20, color="#999999", lw=0.8, ls=":")
    right.text(16, 10 * S * B * h / 2**20 * 1.05, "10·sbh replicated", ha="right", fontsize=7)
    right.set_xscale("log", base=2)
    right.set_xlabel("tensor-parallel degree t")
    right.set_ylabel("MiB per rank per layer")
    right.set_title("Activations kept, in s·b·h bytes (Korthikanti et al.)", fontsize=10)
    right.legend(fontsize=8)
    fig.suptitle(f"b={B}, s={S}, h={h}, a={a} heads, 16-bit activations, 1-byte dropout masks", fontsize=9)
    save(fig, "bytes_vs_degree.png")
    return paths
