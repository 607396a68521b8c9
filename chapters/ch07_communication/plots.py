"""Figures for the chapter 07 lesson (`python tools/figures.py ch07`; `--rerun` re-measures).

`alpha_beta.png` is the α–β model (no run needed), with the size where the ring starts to beat
the double tree marked; `bandwidth.png` draws bus bandwidth against message size from the
benchmark that `measure` ran for real on two CPU processes (to 32 MiB) and on four (to 2 MiB,
two simulated nodes of two), about a minute, recorded in figures/data.json.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from chapters.ch07_communication.cost_model import (
    bus_bandwidth,
    predicted_time,
    ring_tree_crossover,
)
from common.results import save_figure

ALGORITHMS = ("ring", "double_tree", "tree", "naive")
# one colour per implementation in every panel (ring is the same green everywhere)
IMPL_COLOURS = {"hier": "tab:blue", "naive": "tab:orange", "ring": "tab:green", "torch": "tab:red",
                "tree": "tab:purple", "double_tree": "tab:brown"}
OP_STYLES = {"all_gather": ("o", "-"), "reduce_scatter": ("s", "--"), "broadcast": ("^", ":")}
MEASURE_S = 90
MODEL = dict(alpha=5e-6, beta=1 / 25e9)  # 5 µs, 25 GB/s: a 200 Gb/s InfiniBand link


def model_curves(n: int, alpha: float, beta: float, sizes: list[float]) -> dict[str, list[float]]:
    """Predicted all-reduce busbw (GB/s) of each algorithm at each size."""
    return {a: [bus_bandwidth("all_reduce", s, predicted_time(a, s, n, alpha, beta), n) for s in sizes]
            for a in ALGORITHMS}


def draw_model(ax, n: int, sizes: list[float]) -> None:
    """The α–β model's busbw at n ranks, with the ring/double-tree crossover marked."""
    for name, bw in model_curves(n, MODEL["alpha"], MODEL["beta"], sizes).items():
        ax.plot(sizes, bw, label=name, color=IMPL_COLOURS[name])
    for eta, style in ((1.0, ":"), (0.92, "--")):
        s = ring_tree_crossover(n, MODEL["alpha"], MODEL["beta"], eta)
        if s <= sizes[-1]:
            size = f"{s / 1e9:.3g} GB" if s >= 1e9 else f"{s / 1e6:.3g} MB"
            ax.axvline(s, color="0.3", ls=style, lw=1,
                       label=f"ring wins above {size}" + ("" if eta == 1 else f" (tree at {eta:.0%})"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("all-reduce busbw (GB/s)")
    ax.set_title(f"α–β model, {n} ranks (α = 5 µs, 1/β = 25 GB/s)", fontsize=9)
    ax.legend(fontsize=7)


def draw_bandwidth(ax, rows: list[dict], op: str = "all_reduce", label_op: bool = False) -> None:
    """busbw against size for each implementation of `op` (rows from metrics.jsonl), one colour
    per implementation (IMPL_COLOURS) and, with label_op, one marker and line style per op."""
    marker, line = OP_STYLES.get(op, ("o", "-")) if label_op else ("o", "-")
    for impl in sorted({r["impl"] for r in rows if r["op"] == op}):
        pts = [(r["size"], r["busbw"]) for r in rows if r["op"] == op and r["impl"] == impl]
        ax.plot(*zip(*pts), marker=marker, ls=line, color=IMPL_COLOURS.get(impl, "0.4"), ms=5,
                label=f"{impl} ({op.replace('_', '-')})" if label_op else impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.legend(fontsize=8)


def benchmark_rows(nproc: int, max_bytes: int) -> list[dict]:
    from common.launch import run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(__file__).with_name("train.py")
        run_torchrun(script, nproc=nproc, args=["--max-bytes", str(max_bytes)], out_dir=tmp, timeout=600)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("op", "impl", "size", "busbw")} for r in rows]


def measure() -> dict:
    return {"two_processes": benchmark_rows(2, 32 * 2**20), "four_processes": benchmark_rows(4, 2 * 2**20)}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    sizes = [2.0**k for k in range(3, 36)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, n in zip(axes, (8, 512)):
        draw_model(ax, n, sizes)
    fig.tight_layout()
    paths = [fig_dir / "alpha_beta.png"]
    save_figure(fig, paths[0])

    two, four = data["two_processes"], data["four_processes"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    draw_bandwidth(axes[0], two, "all_reduce")
    axes[0].set_title("all-reduce, 2 CPU processes (gloo), one run", fontsize=9)
    draw_bandwidth(axes[1], four, "all_reduce")
    axes[1].set_title("all-reduce, 4 CPU processes on 2 cores, one run", fontsize=9)
    for op in ("all_gather", "reduce_scatter", "broadcast"):
        draw_bandwidth(axes[2], two, op, label_op=True)
    axes[2].set_title("all-gather, reduce-scatter, broadcast, 2 processes", fontsize=9)
    fig.suptitle("Measured bus bandwidth against message size (colour = implementation)", fontsize=10)
    fig.tight_layout()
    paths.append(fig_dir / "bandwidth.png")
    save_figure(fig, paths[1])
    return paths
