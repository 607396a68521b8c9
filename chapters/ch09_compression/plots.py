"""Figures for the chapter 09 lesson (`python tools/figures.py ch09`; `--rerun` re-measures).

They are drawn from a real run recorded in figures/data.json by `measure`: train.py on two CPU
processes, every method. `calibrate` records in figures/calibration.json each method's final
loss over dense training's at every world size the lesson's commands use, over four seeds: the
runs that set the loss tolerance (slow, about an hour on two cores; run it by hand):

    ./course python -c "from chapters.ch09_compression import plots; plots.calibrate()"
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common.results import save_figure

MEASURE_S = 30
STYLE = {"dense": ("black", "-"), "fp16": ("grey", ":"), "bf16": ("silver", ":"),
         "topk": ("tab:blue", "-"), "topk_no_ef": ("tab:blue", "--"), "qsgd": ("tab:green", "-"),
         "signsgd": ("tab:red", "-"), "signsgd_no_ef": ("tab:red", "--"),
         "majority_vote": ("tab:orange", "-."),
         "powersgd": ("tab:purple", "-"), "powersgd_builtin": ("tab:purple", ":")}


def draw(curves: dict, summary: dict, fig_dir: Path) -> list[Path]:
    """Loss curves of every method and the compression ratio beside the final loss (from the
    run's summary.json figures)."""
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, losses in curves.items():
        colour, line = STYLE.get(method, ("tab:orange", "-"))
        width = 3 if method == "dense" else 1.4  # under the others: they track it
        ax.plot(range(1, len(losses) + 1), list(losses), line, color=colour, label=method,
                linewidth=width, zorder=1 if method == "dense" else 2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (whole data set)")
    ax.set_title("Compressed gradients, 2 ranks: dashed, dash-dotted = without error feedback")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths = [fig_dir / "loss_curves.png"]
    save_figure(fig, paths[0])

    methods = list(curves)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    figs = summary["figures"]
    ratios = [figs[f"compression ratio {m}"]["measured"] for m in methods]
    finals = [figs[f"final loss {m}"]["measured"] for m in methods]
    ax.scatter(ratios, finals, c=[STYLE.get(m, ("tab:orange",))[0] for m in methods])
    for m, r, f in zip(methods, ratios, finals):
        below = m in ("bf16", "powersgd_builtin")  # same ratio as fp16 / powersgd
        ax.annotate(m, (r, f), xytext=(4, -9 if below else 3), textcoords="offset points", fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compression ratio (bytes dense / bytes sent)")
    ax.set_ylabel("final loss")
    ax.set_title("What each method saves and what it costs")
    fig.tight_layout()
    paths.append(fig_dir / "ratio_vs_loss.png")
    save_figure(fig, paths[1])
    return paths


def measure() -> dict:
    """train.py on two CPU processes: each method's loss curve, compression ratio and final loss."""
    from common.checkpoint import load_checkpoint
    from common.launch import run_torchrun

    script = Path(__file__).with_name("train.py")
    with tempfile.TemporaryDirectory() as out:
        result = run_torchrun(script, nproc=2, out_dir=out, timeout=180)
        curves = load_checkpoint(Path(out) / "curves.pt")
    figs = result.summary["figures"]
    names = [f"{what} {m}" for m in curves for what in ("compression ratio", "final loss")]
    return {"curves": {m: [float(x) for x in losses] for m, losses in curves.items()},
            "summary": {"figures": {n: {"measured": figs[n]["measured"]} for n in names}}}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    return draw(data["curves"], data["summary"], fig_dir)


def calibrate(worlds=(1, 2, 3, 4, 8, 16), seeds=(0, 1, 2, 3), path: Path | None = None) -> dict:
    """train.py's default run at each world size and seed: every method's final loss divided by
    dense training's, written to figures/calibration.json (a run whose checks fail is kept: the
    file is where a tolerance that does not fit shows)."""
    import json

    from common.launch import run_torchrun

    script = Path(__file__).with_name("train.py")
    path = path or Path(__file__).with_name("figures") / "calibration.json"
    ratios = {}
    for world in worlds:
        for seed in seeds:
            with tempfile.TemporaryDirectory() as out:
                result = run_torchrun(script, nproc=world, args=["--seed", seed], out_dir=out,
                                      timeout=1800, expect_ok=False)
            figs = result.summary["figures"]
            final = {k.removeprefix("final loss "): v["measured"] for k, v in figs.items()
                     if k.startswith("final loss ")}
            ratios[f"world {world} seed {seed}"] = {m: round(f / final["dense"], 4)
                                                     for m, f in final.items()}
            print(f"world {world:2d} seed {seed}:", ratios[f"world {world} seed {seed}"], flush=True)
    data = {"what": "final loss / dense final loss, train.py defaults", "ratios": ratios}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data
