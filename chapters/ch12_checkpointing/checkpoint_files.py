"""The files of a one-process checkpoint folder: each save atomic (temporary file, fsync, rename),
with the test hook that kills it mid-write; the step_NNNNNN.pt files; removing a killed save's
`.tmp`; verify, then load; the newest checkpoint that verifies, and whose it is; and setting
aside the newer ones that failed (also for `resume_dcp.py`'s folders).

Helper module of chapter 12 (no main guard); `resume.py`, `resume_dcp.py` and the tests import it.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import torch

from common.checkpoint import atomic_write, check_identity, load_checkpoint, newest_verified
from common.log import log

KILL_AFTER_BYTES = 4096  # the test hook kills the writer after this many bytes of a save
# Test hook: CH12_KILL_SAVE_AT_STEP=s SIGKILLs the save of step s mid-write (`_writer`).


def _writer(state: dict, step: int):
    """torch.save into the file; the test hook CH12_KILL_SAVE_AT_STEP=step SIGKILLs this process
    after KILL_AFTER_BYTES bytes of that step's save, a deterministic point inside the write."""
    kill = os.environ.get("CH12_KILL_SAVE_AT_STEP") == str(step)

    def write(f) -> None:
        class Hooked:
            written = 0

            def write(self, b) -> int:
                if kill and self.written + len(b) > KILL_AFTER_BYTES:
                    f.write(bytes(b)[:KILL_AFTER_BYTES - self.written])
                    f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                self.written += len(b)
                return f.write(b)

            def flush(self) -> None:
                f.flush()

        torch.save(state, Hooked())
    return write


def save_training_state(ckpt_dir: Path, state: dict, naive: bool = False) -> Path:
    """Atomic: step_NNNNNN.pt appears whole or not at all. Naive: overwrite latest.pt in place."""
    write = _writer(state, state["step"])
    if naive:
        path = ckpt_dir / "latest.pt"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            write(f)
        return path
    return atomic_write(ckpt_dir / f"step_{state['step']:06d}.pt", write)


STEP_FILE = re.compile(r"step_\d{6}\.pt")


def step_files(ckpt_dir: Path) -> list[Path]:
    """The folder's checkpoints, oldest first (zero-padded steps sort by name)."""
    return sorted(p for p in Path(ckpt_dir).glob("step_*.pt") if STEP_FILE.fullmatch(p.name))


def remove_incomplete(ckpt_dir: Path) -> list[Path]:
    """Remove the `.tmp` leftovers of saves killed mid-write (never a checkpoint: the rename that
    would have made one never happened); returns them. Safe only while this run holds the lock:
    another run's .tmp may be a save in progress."""
    incomplete = sorted(ckpt_dir.glob(".*.tmp"))
    for p in incomplete:
        p.unlink()
    return incomplete


def load_verified(path: Path, rid: str, shapes: dict) -> dict:
    """Verify, then load: every zip member's CRC-32 and `weights_only=True` (`load_checkpoint`),
    then whose checkpoint it is (`check_identity`: this run's id, this model's shapes)."""
    state = load_checkpoint(path)
    check_identity(state, rid, shapes, path)
    return state


def newest_checkpoint(ckpt_dir: Path, rid: str, shapes: dict) -> tuple[Path | None, dict | None]:
    """(path, state) of the newest step_NNNNNN.pt that verifies (zip CRCs, `weights_only`),
    walking back from the newest; each damaged one skipped is logged in one line
    (`newest_verified`). Then whose it is: another run's or another model's checkpoint is no
    damage to walk past but the wrong folder, refused in one line (`check_identity`), nothing
    set aside. (None, None) when there is none; `CheckpointError` when none verifies."""
    path, state = newest_verified(step_files(ckpt_dir), load_checkpoint, describe=lambda p: p.name)
    if path is not None:
        check_identity(state, rid, shapes, path)
    return path, state


def set_aside(rejected: list[Path]) -> None:
    """Checkpoints newer than the one resumed from failed verification: this run saves those steps
    again, so each is renamed `<name>.rejected` first, kept for whoever investigates, never
    overwritten or deleted."""
    for p in rejected:
        target, n = p.with_name(p.name + ".rejected"), 1
        while target.exists():
            target, n = p.with_name(f"{p.name}.rejected{n}"), n + 1
        p.rename(target)
        log.warning("kept %s as %s (skipped above; this run saves its step again)",
                    p.name, target.name)
