"""Figures for the chapter 07 lesson (regenerate with `python tools/figures.py ch07`).

`alpha_beta.png` is the α–β model (no run needed); `bandwidth.png` runs the benchmark for
real on two CPU processes (about 30 s) and draws bus bandwidth against message size.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from chapters.ch07_communication.cost_model import bus_bandwidth, predicted_time

ALGORITHMS = ("ring", "double_tree", "tree", "naive")


def model_curves(n: int, alpha: float, beta: float, sizes: list[float]) -> dict[str, list[float]]:
    """Predicted all-reduce busbw (GB/s) of each algorithm at each size."""
    return {a: [bus_bandwidth("all_reduce", s, predicted_time(a, s, n, alpha, beta), n) for s in sizes]
            for a in ALGORITHMS}


def draw_bandwidth(ax, rows: list[dict], op: str = "all_reduce") -> None:
    """busbw against size for each implementation of `op` (rows from metrics.jsonl)."""
    for impl in sorted({r["impl"] for r in rows if r["op"] == op}):
        pts = [(r["size"], r["busbw"]) for r in rows if r["op"] == op and r["impl"] == impl]
        ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.legend(fontsize=8)


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    from common.launch import run_torchrun

    fig_dir.mkdir(parents=True, exist_ok=True)
    sizes = [2.0**k for k in range(3, 33)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, n in zip(axes, (8, 512)):
        for name, bw in model_curves(n, 5e-6, 1 / 25e9, sizes).items():
            ax.plot(sizes, bw, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("all-reduce busbw (GB/s)")
        ax.set_title(f"α–β model, {n} ranks (α = 5 µs, 1/β = 25 GB/s)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [fig_dir / "alpha_beta.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(__file__).with_name("train.py")
        run_torchrun(script, nproc=2, args=["--max-bytes", str(32 * 2**20)], out_dir=tmp, timeout=300)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    draw_bandwidth(axes[0], rows, "all_reduce")
    axes[0].set_title("all-reduce, 2 CPU processes (gloo), measured", fontsize=9)
    draw_bandwidth(axes[1], rows, "all_gather")
    draw_bandwidth(axes[1], [dict(r, impl=f"{r['impl']} ({r['op']})") for r in rows
                             if r["op"] in ("reduce_scatter", "broadcast")], "reduce_scatter")
    draw_bandwidth(axes[1], [dict(r, op="x", impl="torch (broadcast)") for r in rows
                             if r["op"] == "broadcast"], "x")
    axes[1].set_title("all-gather, reduce-scatter, broadcast, measured", fontsize=9)
    fig.tight_layout()
    paths.append(fig_dir / "bandwidth.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
