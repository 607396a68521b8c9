"""The lesson's figures: the mean reward of the rollouts per step (GRPO asynchronous, lock-step,
colocated; PPO with and without the KL penalty; PPO driven by the reward model), the measured KL
to the reference per step, the recorded timeline of the asynchronous and the lock-step pipeline,
and the bytes of a delta push against the elements changed, beside the full push.

    python tools/figures.py ch27           # redraws figures/*.png from figures/data.json
    python tools/figures.py --rerun ch27   # re-measures: runs train.py six times (~90 s)

`measure` keeps what the runs logged (metrics.jsonl), counted (the checks) and recorded (the
first steps of timeline.json); the formulas 16 + 12·k and 4·N are drawn at draw time.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from chapters.ch27_rlhf import checks
from common.launch import run_python, run_torchrun
from common.results import save_figure

SCRIPT = Path(__file__).resolve().parent / "train.py"
MEASURE_S = 90
DEFAULT = "GRPO, 2 ranks, asynchronous (staleness 1, default)"
LOCKSTEP = "GRPO, 2 ranks, lock-step (staleness 0)"
RUNS = {
    DEFAULT: (2, []),
    LOCKSTEP: (2, ["--staleness", "0"]),
    "GRPO, 1 rank, colocated": (1, []),
    "PPO, 1 rank, β = 0": (1, ["--algo", "ppo", "--beta", "0"]),
    "PPO, 1 rank, β = 0.05": (1, ["--algo", "ppo", "--beta", "0.05"]),
    "PPO + reward model, 3 ranks, staleness 2": (3, ["--algo", "ppo", "--reward", "model",
                                                     "--sync", "full", "--staleness", "2",
                                                     "--beta", "0.05"]),
}
TIMELINE_STEPS = 8  # the first steps of each pipeline, kept for the drawing


def measure() -> dict:
    runs = {}
    for name, (world, args) in RUNS.items():
        out = Path(tempfile.mkdtemp(prefix="ch27-"))
        args = [*args, "--log-every", "1"] + ([] if "--reward" in args else ["--rm-steps", "0"])
        res = (run_python(SCRIPT, args, out_dir=out, timeout=300) if world == 1
               else run_torchrun(SCRIPT, world, args, out_dir=out, timeout=300))
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = {"reward": [x["reward"] for x in lines], "kl": [x["kl"] for x in lines],
                      "figures": res.summary["figures"],
                      "checks": {c["name"]: c["measured"] for c in res.summary["checks"]}}
        if (out / "timeline.json").exists():
            tl = json.loads((out / "timeline.json").read_text())
            runs[name]["timeline"] = [[e for e in events if e[1] < TIMELINE_STEPS + 1]
                                      for events in tl["ranks"]]
    return {"runs": runs}


def _rewards(path: Path, runs: dict) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, run in runs.items():
        ax.plot(range(len(run["reward"])), run["reward"], label=name, lw=1.1)
    level = checks.uniform_policy_reward(3)
    ax.axhline(level, color="k", ls=":", label=f"uniform random digits ({level:.3f})")
    ax.axhline(level + 0.1, color="C3", ls="-.", lw=0.8, label="+ the check's margin 0.1")
    ax.set_xlabel("update")
    ax.set_ylabel("mean reward of the rollouts")
    ax.set_title("Digits that sum to a target: the program's reward rises (seed 0, CPU)")
    ax.legend(fontsize=6.5)
    fig.tight_layout()
    save_figure(fig, path)


def _kl(path: Path, runs: dict) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, run in runs.items():
        if name.startswith("PPO"):
            ax.plot(range(len(run["kl"])), run["kl"], label=name, lw=1.2)
    ax.set_xlabel("update")
    ax.set_ylabel("KL(π‖π_ref) per token (exact, visited states)")
    ax.set_title("PPO's KL penalty holds the policy near its reference")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def _timeline(path: Path, runs: dict) -> None:
    import matplotlib.pyplot as plt

    colours = {"generate": "C2", "train": "C0", "gather": "C7", "push": "C1"}
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 3.6), sharex=False)
    for ax, name in zip(axes, (DEFAULT, LOCKSTEP)):
        ranks = runs[name]["timeline"]
        t0 = min(e[2] for events in ranks for e in events)
        for r, events in enumerate(ranks):
            for what, i, s, e in events:
                ax.barh(r, (e - s) * 1e3, left=(s - t0) * 1e3, color=colours[what], height=0.6)
                if what in ("generate", "train"):
                    ax.text((s - t0 + (e - s) / 2) * 1e3, r, str(i), ha="center", va="center",
                            fontsize=6, color="w")
        ax.set_yticks(range(len(ranks)), ["trainer"] + [f"generator {g}" for g in range(1, len(ranks))])
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("ms since the first event", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    axes[0].legend(handles, colours.keys(), fontsize=6, ncol=4, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path)


def _bytes(path: Path, runs: dict) -> None:
    import matplotlib.pyplot as plt

    default = runs[DEFAULT]
    checks = default["checks"]
    full = checks["full push: bytes broadcast = N x 4"]
    n = full // 4
    ks = [1, 10, 100, 1000, n]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.loglog(ks, [16 + 12 * k for k in ks], "-", color="C1", label="delta: 16 + 12·k bytes")
    ax.axhline(full, color="C0", label=f"full: 4·N = {full:,} bytes")
    ax.axvline(n / 3, color="grey", ls=":", label="break-even k = N/3")
    ax.plot([100], [checks["delta push, 100 changed: bytes = 16 + 12 x changed"]], "o", color="C1",
            label="counted: 100 elements changed")
    changed = float(default["figures"]["elements changed per update (of N)"]["measured"].split("/")[0])
    per_push = default["figures"]["bytes per delta push in training"]["measured"]
    ax.plot([changed], [per_push], "s", color="C3", mfc="none", ms=9,
            label="counted: a training step with Adam")
    ax.set_xlabel("elements changed since the last push (k)")
    ax.set_ylabel("bytes per push")
    ax.set_title(f"Weight sync to a generator (N = {n:,} float32)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def make_figures(fig_dir: Path, data_json: dict) -> list[Path]:
    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = [fig_dir / "reward.png", fig_dir / "kl.png", fig_dir / "timeline.png",
             fig_dir / "sync_bytes.png"]
    _rewards(paths[0], data_json["runs"])
    _kl(paths[1], data_json["runs"])
    _timeline(paths[2], data_json["runs"])
    _bytes(paths[3], data_json["runs"])
    return paths
