"""Figures of chapter 01, drawn from the calculators (no run needed):

    python tools/figures.py ch01

memory.png         model-state memory vs model size per recipe, against 24/80/141 GB devices,
                   and what the 16 bytes per parameter of a 7B model are made of
time_to_train.png  days to train vs number of devices, 6·N·D at an assumed peak and MFU
"""

from __future__ import annotations

from pathlib import Path

from chapters.ch01_overview import calculators as calc
from common.results import save_figure

DEVICES_GB = {"24 GB (RTX 4090)": 24, "80 GB (A100/H100)": 80, "141 GB (H200)": 141}
H100_BF16_PEAK = 989e12
"""H100 SXM dense bf16 FLOP/s (datasheet, without sparsity)."""


def plot_memory(ax_lines, ax_bars) -> None:
    """Left: GB of model state vs parameters per recipe. Right: a 7B model's state, by part."""
    sizes = [10 ** (8 + i / 4) for i in range(17)]  # 1e8 … 1e12 parameters
    styles = {"fp32_adam": "-", "mixed_adam": "--", "bf16_inference": "-"}
    for recipe, style in styles.items():
        gb = [calc.to_gb(calc.training_state_bytes(n, recipe)) for n in sizes]
        label = f"{recipe} ({calc.bytes_per_param(recipe)} B/param)"
        ax_lines.loglog(sizes, gb, style, label=label, lw=2)
    for (name, gb), color in zip(DEVICES_GB.items(), ("tab:gray", "tab:red", "tab:purple")):
        ax_lines.axhline(gb, color=color, lw=1, ls=":")
        ax_lines.text(sizes[0], gb * 1.1, name, color=color, fontsize=8)
    ax_lines.axvline(7e9, color="k", lw=0.5)
    ax_lines.set(xlabel="parameters N", ylabel="model state, GB (1e9 bytes)",
                 title="Weights + gradients + optimizer (no activations)")
    ax_lines.legend(fontsize=8, loc="lower right")

    for i, recipe in enumerate(calc.RECIPES):
        bottom = 0.0
        for part, gb in calc.state_breakdown_gb(7e9, recipe).items():
            ax_bars.bar(i, gb, bottom=bottom, color="0.85", edgecolor="k")
            if gb >= 10:
                ax_bars.text(i, bottom + gb / 2, f"{part}\n{gb:g} GB", ha="center", va="center",
                             fontsize=7)
            bottom += gb
        ax_bars.text(i, bottom + 2, f"{bottom:g} GB", ha="center", fontsize=9, weight="bold")
    ax_bars.axhline(80, color="tab:red", lw=1, ls=":")
    ax_bars.set_xticks(range(len(calc.RECIPES)), list(calc.RECIPES), fontsize=8)
    ax_bars.set(ylabel="GB", title="7B model: where the bytes go", ylim=(0, 130))


def plot_time_to_train(ax, peak_flops: float = H100_BF16_PEAK, mfu: float = 0.4) -> None:
    """Days to train vs devices for a few (N, D) pairs at `peak_flops` × `mfu` per device."""
    devices = [2**i for i in range(15)]  # 1 … 16384
    runs = {"1B params, 20B tokens": (1e9, 20e9), "7B, 1T tokens": (7e9, 1e12),
            "70B, 2T tokens": (70e9, 2e12), "405B, 15T tokens": (405e9, 15e12)}
    for label, (n, d) in runs.items():
        t = [calc.days(calc.time_to_train_s(n, d, k, peak_flops, mfu)) for k in devices]
        ax.loglog(devices, t, "o-", ms=3, label=f"{label} ({calc.training_flops(n, d):.1e} FLOP)")
    for days, name in ((1, "1 day"), (30, "1 month"), (365, "1 year")):
        ax.axhline(days, color="0.5", lw=0.8, ls=":")
        ax.text(devices[-1], days * 1.1, name, ha="right", fontsize=8, color="0.4")
    ax.set(xlabel="devices", ylabel="days to train (6·N·D / (devices · peak · MFU))",
           title=f"At {peak_flops / 1e12:g} TFLOP/s per device × MFU {mfu:g}")
    ax.legend(fontsize=8)


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir = Path(fig_dir)
    fig_dir.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    plot_memory(a, b)
    fig.tight_layout()
    paths = [fig_dir / "memory.png"]
    save_figure(fig, paths[-1], dpi=110)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    plot_time_to_train(ax)
    fig.tight_layout()
    paths.append(fig_dir / "time_to_train.png")
    save_figure(fig, paths[-1], dpi=110)
    return paths
