"""Checkpoint I/O: atomic writes and safe loads.

A checkpoint is written to a temporary file in the same folder, flushed to disk, then renamed
over the target in one step (`os.replace` is atomic on POSIX and Windows): a crash mid-write
leaves the previous checkpoint intact, never half a file. Loading uses `weights_only=True`
(no arbitrary code runs from a file you were sent); RNG states are stored as tensors and lists
(`common.seed.capture_rng_state`) so that such a load accepts them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated or not a checkpoint."""


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call `write(file)` on a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def save_checkpoint(path: str | os.PathLike, state: dict) -> Path:
    """Atomically `torch.save` a dict of tensors, numbers, strings, lists and dicts."""
    return atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint with `weights_only=True`; a missing or damaged file raises
    `CheckpointError` with one sentence saying which file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dict")
    return state
