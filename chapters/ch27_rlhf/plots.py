"""The lesson's figures: the mean reward of GRPO's rollouts per step (on-policy, one update
stale, colocated, and PPO), and the bytes of a delta push against the elements changed, beside
the full push.

    python tools/figures.py ch27           # redraws figures/*.png from figures/data.json
    python tools/figures.py --rerun ch27   # re-measures: runs train.py four times (~40 s)

`measure` keeps what the runs logged (metrics.jsonl) and counted (the checks' byte counts and the
training pushes' figures); the formulas 16 + 12·k and 4·N are drawn at draw time.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from chapters.ch27_rlhf import train
from common.launch import run_python, run_torchrun
from common.results import save_figure

SCRIPT = Path(__file__).resolve().parent / "train.py"
MEASURE_S = 40
RUNS = {
    "GRPO, 2 ranks, staleness 1 (default)": (2, []),
    "GRPO, 2 ranks, staleness 0": (2, ["--staleness", "0"]),
    "GRPO, 1 rank, colocated": (1, []),
    "PPO + value head, 1 rank": (1, ["--algo", "ppo"]),
}


def measure() -> dict:
    runs = {}
    for name, (world, args) in RUNS.items():
        out = Path(tempfile.mkdtemp(prefix="ch27-"))
        args = [*args, "--log-every", "1", "--rm-steps", "0"]
        res = (run_python(SCRIPT, args, out_dir=out, timeout=300) if world == 1
               else run_torchrun(SCRIPT, world, args, out_dir=out, timeout=300))
        runs[name] = {"reward": [json.loads(x)["reward"] for x in (out / "metrics.jsonl").read_text().splitlines()],
                      "figures": res.summary["figures"],
                      "checks": {c["name"]: c["measured"] for c in res.summary["checks"]}}
    return {"runs": runs}


def _rewards(path: Path, runs: dict) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, run in runs.items():
        ax.plot(range(len(run["reward"])), run["reward"], label=name, lw=1.2)
    level = train.uniform_policy_reward(3)
    ax.axhline(level, color="k", ls=":", label=f"uniform random digits ({level:.3f})")
    ax.axhline(level + 0.1, color="C3", ls="-.", lw=0.8, label="+ the check's margin 0.1")
    ax.set_xlabel("update")
    ax.set_ylabel("mean reward of the rollouts")
    ax.set_title("Digits that sum to a target: the reward rises (seed 0, CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def _bytes(path: Path, runs: dict) -> None:
    import matplotlib.pyplot as plt

    default = runs["GRPO, 2 ranks, staleness 1 (default)"]
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
    paths = [fig_dir / "reward.png", fig_dir / "sync_bytes.png"]
    _rewards(paths[0], data_json["runs"])
    _bytes(paths[1], data_json["runs"])
    return paths
