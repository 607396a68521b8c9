"""The lesson's figure: how far DDP done right and done wrong drifts from one process; and the
README's generated diff single.py → train.py (make_diff.py).

    python tools/figures.py ch02           # redraws figures/*.png and the README's diff
    python tools/figures.py --rerun ch02   # re-measures figures/data.json first (~15 s)

`measure` starts 2 gloo ranks (`controls.ddp_controls`) and compares the parameters after every
step with one process training on the same global batches; the figure is drawn from what it
recorded.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from chapters.ch02_single_node.controls import VARIANTS, ddp_controls
from chapters.ch02_single_node.make_diff import write_readme
from chapters.ch02_single_node.task import PARITY_TOLERANCE, max_param_diff, reference_state
from common.launch import run_on_ranks
from common.results import save_figure

FIG_DIR = Path(__file__).resolve().parent / "figures"
MEASURE_S = 15
FLOOR = 1e-18  # exact agreement (a difference of 0) is drawn here: a log axis has no 0


def parity_drift(steps: int = 10) -> dict[str, list[float]]:
    """Per variant, max over ranks of max |θ_rank − θ_one process| after each step."""
    ranks = run_on_ranks(ddp_controls, 2, steps=steps, timeout=120)
    cfg = ranks[0]["config"]
    reference = [reference_state(replace(cfg, steps=s + 1), torch.device("cpu"))
                 for s in range(steps)]
    return {v: [max(max_param_diff(r["variants"][v]["history"][s], reference[s]) for r in ranks)
                for s in range(steps)]
            for v in VARIANTS}


def measure() -> dict:
    return {"parity_drift": parity_drift()}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    drift = data["parity_drift"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for (variant, diffs), marker, ls in zip(drift.items(), "osD^v", ["-", "--", "-", ":", "-."],
                                            strict=True):
        steps = range(1, len(diffs) + 1)
        ax.semilogy(steps, [max(d, FLOOR) for d in diffs], marker=marker, ls=ls,
                    label=VARIANTS[variant])
    ax.axhline(PARITY_TOLERANCE["float64"], color="k", ls="--", lw=1, label="tolerance 1e-12")
    ax.set_ylim(FLOOR / 10, 1e6)  # the summed loss diverges (24× the step size) off the top
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max over ranks |θ_rank − θ_one process|")
    ax.set_title("2 ranks vs one process on the same global batch (float64)")
    ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    path = fig_dir / "parity_drift.png"
    save_figure(fig, path, dpi=110)
    # the README's diff is rewritten only when drawing into the chapter itself
    return [path, write_readme()] if fig_dir.resolve() == FIG_DIR else [path]
