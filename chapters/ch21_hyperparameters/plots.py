"""Figures for the chapter 21 lesson (redraw: `python tools/figures.py ch21`; re-measure:
`python tools/figures.py --rerun ch21`)."""

from __future__ import annotations

from pathlib import Path

from chapters.ch21_hyperparameters import schedules as S
from common.results import save_figure

MEASURE_S = 120  # measured: 126 s under load (the seed and problem sweeps, 91 experiments)
DATA_SEEDS = [1000 * k for k in range(1, 11)]  # the same problem (seed 0's w*), other data
PROBLEMS = list(range(10))  # --seed 0-9: ten problems (each its own w*)
RUNS_PER_POINT = 8  # data seeds 1000, 2000, ..., 8000 on each problem, averaged per batch size


def _fit(cfg, data_seed=None) -> dict:
    from chapters.ch21_hyperparameters.scaling import fit_critical_batch, scaling_experiment

    exp = scaling_experiment(cfg, 0, 1, data_seed)
    steps = {b: v["best_steps"] for b, v in exp["table"].items()}
    assert min(steps.values()) >= 0, steps  # every batch size reached the target
    s_min, b_crit = fit_critical_batch(steps)
    return {"steps": list(steps.values()), "s_min": s_min, "b_crit": b_crit, "exp": exp}


def measure() -> dict:
    """The batch-size experiment of train.py's defaults, in one process; the same experiment on
    ten other data seeds of the same problem; and on ten problems, each point the mean of
    RUNS_PER_POINT runs (every run at its own best rate), with each problem's B_noise."""
    from chapters.ch21_hyperparameters.problem import closed_form_noise_scales, target_point
    from chapters.ch21_hyperparameters.scaling import fit_critical_batch
    from chapters.ch21_hyperparameters.train import Config

    cfg = Config()
    default = _fit(cfg)
    exp = default.pop("exp")
    batch = list(exp["table"])
    closed = closed_form_noise_scales(cfg, target_point(cfg))
    seeds = [_fit(cfg, ds) for ds in DATA_SEEDS]
    problems = []
    for p in PROBLEMS:
        pcfg = Config(seed=p)
        runs = [_fit(pcfg, 1000 * k)["steps"] for k in range(1, RUNS_PER_POINT + 1)]
        mean = [sum(r[i] for r in runs) / len(runs) for i in range(len(batch))]
        s_min, b_crit = fit_critical_batch(dict(zip(batch, mean)))
        b_noise = closed_form_noise_scales(pcfg, target_point(pcfg))["b_noise"]
        problems.append({"seed": p, "mean_steps": mean, "s_min": s_min, "b_crit": b_crit,
                         "b_noise_at_target": b_noise})
    return {"batch": batch, "steps": default["steps"],
            "linear": [exp["linear"][b] for b in batch], "s_min": default["s_min"],
            "b_crit": default["b_crit"],
            "b_simple_at_target": closed["b_simple"], "b_noise_at_target": closed["b_noise"],
            "data_seeds": {"seeds": DATA_SEEDS, "steps": [r["steps"] for r in seeds],
                           "b_crit": [r["b_crit"] for r in seeds]},
            "problems": {"runs_per_point": RUNS_PER_POINT, "data_seeds": DATA_SEEDS[:RUNS_PER_POINT],
                         "fits": problems}}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    steps = range(101)
    ax.plot(steps, [S.linear_warmup(s, 1.0, 10) for s in steps], label="linear warm-up (10)")
    ax.plot(steps, [S.cosine(s, 1.0, 100, 10, 0.1) for s in steps], label="warm-up + cosine")
    ax.plot(steps, [S.wsd(s, 1.0, 100, 10, 20, 0.1) for s in steps], "--", label="WSD (decay 20)")
    ax.set_xlabel("step")
    ax.set_ylabel("lr / peak")
    ax.set_title("Schedules (train.py's checks use these parameters)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [fig_dir / "schedules.png"]
    save_figure(fig, paths[0])

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    b, s = data["batch"], data["steps"]
    other = data["data_seeds"]
    for i, steps in enumerate(other["steps"]):
        ax.loglog(b, steps, "-", color="0.75", lw=0.7,
                  label=f"data seeds {other['seeds'][0]}-{other['seeds'][-1]}, same problem"
                  if i == 0 else None)
    ax.loglog(b, s, "o-", label="measured (seed 0), best lr per batch")
    lin = [(x, y) for x, y in zip(b, data["linear"]) if y is not None]
    ax.loglog(*zip(*lin), "s--", label="linear-scaled lr (diverges beyond)")
    fit = [data["s_min"] * (1 + data["b_crit"] / x) for x in b]
    ax.loglog(b, fit, ":", color="gray", label=f"S_min(1+B_crit/B), B_crit={data['b_crit']:.1f}")
    ax.axvline(data["b_simple_at_target"], color="red", lw=0.8,
               label=f"B_simple at target = {data['b_simple_at_target']:.1f} (closed form)")
    ax.axvline(data["b_noise_at_target"], color="purple", lw=0.8, ls="--",
               label=f"B_noise at target = {data['b_noise_at_target']:.1f} (closed form)")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("steps to target loss")
    ax.set_title("Steps to target against batch size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(fig_dir / "batch_scaling.png")
    save_figure(fig, paths[1])
    return paths
