"""Figures for the chapter 24 lesson (`python tools/figures.py ch24`; `--rerun` re-measures).

`measure` (about 20 s) runs the preemption on two spawned gloo ranks (loss curves of an undisturbed
run, a preempted-and-resumed one and the two negative controls), times checkpoint saves through
fsspec to a local folder for four state sizes and what a load adds to verify them (SHA-256 and
zip CRC-32s of the bytes read), and stops two real torchrun runs to time notice ->
committed checkpoint: one by a SIGTERM to the agent, one by AWS's spot notice from a fake metadata
endpoint (`fake_imds.FakeIMDS`) that the run polls. figures/data.json holds what it recorded; the figures are drawn
from it. The grace periods are the clouds' documented figures; the throughput lines are formulas.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from chapters.ch24_cloud import train
from chapters.ch24_cloud.fake_imds import FakeIMDS
from chapters.ch24_cloud.object_store import ObjectStoreCheckpoints, check_zip_bytes
from chapters.ch24_cloud.preemption import Preemption, StopAtStep
from common.launch import last_logged_step, started, wait_until
from common.results import save_figure

STEPS, STOP_AT = 30, 8
SIZES_MB = [1, 4, 16, 64]
GRACE_S = {"AWS spot (2 min notice)": 120, "GCP spot / K8s default (30 s)": 30}
ASSUMED_MB_S = [100, 1000]  # assumed per-node upload throughputs for the formula lines
MEASURE_S = 35


def curves_on_ranks(folder: str) -> dict:
    """On each of 2 gloo ranks: loss per step of an undisturbed run, of a run preempted before
    STOP_AT and resumed, and of resumes that leave out the data position or the RNG state."""
    import torch.distributed as dist

    from common.testing import rank_info
    info, cfg = rank_info(dist.get_rank(), dist.get_world_size()), train.Config(steps=STEPS)
    full = train.train(cfg, info, ObjectStoreCheckpoints(f"{folder}/full"), Preemption(),
                       f"{folder}/full-out")
    out = {"undisturbed": full["losses"]}
    for name, restore in (("preempted, resumed (full state)", train.STATE_PARTS),
                          ("resumed without data position", ("model", "optimizer", "rng")),
                          ("resumed without RNG state", ("model", "optimizer", "data"))):
        store = ObjectStoreCheckpoints(f"{folder}/{len(out)}")
        run_out = f"{folder}/{len(out)}-out"
        head = train.train(cfg, info, store, StopAtStep(STOP_AT), run_out)["losses"]
        tail = train.train(train.Config(steps=STEPS, restore=restore), info, store,
                           Preemption(), run_out)["losses"]
        out[name] = head + tail
    return out


def save_seconds(size_mb: int, folder: str, repeats: int = 3) -> dict[str, list[float]]:
    """Wall times (one process) for a float32 state of size_mb: `ObjectStoreCheckpoints.save`
    (serialise, SHA-256, write, fsync, manifest), the verification a load adds (SHA-256 and zip
    CRC-32s of the bytes read back) and the whole verified load (`read_step`: read, verify,
    `torch.load(weights_only=True)`)."""
    import hashlib

    state = {"step": 0, "cursor": 0, "model": {"w": torch.randn(size_mb * 2**18)}, "optimizer": []}
    meta = {"run_id": "plots", "shapes": {}}
    times = {"save": [], "verify": [], "load": []}
    for i in range(repeats):
        store = ObjectStoreCheckpoints(f"file://{folder}/s{size_mb}-{i}")
        t = time.perf_counter()
        store.save(1, state, {}, rank=0, meta=meta)
        times["save"].append(time.perf_counter() - t)
        data = store.get("step000001/state.pt")
        t = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        check_zip_bytes("state.pt", data)
        times["verify"].append(time.perf_counter() - t)
        t = time.perf_counter()
        store.read_step(1, 0, 1)
        times["load"].append(time.perf_counter() - t)
    return times


def notice_to_commit(folder: str, name: str, imds: FakeIMDS | None = None) -> dict:
    """A real torchrun (2 CPU ranks) told to stop at step 7: SIGTERM to the agent, or (with
    `imds`) AWS's spot notice, which a fake metadata endpoint schedules once the run has
    logged step 7. The script's own measurement of notice -> committed checkpoint."""
    out = Path(folder, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(train.__file__)), "--device", "cpu", "--steps", "200", "--step-seconds", "0.05",
           "--log-every", "1", "--ckpt-url", f"{folder}/{name}-bucket", "--out", str(out)]
    if imds is not None:
        cmd += ["--spot-notice", imds.url, "--spot-poll-s", "0.05"]
    with started(cmd, log=Path(folder, f"{name}.log")) as proc:
        wait_until(lambda: last_logged_step(out / "metrics.jsonl") >= 7, proc, "step 7 of the run")
        if imds is None:
            proc.send_signal(signal.SIGTERM)
        else:
            imds.arm()
        proc.wait(timeout=60)
    summary = json.loads((out / "summary.json").read_text())
    check = next(c for c in summary["checks"] if c["name"].startswith("notice -> checkpoint"))
    return {"seconds": check["measured"], "allowed_s": check["expected"],
            "step": summary["figures"]["preempted, checkpoint committed at step"]["measured"],
            "torchrun_exit": proc.returncode}


def measure() -> dict:
    from common.launch import run_on_ranks
    with tempfile.TemporaryDirectory(prefix="ch24-") as tmp:
        curves = run_on_ranks(curves_on_ranks, 2, tmp, timeout=120)[0]
        timed = {str(mb): save_seconds(mb, tmp) for mb in SIZES_MB}
        sig = notice_to_commit(tmp, "sigterm")
        with FakeIMDS() as imds:
            spot = notice_to_commit(tmp, "spot", imds)
    return {"curves": curves, "save_s": {mb: t["save"] for mb, t in timed.items()},
            "verify_s": {mb: t["verify"] for mb, t in timed.items()},
            "load_s": {mb: t["load"] for mb, t in timed.items()},
            "sigterm": sig, "spot": spot, "threads": torch.get_num_threads()}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    styles = {"undisturbed": dict(lw=4, alpha=0.35, color="k"),
              "preempted, resumed (full state)": dict(ls="--")}
    for name, losses in data["curves"].items():
        ax.plot(range(len(losses)), losses, label=name, **styles.get(name, dict(lw=1)))
    ax.axvline(STOP_AT - 0.5, color="grey", ls=":")
    ax.annotate("notice before step 8: save, resume", (STOP_AT - 0.5, ax.get_ylim()[1]), ha="left",
                va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (rank 0's batch)")
    ax.set_title("A preempted run resumed from its checkpoint (2 gloo ranks, measured)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [save_figure(fig, fig_dir / "preempt_resume.png")]

    fig, ax = plt.subplots(figsize=(7, 3.6))
    sizes = [int(s) for s in data["save_s"]]
    med = [sorted(v)[len(v) // 2] for v in data["save_s"].values()]
    ax.loglog(sizes, med, "o-", label="save through fsspec to a local folder (measured, median of 3)")
    verify = [sorted(v)[len(v) // 2] for v in data["verify_s"].values()]
    ax.loglog(sizes, verify, "s-", label="verify on load: SHA-256 + zip CRC-32s (measured, median of 3)")
    x = [0.5, 1e6]
    for mbs in ASSUMED_MB_S:
        ax.loglog(x, [s / mbs for s in x], ls="--", lw=1,
                  label=f"size / {mbs} MiB/s (formula, an assumed upload rate)")
    for (name, g), c in zip(GRACE_S.items(), ("tab:red", "tab:purple")):
        ax.axhline(g, color=c, ls=":", lw=1.5)
        ax.annotate(name, (0.6, g), color=c, fontsize=8, va="bottom")
    ax.set_xlim(0.5, 1e6)
    ax.set_ylim(1e-3, 1e4)
    ax.set_xlabel("checkpoint bytes written by one node (MiB)")
    ax.set_ylabel("seconds")
    ax.set_title("What fits in the grace period: size / throughput < grace")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    paths.append(save_figure(fig, fig_dir / "grace_budget.png"))
    return paths
