"""Full training-state checkpoints: save everything, resume bit for bit, survive a crash mid-save.

A resumable checkpoint holds the model, the optimizer (Adam's moments), the scheduler, every RNG
state (dropout) and the data position (epoch, batch); leave out one and the resumed run drifts.
Each save is atomic (temporary file, fsync, rename), so a save killed halfway leaves the previous
checkpoint loadable and only a `.tmp` file behind, which the next start detects and removes. Each
load is verified: the zip's CRC-32s (which `torch.load` never checks), `weights_only=True`, and
whose checkpoint it is (the run id kept in --out, the model's shapes); one that fails is skipped,
in one line, for the newest one that verifies. One run at a time owns --ckpt-dir (a lock).
The checkpoint files themselves (atomic save, verify then load, the newest that verifies) are
handled in `checkpoint_files.py`.

Run (one process by design; resume_dcp.py is the same with several ranks, a sharded model and DCP):
    python chapters/ch12_checkpointing/resume.py                       # save, resume, compare
    python chapters/ch12_checkpointing/resume.py --ckpt-dir /tmp/ck --save-every 4   # resumes if /tmp/ck has one
    CH12_KILL_SAVE_AT_STEP=8 python chapters/ch12_checkpointing/resume.py --ckpt-dir /tmp/ck --save-every 4
    python chapters/ch12_checkpointing/resume.py --device cuda         # one GPU
    torchrun, several nodes, Slurm (srun): refused (one process); use resume_dcp.py.
"""
# launch: python

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch12_checkpointing.checkpoint_files import (
    load_verified,
    newest_checkpoint,
    remove_incomplete,
    save_training_state,
    set_aside,
    step_files,
)
from common.checkpoint import lock_folder, run_id, save_checkpoint, training_shapes, unlock_folder
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder, is_main_script
from common.seed import capture_rng_state, restore_rng_state, seed_everything

# Test hooks: CH12_STOP_AFTER_LOCK=1 stops the run (SIGSTOP) once it holds --ckpt-dir, until a
# SIGCONT; CH12_KILL_SAVE_AT_STEP=s kills the save of step s mid-write (checkpoint_files.py).


@dataclass
class Config(RunConfig):
    steps: int = 24
    """Optimizer steps of the whole run (crosses an epoch boundary with the defaults)."""
    stop_at: int = 10
    """Step at which the demonstration saves, 'dies' and resumes in fresh objects."""
    ckpt_dir: str = ""
    """Folder of step_NNNNNN.pt checkpoints; when set, resume from its newest one that verifies."""
    save_every: int = 0
    """With --ckpt-dir: save every this many steps (0: never)."""
    naive_save: bool = False
    """With --ckpt-dir: torch.save straight over latest.pt, not atomically (the broken variant)."""
    batch_size: int = 16
    """Samples per step."""
    n_samples: int = 256
    """Samples in the data set (an epoch is n_samples / batch_size steps)."""
    dropout: float = 0.2
    """Dropout probability: makes the RNG state part of the training state."""
    lr: float = 3e-3
    """Peak learning rate of AdamW (cosine schedule over --steps)."""
    deterministic: bool = True
    """Deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG): a GPU rerun is bit-exact only with them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.stop_at < self.steps:
            raise ValueError(f"--stop-at must lie strictly between 0 and --steps={self.steps}")
        if self.n_samples % self.batch_size:
            raise ValueError("--n-samples must be a multiple of --batch-size")


def validate(cfg: Config, world_size: int) -> None:
    """One process by design: the several-rank version is resume_dcp.py."""
    if world_size != 1:
        raise ValueError("resume.py is one process; start it with python "
                         "(resume_dcp.py is the multi-rank resume, under torchrun)")


def make_deterministic(on: bool) -> None:
    """Same kernels, same bits on a rerun. On GPUs, cuBLAS picks among algorithms and some
    kernels use atomics (e.g. index_add_); deterministic mode forbids the nondeterministic ones,
    and cuBLAS needs its workspace fixed before its first call. On the CPU nothing changes here."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def build(cfg: Config, device: torch.device | str = "cpu"):
    """Model with dropout, AdamW and a cosine schedule, from the seed (as a fresh process would)."""
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(cfg.dropout),
                          nn.Linear(64, 64), nn.ReLU(), nn.Dropout(cfg.dropout), nn.Linear(64, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps)
    return model, opt, sched


def batch_at(cfg: Config, X, Y, epoch: int, index: int):
    """The data position (epoch, index) names the batch: each epoch has its own shuffle."""
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
    rows = order[index * cfg.batch_size:(index + 1) * cfg.batch_size]
    return X[rows], Y[rows]


def train(cfg: Config, run: dict, X, Y, until: int) -> list[float]:
    """Train from run["step"] to `until`; returns the losses. `run` is the training state."""
    model, opt, sched, pos = run["model"], run["opt"], run["sched"], run["data"]
    per_epoch, losses = cfg.n_samples // cfg.batch_size, []
    while run["step"] < until:
        x, y = batch_at(cfg, X, Y, pos["epoch"], pos["index"])
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        pos["index"] += 1
        if pos["index"] == per_epoch:
            pos["epoch"], pos["index"] = pos["epoch"] + 1, 0
        run["step"] += 1
    return losses


def new_run(cfg: Config, device: torch.device | str = "cpu") -> dict:
    model, opt, sched = build(cfg, device)
    return {"model": model, "opt": opt, "sched": sched, "data": {"epoch": 0, "index": 0}, "step": 0}


def training_state(run: dict, rid: str) -> dict:
    """Everything a bit-exact resume needs, as tensors and plain values (weights_only-loadable),
    and whose state it is: the run id `rid` and the shapes of the model and optimizer."""
    return {"model": run["model"].state_dict(), "optimizer": run["opt"].state_dict(),
            "scheduler": run["sched"].state_dict(), "rng": capture_rng_state(),
            "data": dict(run["data"]), "step": run["step"],
            "run_id": rid, "shapes": training_shapes(run["model"], run["opt"])}


def restore(run: dict, state: dict, rng: bool = True, data: bool = True) -> None:
    """Load a training state into freshly built objects (rng/data=False: the broken variants).
    `state` must have been loaded onto the CPU: load_state_dict copies weights and Adam's moments
    to the parameters' device, while torch.set_rng_state takes a CPU ByteTensor only."""
    run["model"].load_state_dict(state["model"])
    run["opt"].load_state_dict(state["optimizer"])
    run["sched"].load_state_dict(state["scheduler"])
    run["step"] = state["step"]
    if rng:
        restore_rng_state(state["rng"])
    if data:
        run["data"] = dict(state["data"])


def run_with_checkpoints(cfg: Config, X, Y, rec: RunRecorder) -> dict:
    """The real-job loop: take the checkpoint folder (one run at a time), resume from the newest
    checkpoint that verifies if any, save every k steps."""
    ckpt_dir, run = Path(cfg.ckpt_dir), new_run(cfg, X.device)
    rid, shapes = run_id(rec.out), training_shapes(run["model"], run["opt"])
    own_lock = not is_main_script(__file__)
    if own_lock:  # called in process (a test, a notebook): run as a script, parse_config has
        # locked --ckpt-dir on global rank 0 before anything else, until the process ends
        lock_folder(ckpt_dir, "--ckpt-dir")  # a second run on this folder is refused here
    if os.environ.get("CH12_STOP_AFTER_LOCK") == "1":  # test hook: hold the lock until SIGCONT
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        incomplete = remove_incomplete(ckpt_dir)
        for p in incomplete:
            log.info("removed an incomplete save: %s", p.name)
        path, state = newest_checkpoint(ckpt_dir, rid, shapes)
        if path is not None:
            set_aside([p for p in step_files(ckpt_dir) if p.name > path.name])
            restore(run, state)  # loaded on the CPU: set_rng_state takes CPU tensors only
            log.info("resumed from %s at step %d", path.name, run["step"])
        first, losses = run["step"], []
        while run["step"] < cfg.steps:
            k = cfg.save_every or cfg.steps
            losses += train(cfg, run, X, Y, min(cfg.steps, (run["step"] // k + 1) * k))
            if cfg.save_every and run["step"] % cfg.save_every == 0:
                save_training_state(ckpt_dir, training_state(run, rid), naive=cfg.naive_save)
                log.info("saved step %d", run["step"])
    finally:
        if own_lock:  # never parse_config's: locks are re-entrant, not counted
            unlock_folder(ckpt_dir)
    rec.figure("resumed from step", first)
    rec.figure("incomplete saves found and removed", len(incomplete))
    return {"first_step": first, "losses": losses}


def resume_demo(cfg: Config, X, Y, rec: RunRecorder) -> dict:
    """Uninterrupted run vs. save at --stop-at, rebuild everything, load, continue."""
    seed_everything(cfg.seed)
    whole = new_run(cfg, X.device)
    reference = train(cfg, whole, X, Y, cfg.steps)
    seed_everything(cfg.seed)
    first = new_run(cfg, X.device)
    head = train(cfg, first, X, Y, cfg.stop_at)
    rid = run_id(rec.out)
    path = save_training_state(rec.out / "ckpt", training_state(first, rid))
    tails = {}
    for name, rng, data in (("full", True, True), ("no RNG", False, True), ("no data position", True, False)):
        seed_everything(cfg.seed + 1)  # a new process: other RNG states, fresh objects
        run = new_run(cfg, X.device)
        state = load_verified(path, rid, training_shapes(run["model"], run["opt"]))  # on the CPU
        restore(run, state, rng=rng, data=data)
        tails[name] = train(cfg, run, X, Y, cfg.steps)
    for name, tail in tails.items():
        same = head + tail == reference
        kind = "parity"
        if name == "full":
            rec.check("resumed losses == uninterrupted (bit for bit)", kind, same, True)
        else:
            rec.check(f"resume without {name.removeprefix('no ')} == uninterrupted (must not)", kind, same, False)
    rec.figure("checkpoint file size", path.stat().st_size, unit="bytes")
    return {"first_step": 0, "losses": head + tails["full"], "reference": reference}


def main(cfg: Config) -> int:
    make_deterministic(cfg.deterministic)  # before any CUDA work
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        X, Y = (t.to(info.device) for t in regression_data(cfg.n_samples, 16, 1, seed=cfg.seed))
        if cfg.ckpt_dir:
            out = run_with_checkpoints(cfg, X, Y, rec)
        else:
            out = resume_demo(cfg, X, Y, rec)
        for i, loss in enumerate(out["losses"]):
            rec.metrics(out["first_step"] + i, loss=loss)
        values = [f"{v:.4f}" for v in out["losses"]]
        log.info("losses from step %d:", out["first_step"])
        for i in range(0, len(values), 12):  # 12 a line: the console's 100 columns
            log.info("  %s", " ".join(values[i:i + 12]))
        save_checkpoint(rec.out / "losses.pt", {"first_step": out["first_step"],
                                                "losses": torch.tensor(out["losses"], dtype=torch.float64)})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
