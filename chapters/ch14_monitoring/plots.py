"""Figures for the chapter 14 lesson (`python tools/figures.py ch14`; `--rerun` re-measures).

They come from a real run recorded in figures/data.json by `measure`: three CPU ranks under
torchrun, rank 1 slowed by 30 ms per step. `record_runs` keeps, in figures/runs.json, the
numbers "What you should see" quotes over several runs (two ranks, slowed and not): each run's
figures, its logged MFU and step times, and the machine's load. tools/figures.py does not call
it (it redraws figures); re-record runs.json with

    ./course python -c "from chapters.ch14_monitoring import plots; plots.record_runs()"

(six torchrun launches; runs.json is written only if every one leaves a summary.json), then
update the ranges the README quotes: tests/test_ch14_monitoring.py builds each of them from
runs.json and fails until the README says the same.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from chapters.ch14_monitoring import monitor, train
from common.results import save_figure

MEASURE_S = 25
DASHBOARD = ("loss", "lr", "grad_norm", "samples_per_s")


def straggler_figure(times: dict, found: dict, path: Path) -> Path:
    """Per-rank compute and all-reduce wait per step, with each rank's straggler threshold."""
    import matplotlib.pyplot as plt

    compute = [[t * 1e3 for t in row] for row in times["compute"]]
    wait = [[t * 1e3 for t in row] for row in times["wait"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for r in range(len(compute)):
        tag = " (flagged)" if r in found["flagged"] else ""
        line, = axes[0].plot(compute[r], label=f"rank {r}{tag}")
        axes[0].axhline(found["thresholds"][r] * 1e3, ls=":", color=line.get_color())
        axes[1].plot(wait[r], label=f"rank {r}")
    axes[0].set_title("compute until the all-reduce (dotted: threshold)")
    axes[1].set_title("wait inside the all-reduce")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("ms (log scale)")
    axes[0].set_yscale("log")
    fig.suptitle("3 CPU ranks, rank 1 slowed by 30 ms per step: its compute time flags it", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def dashboard_figure(lines: list[dict], path: Path) -> Path:
    """The four scalars a training dashboard shows first, as metrics.jsonl recorded them."""
    import matplotlib.pyplot as plt

    steps = [line["step"] for line in lines]
    fig, axes = plt.subplots(1, 4, figsize=(12, 2.8))
    for ax, key in zip(axes, DASHBOARD):
        ax.plot(steps, [line[key] for line in lines], marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.suptitle("A training dashboard's first four scalars, from metrics.jsonl (3 CPU ranks)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def measure() -> dict:
    """Per-rank compute and wait times of every step, and rank 0's metrics lines."""
    from common.checkpoint import load_checkpoint
    from common.launch import run_torchrun

    with tempfile.TemporaryDirectory(prefix="ch14-") as tmp:
        run_torchrun(Path(train.__file__), nproc=3, out_dir=tmp, timeout=180,
                     args=["--slow-rank", "1", "--slow-ms", "30", "--no-wandb"])
        times = load_checkpoint(Path(tmp) / "step_times.pt")
        lines = [json.loads(t) for t in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return {"step_times_s": {k: times[k].tolist() for k in ("compute", "wait")},
            "metrics": [{k: line[k] for k in ("step", *DASHBOARD)} for line in lines]}


def record_runs(repeats: int = 3, path: Path | None = None) -> dict:
    """The lesson's command on two ranks, `repeats` times with rank 1 slowed by 30 ms and
    `repeats` times with nobody slowed: per run its summary figures and checks, every logged
    step's MFU and step time, and the 1-minute load average before and after, written to
    figures/runs.json."""
    import os
    import time

    from common.launch import run_torchrun

    path = path or Path(__file__).with_name("figures") / "runs.json"
    runs = []
    for slowed in (True, False):
        for _ in range(repeats):
            args = ["--slow-rank", "1", "--slow-ms", "30"] if slowed else []
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="ch14-") as tmp:
                res = run_torchrun(Path(train.__file__), nproc=2, out_dir=tmp, timeout=300, args=args,
                                   expect_ok=False)  # a failed check is data too
                if res.summary is None:  # it crashed or timed out: nothing to record
                    raise RuntimeError(f"train.py {' '.join(args)} exited {res.returncode} without "
                                       f"writing summary.json; nothing was recorded. Its output "
                                       f"ends:\n{res.output[-2000:]}")
                lines = [json.loads(t) for t in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            runs.append({
                "args": args, "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
                "figures": {k: v["measured"] for k, v in res.summary["figures"].items()},
                "checks": {c["name"]: c["measured"] for c in res.summary["checks"]},
                "logged": [{k: line[k] for k in ("step", "step_time_s", "mfu")} for line in lines]})
            print(json.dumps(runs[-1]["figures"])[:300], runs[-1]["load_1min"], flush=True)
    data = {"what": "train.py on 2 ranks, slowed (rank 1 +30 ms) and not",
            "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    fig_dir.mkdir(parents=True, exist_ok=True)
    times = data["step_times_s"]
    found = monitor.find_stragglers(times["compute"])
    return [straggler_figure(times, found, fig_dir / "straggler.png"),
            dashboard_figure(data["metrics"], fig_dir / "dashboard.png")]

