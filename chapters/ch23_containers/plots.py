"""Figures for the chapter 23 lesson (regenerate with `python tools/figures.py ch23`).

Nothing here is measured: the figure is computed at draw time from the chapter's manifests and
the launcher mappings in launchers.py (deterministic), read by common's setup.
"""

from __future__ import annotations

from pathlib import Path

from chapters.ch23_containers import orchestration as o
from common.distributed import read_launch_env
from common.results import save_figure


def launcher_ranks() -> dict[str, dict]:
    """For each launcher: its pods or tasks, the rank common's setup reads in each, and the rank
    a wrong mapping reads (the control each test rejects)."""
    by_name = {obj["metadata"]["name"]: obj for _, obj in o.load_manifests()}
    cases = {
        "PyTorchJob (pytorchjob.yaml)": (o.pytorchjob_pods(by_name["ch23-ddp"]),
                                         lambda h, e: {**e, "RANK": h.rsplit("-", 1)[1]},
                                         "replica index as rank"),
        "Volcano Job (volcano-job.yaml)": (o.volcano_pods(by_name["ch23-gang"]),
                                           lambda h, e: {**e, "RANK": e["VC_TASK_INDEX"]},
                                           "VC_TASK_INDEX as rank"),
        "indexed Job (indexed-job.yaml)": (o.indexed_job_pods(by_name["ch23-indexed"]),
                                           lambda h, e: {k: v for k, v in e.items() if k != "WORLD_SIZE"},
                                           "no WORLD_SIZE in the manifest"),
        "Slurm, 2 nodes x 4 tasks": (o.slurm_pods(2, 4),
                                     lambda h, e: {**e, "SLURM_PROCID": e["SLURM_LOCALID"]},
                                     "SLURM_LOCALID as rank"),
    }
    out = {}
    for name, (pods, wrong, label) in cases.items():
        out[name] = {"pods": [h.split(".")[0] for h, _ in pods],
                     "ranks": [read_launch_env(e)["rank"] for _, e in pods],
                     "wrong": [read_launch_env(wrong(h, e))["rank"] for h, e in pods],
                     "wrong_label": label, "problems": len(o.check_world(pods)),
                     "wrong_problems": len(o.check_world([(h, wrong(h, e)) for h, e in pods]))}
    return out


def make_figures(fig_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    data = launcher_ranks()
    fig, axes = plt.subplots(1, 4, figsize=(13, 4), sharey=True)
    for ax, (name, d) in zip(axes, data.items()):
        xs = range(len(d["pods"]))
        ax.bar([x - 0.2 for x in xs], d["ranks"], 0.4, label="read by common's setup")
        ax.bar([x + 0.2 for x in xs], d["wrong"], 0.4, color="tab:red", alpha=0.7,
               label="wrong mapping")
        ax.set_xticks(list(xs), [p.replace("ch23-", "") for p in d["pods"]], rotation=60,
                      ha="right", fontsize=7)
        ax.set_title(f"{name}\nproblems found: {d['problems']}\nwrong mapping, "
                     f"{d['wrong_label']}: {d['wrong_problems']}", fontsize=7.5)
    axes[0].set_ylabel("rank read")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("The rank each pod or task reads from its launcher's variables", fontsize=10)
    fig.tight_layout()
    path = fig_dir / "launcher_ranks.png"
    return [save_figure(fig, path)]  # same bytes on every draw
