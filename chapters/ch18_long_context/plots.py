"""Figures for the chapter 18 lesson (redraw with `python tools/figures.py ch18`; re-measure with
`python tools/figures.py --rerun ch18`, which runs train.py on 1, 2 and 4 CPU processes)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from chapters.ch18_long_context.layouts import chunk_ids
from chapters.ch18_long_context.ring import TRANSIENT_BLOCKS, ring_bytes_per_rank
from chapters.ch18_long_context.ulysses import ulysses_bytes_per_rank
from common.results import save_figure

MEASURE_S = 120
LENGTHS = [96, 192, 384, 768]
WORLDS = [1, 2, 4]
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]


def run_world(nproc: int) -> dict:
    """train.py on `nproc` CPU processes with a sweep of sequence lengths; the figures it recorded."""
    from chapters.ch18_long_context import train
    from common.launch import run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        res = run_torchrun(Path(train.__file__), nproc=nproc, out_dir=tmp, timeout=600,
                           args=["--sweep-lengths", *map(str, LENGTHS[1:])])
    figs, checks = res.summary["figures"], {c["name"]: c["measured"] for c in res.summary["checks"]}
    return {
        "ms": {m: [figs[f"{m} T={t}: fwd+bwd time (median)"]["measured"] for t in LENGTHS] for m in ("ring", "ulysses")},
        "bytes": {m: [figs[f"{m} T={t}: bytes sent per rank"]["measured"] for t in LENGTHS] for m in ("ring", "ulysses")},
        "products": {lay: checks[f"causal chunk products per rank, {lay}"] for lay in ("contiguous", "zigzag")},
        "longest": [figs[f"longest T in 64 MiB per rank, saved activations, N = {n}"]["expected"]
                    for n in (1, 2, 4)],
        "longest with score blocks": [
            figs[f"longest T in 64 MiB per rank, saved + {TRANSIENT_BLOCKS} score blocks, N = {n}"]["expected"]
            for n in (1, 2, 4)],
        "saved_x_n": checks["activation bytes per rank x N = one rank's"],
        "config": res.summary["config"],
    }


def longest_with_score_blocks(row: dict) -> list[int]:
    """The second series for data recorded before the run reported it: the same formula as
    train.record_activations, from the recorded whole-sequence saved bytes and configuration."""
    from chapters.ch18_long_context.train import longest_sequence

    cfg = row["config"]
    saved_u = row["saved_x_n"] / cfg["seq_len"] * 1.0  # one rank, whole sequence, per token of T/N
    quad = TRANSIENT_BLOCKS * cfg["batch_size"] * cfg["n_head"] * 8 / 2  # float64
    return [int(n * longest_sequence(saved_u, quad, 64 * 2**20)) for n in (1, 2, 4)]


def measure() -> dict:
    return {str(n): run_world(n) for n in WORLDS}


def _work_grid(ax, world: int, layout: str) -> None:
    """The causal (query chunk, key chunk) grid, each computed pair coloured by the rank that owns the query."""
    from matplotlib.patches import Rectangle

    n = 2 * world
    owner = {c: r for r in range(world) for c in chunk_ids(r, world, layout)}
    for q in range(n):
        for k in range(q + 1):
            ax.add_patch(Rectangle((k, n - 1 - q), 1, 1, color=COLORS[owner[q] % 4], ec="white",
                                   alpha=0.55 if k == q else 1.0))
    per_rank = [sum(c + 1 for c in chunk_ids(r, world, layout)) for r in range(world)]
    ax.set_xlim(0, n)
    ax.set_ylim(0, n)
    ax.set_aspect("equal")
    ax.set_xticks([i + 0.5 for i in range(n)], [str(i) for i in range(n)], fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(n)], [str(n - 1 - i) for i in range(n)], fontsize=7)
    ax.set_xlabel("key chunk")
    ax.set_ylabel("query chunk")
    ax.set_title(f"{layout}: chunk products per rank {per_rank}", fontsize=9)


def _ring_panel(ax, world: int) -> None:
    """Which K/V block each rank holds at each step of the ring (colour: the block's owner)."""
    from matplotlib.patches import Rectangle

    for r in range(world):
        for step in range(world):
            src = (r - step) % world
            ax.add_patch(Rectangle((step, world - 1 - r), 1, 1, color=COLORS[src], ec="white"))
            ax.text(step + 0.5, world - 0.5 - r, f"K/V {src}", ha="center", va="center", fontsize=8,
                    color="white")
    ax.set_xlim(0, world)
    ax.set_ylim(0, world)
    ax.set_xticks([s + 0.5 for s in range(world)], [str(s) for s in range(world)])
    ax.set_yticks([world - 0.5 - r for r in range(world)], [f"rank {r}" for r in range(world)])
    ax.set_xlabel("step (a block arrives from the rank above while this one computes)")
    ax.set_title(f"Ring attention on {world} ranks: Q stays, K/V move one rank per step", fontsize=9)


def _ulysses_panel(ax, world: int, heads: int = 8) -> None:
    """Before and after the all-to-all: sequence shards (rows) become head groups (columns)."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    for x0, by_seq in ((0, True), (heads + 3, False)):
        for t in range(world):
            for h in range(heads):
                owner = t if by_seq else h // (heads // world)
                ax.add_patch(Rectangle((x0 + h, world - 1 - t), 1, 1, color=COLORS[owner], ec="white"))
    ax.add_patch(FancyArrowPatch((heads + 0.3, world / 2), (heads + 2.7, world / 2), arrowstyle="-|>",
                                 mutation_scale=14))
    ax.text(heads + 1.5, world / 2 + 0.3, "all-to-all", ha="center", fontsize=8)
    ax.text(heads / 2, -0.6, "T/N tokens, all heads", ha="center", fontsize=8)
    ax.text(heads + 3 + heads / 2, -0.6, "all tokens, H/N heads", ha="center", fontsize=8)
    ax.set_xlim(-0.2, 2 * heads + 3.2)
    ax.set_ylim(-1, world + 0.2)
    ax.axis("off")
    ax.set_title(f"Ulysses on {world} ranks (rows: sequence chunks, columns: heads; colour: rank)",
                 fontsize=9)


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        fig.tight_layout()
        paths.append(fig_dir / name)
        save_figure(fig, paths[-1])

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1, 1.6]})
    _ring_panel(left, 4)
    _ulysses_panel(right, 4)
    save(fig, "ring_and_ulysses.png")

    fig, axes = plt.subplots(1, 2, figsize=(8, 4))
    for ax, layout in zip(axes, ("contiguous", "zigzag")):
        _work_grid(ax, 4, layout)
    fig.suptitle("Causal attention on 4 ranks, sequence in 8 chunks (colour: rank holding the queries; "
                 "pale: diagonal, half masked)", fontsize=8)
    save(fig, "causal_work.png")

    cfg = data["2"]["config"]
    B, H, D = cfg["batch_size"], cfg["heads"], cfg["head_dim"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, n in enumerate((2, 4)):
        row = data[str(n)]
        ring_f = [sum(ring_bytes_per_rank(B, H, t // n, D, 8, n).values()) for t in LENGTHS]
        uly_f = [sum(ulysses_bytes_per_rank(B, H, t // n, D, 8, n).values()) for t in LENGTHS]
        left.plot(LENGTHS, [b / 2**20 for b in ring_f], "-", color=COLORS[2 * i], lw=0.8)
        left.plot(LENGTHS, [b / 2**20 for b in uly_f], "--", color=COLORS[2 * i + 1], lw=0.8)
        left.plot(LENGTHS, [b / 2**20 for b in row["bytes"]["ring"]], "o", color=COLORS[2 * i],
                  label=f"ring, N={n}")
        left.plot(LENGTHS, [b / 2**20 for b in row["bytes"]["ulysses"]], "s", color=COLORS[2 * i + 1],
                  label=f"Ulysses, N={n}")
        for m, style in (("ring", "o-"), ("ulysses", "s--")):
            right.plot(LENGTHS, row["ms"][m], style, color=COLORS[2 * i + (m == "ulysses")],
                       label=f"{'ring' if m == 'ring' else 'Ulysses'}, N={n}")
    right.plot(LENGTHS, data["1"]["ms"]["ring"], "k:", label="one process (ring of one)")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xlabel("sequence length T")
    left.set_ylabel("MiB sent per rank, fwd + bwd")
    left.set_title("Bytes per rank: counted (markers), formula (lines)", fontsize=9)
    left.legend(fontsize=7)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("sequence length T")
    right.set_ylabel("ms, median of 3")
    right.set_title("Time of one causal attention fwd + bwd (CPU, one run)", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle(f"B={B}, H={H} heads of D={D}, float64, gloo on 2 shared cores", fontsize=8)
    save(fig, "bytes_time_vs_length.png")

    fig, ax = plt.subplots(figsize=(6, 3.4))
    saved = data["4"]["longest"]
    with_blocks = data["4"].get("longest with score blocks") or longest_with_score_blocks(data["4"])
    for i, (values, label) in enumerate(((saved, "saved activations only"),
                                         (with_blocks, f"+ {TRANSIENT_BLOCKS} score blocks (T/N)²"))):
        xs = [x + (i - 0.5) * 0.38 for x in range(3)]
        ax.bar(xs, values, width=0.36, color=COLORS[i], label=label)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:,}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(3), [str(n) for n in (1, 2, 4)])
    ax.set_xlabel("ranks N sharing the sequence")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=7)
    ax.set_title("Longest sequence that fits 64 MiB per rank (TinyGPT of the run, float64):\n"
                 "counted saved bytes, with and without ring attention's temporaries", fontsize=9)
    save(fig, "longest_sequence.png")
    return paths
