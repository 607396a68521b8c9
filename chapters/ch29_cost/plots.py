"""Figures for the chapter 29 lesson (redraw with `python tools/figures.py ch29`; re-simulate
with `python tools/figures.py --rerun ch29`). The simulated points come from figures/data.json
(seeded, recorded by `measure`); the curves are formulas drawn at draw time."""

from __future__ import annotations

from pathlib import Path

from chapters.ch29_cost import cost as C
from chapters.ch29_cost import waste as W
from chapters.ch29_cost.train import Config, layouts
from common.results import save_figure

MEASURE_S = 10
TAUS_H = [0.15, 0.25, 0.4, 0.6, 0.9, 1.4, 2.0, 3.0]
SEEDS = 3000


def measure() -> dict:
    """Mean simulated waste (and its standard error) at each τ, the script's default job."""
    cfg, H = Config(), C.HOUR
    rows = []
    for tau in TAUS_H:
        sums = W.simulate_waste(cfg.work_h * H, tau * H, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H,
                                range(SEEDS))
        mean, se = W.mean_and_se(*sums[:3])
        rows.append({"tau_h": tau, "mean_h": mean / H, "se_h": se / H})
    return {"seeds": SEEDS, "rows": rows}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    cfg, H = Config(), C.HOUR
    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    args = (cfg.save_s, cfg.restart_s, cfg.mtbf_h * H)
    grid = [0.1 + 0.02 * i for i in range(150)]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(grid, [W.expected_waste(cfg.work_h * H, t * H, *args) / H for t in grid], "k-",
            label="Daly's model (exact for this process)")
    ax.plot(grid, [cfg.work_h * W.first_order_overhead(t * H, *args) for t in grid], "k:",
            label="Young's first-order model")
    rows = data["rows"]
    ax.errorbar([r["tau_h"] for r in rows], [r["mean_h"] for r in rows],
                yerr=[4 * r["se_h"] for r in rows], fmt="o", color="#c44e52",
                label=f"simulated, mean of {data['seeds']} seeds (± 4 SE)")
    ax.axvline(W.young_interval(cfg.save_s, cfg.mtbf_h * H) / H, color="#4c72b0", ls="--",
               label="Young sqrt(2δM)")
    ax.axvline(W.daly_interval(cfg.save_s, cfg.mtbf_h * H) / H, color="#55a868", ls="--",
               label="Daly")
    ax.set_xlabel("checkpoint interval τ (hours of work)")
    ax.set_ylabel(f"waste in a {cfg.work_h:g} h run (h)")
    ax.set_title(f"δ = {cfg.save_s:g} s, R = {cfg.restart_s:g} s, M = {cfg.mtbf_h:g} h")
    ax.set_ylim(0, None)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(fig_dir / "waste.png")
    save_figure(fig, paths[-1])

    inst = C.instance(cfg.instance)
    model = C.Model(cfg.n_params, cfg.n_layers, cfg.d_model, cfg.seq_len)
    lay = [(d, t, p) for d, t, p in layouts(cfg) if p in (1, 4)]
    res = [C.layout_times(model, inst, d, t, p, cfg.micro_batch, cfg.global_batch, cfg.mfu)
           for d, t, p in lay]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    names = [f"dp{d} tp{t} pp{p}" for d, t, p in lay]
    left = [0.0] * len(lay)
    for key, color in (("tp_s", "#4c72b0"), ("dp_s", "#dd8452"), ("pp_s", "#55a868")):
        vals = [r[key] / r["compute_s"] for r in res]
        ax.barh(names, vals, left=left, color=color, label=key[:2] + " communication")
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("communication ÷ compute per step (formula, no overlap)")
    ax.set_title(f"{cfg.n_params:.0e} parameters on {cfg.n_gpus} GPUs of {inst.name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "layouts.png")
    save_figure(fig, paths[-1])
    return paths
