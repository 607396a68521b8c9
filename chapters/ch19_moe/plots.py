"""Figures for the chapter 19 lesson: `python tools/figures.py ch19` draws them from figures/data.json;
`python tools/figures.py --rerun ch19` re-measures (one process, about 15 s).

- load_balance.png: max/mean choices per expert (per layer, averaged over the layers) and the
  dropped fraction over training, with and without the balancing loss.
- drops_vs_capacity.png: dropped fraction against the capacity factor for the routers those runs
  learned, beside two formulas (perfect balance; independent uniform routing).
- dispatch.png: expert parallelism on 2 ranks, 4 experts, top-1 (a diagram drawn from a fixed
  example routing).
"""

from __future__ import annotations

import math
from pathlib import Path

from common.results import save_figure

MEASURE_S = 15
SETUP = dict(experts=8, top_k=2, steps=80, micro_batch_size=8, lr=0.1, capacity_factor=1.0)
FACTORS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
WEIGHTS = [0.0, 0.01]


def uniform_drop_fraction(n_tokens: int, n_experts: int, k: int, factor: float) -> float:
    """Expected dropped fraction if each token picked its k distinct experts uniformly at random,
    independently of the other tokens: expert e is among a token's k with probability k/E, so
    its load is Binomial(n, k/E), and the fraction is E·E[max(0, load − C)]/(k·n). (Not
    Binomial(k·n, 1/E): a token's k choices are distinct, not independent.)"""
    n, p = n_tokens, k / n_experts
    cap = math.ceil(factor * k * n / n_experts)
    over = sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) * (j - cap) for j in range(cap + 1, n + 1))
    return n_experts * over / (k * n)


def balanced_drop_fraction(factor: float) -> float:
    """Perfect balance: every expert gets k·n/E choices, so max(0, 1 − factor) of them overflow."""
    return max(0.0, 1.0 - factor)


def measure() -> dict:
    """Train the MoE TinyGPT on one process with and without the balancing loss; then route one
    fresh batch at several capacity factors with each learned router."""
    import torch

    from chapters.ch19_moe import train
    from chapters.ch19_moe.moe_gpt import MoEGPT

    class Info:
        rank, world_size, is_main, device = 0, 1, False, torch.device("cpu")

    cfg = train.Config(steps=SETUP["steps"] + 1, experts_per_rank=SETUP["experts"], top_k=SETUP["top_k"],
                       micro_batch_size=SETUP["micro_batch_size"], lr=SETUP["lr"],
                       capacity_factor=SETUP["capacity_factor"])
    batches = train.make_batches(cfg, 1)
    held_out = tuple(t[-1:].clone() for t in batches[:2])
    train_batches = (batches[0][:-1], batches[1][:-1], batches[2])
    data = {"setup": SETUP, "tokens_per_batch": cfg.micro_batch_size * cfg.seq_len, "runs": {}}
    for weight in WEIGHTS:
        torch.manual_seed(0)
        model = MoEGPT(train.gpt_config(cfg, batches[2]), cfg.d_ff, SETUP["experts"], cfg.top_k,
                       cfg.capacity_factor, "local").double()
        run = train.train(model, train_batches, train.Config(**{**vars(cfg), "aux_weight": weight,
                                                               "steps": SETUP["steps"]}), Info, False)
        drops = []
        with torch.no_grad():
            for factor in FACTORS:
                for layer in model.moe_layers():
                    layer.capacity_factor = factor
                model(held_out[0][0], held_out[1][0])
                routings = [r for layer in model.moe_layers() for r in layer.stats.routings]
                routed, kept = sum(r.routed for r in routings), sum(r.kept for r in routings)
                drops.append(1 - kept.sum().item() / routed.sum().item())
        data["runs"][str(weight)] = {"imbalance": run["imbalance"], "dropped": run["dropped"],
                                     "ce": run["ce"], "drops_vs_capacity": drops}
    return data


COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
EXAMPLE = [[0, 2, 1, 2, 3, 0, 2, 1], [3, 1, 0, 2, 3, 3, 1, 0]]  # top-1 choice of each rank's tokens


def _dispatch_panel(ax, capacity: int = 2) -> None:
    """2 ranks, 4 experts (E0, E1 on rank 0; E2, E3 on rank 1), top-1, 8 tokens per rank,
    capacity factor 1: C = 2."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    segments = []
    for rank, choices in enumerate(EXAMPLE):
        y0 = 5.2 - rank * 5.0
        ax.text(-0.3, y0 + 1.9, f"rank {rank}", fontsize=9, weight="bold")
        taken = [0] * 4
        kept = []
        for i, e in enumerate(choices):  # 1. route: tokens coloured by expert; dropped: hatched
            keep = taken[e] < capacity
            taken[e] += 1
            ax.add_patch(Rectangle((0, y0 + 1.5 - i * 0.45), 0.8, 0.4, color=COLORS[e],
                                   alpha=1.0 if keep else 0.35, hatch=None if keep else "xx"))
            if keep:
                kept.append((e, i))
        ax.text(0.4, y0 - 2.3, "1. route\n(x = dropped)", ha="center", fontsize=7)
        to_rank0 = sum(1 for e, _ in kept if e < 2)
        segments.append([(0, to_rank0), (to_rank0, len(kept) - to_rank0)])
        for j, (e, _token) in enumerate(sorted(kept)):  # 2. sorted by destination expert
            ax.add_patch(Rectangle((2.0, y0 + 1.5 - j * 0.45), 0.8, 0.4, color=COLORS[e]))
        ax.text(2.4, y0 - 2.3, "2. sort by expert;\ncounts all-to-all", ha="center", fontsize=7)
        for k in range(2):  # the experts this rank holds
            e = 2 * rank + k
            ax.add_patch(Rectangle((6.0, y0 + 0.9 - k * 2.2), 1.4, 1.6, color=COLORS[e], alpha=0.8))
            ax.text(6.7, y0 + 1.7 - k * 2.2, f"E{e}", ha="center", va="center", fontsize=10, color="white")
    for src, y0 in ((0, 5.2), (1, 0.2)):  # 3. dispatch: one arrow per (source, destination) segment
        for dst, (first, n_rows) in enumerate(segments[src]):
            y_from = y0 + 1.7 - (first + n_rows / 2) * 0.45
            y_to = 5.2 - dst * 5.0 + 0.6 + (0.5 if src == 0 else -0.5)
            ax.add_patch(FancyArrowPatch((2.9, y_from), (5.9, y_to), arrowstyle="-|>",
                                         mutation_scale=10, color="#555555", lw=0.8))
            ax.text(3.3, y_from + 0.1, f"{n_rows} rows", fontsize=6.5, color="#555555")
    ax.text(4.4, -2.3, "3. dispatch: all_to_all_single,\nuneven splits (counted first)", ha="center", fontsize=7.5)
    ax.text(8.9, 2.6, "4. local experts\n5. combine: all_to_all_single\nback (splits swapped),\n"
            "y = gate · expert(x)", ha="center", fontsize=7.5)
    ax.set_xlim(-0.5, 10.5)
    ax.set_ylim(-2.8, 7.6)
    ax.axis("off")
    ax.set_title(f"Expert parallelism on 2 ranks: 4 experts, top-1, 8 tokens per rank, C = {capacity}",
                 fontsize=10)


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        fig.tight_layout()
        paths.append(fig_dir / name)
        save_figure(fig, paths[-1])

    s = data["setup"]
    labels = {"0.0": "no balancing loss (α = 0)", "0.01": "balancing loss α = 0.01"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for key, run in data["runs"].items():
        left.plot(run["imbalance"], label=labels.get(key, key))
        right.plot(run["dropped"], label=labels.get(key, key))
    left.axhline(1.0, color="#999999", lw=0.8, ls=":")
    left.set_ylabel("max / mean choices per expert\n(per layer, mean over layers)")
    right.set_ylabel(f"dropped fraction (capacity factor {s['capacity_factor']})")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle(f"MoE TinyGPT, {s['experts']} experts, top-{s['top_k']}, SGD lr {s['lr']}, one process "
                 "(measured)", fontsize=9)
    save(fig, "load_balance.png")

    n, E, k = data["tokens_per_batch"], s["experts"], s["top_k"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for key, run in data["runs"].items():
        ax.plot(FACTORS, run["drops_vs_capacity"], "o-", label=f"measured, router trained with {labels.get(key, key)}")
    fine = [0.5 + 0.05 * i for i in range(51)]
    ax.plot(fine, [uniform_drop_fraction(n, E, k, f) for f in fine], "--", color="#555555",
            label=f"formula: uniform random routing, Binomial(n, k/E), n = {n}")
    ax.plot(fine, [balanced_drop_fraction(f) for f in fine], ":", color="#999999",
            label="formula: perfect balance, max(0, 1 − factor)")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("dropped fraction of choices")
    ax.legend(fontsize=7)
    ax.set_title(f"Token dropping against capacity, per layer, {E} experts, top-{k}", fontsize=10)
    save(fig, "drops_vs_capacity.png")

    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    _dispatch_panel(ax)
    save(fig, "dispatch.png")
    return paths
