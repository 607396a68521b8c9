"""The folders a run writes: files written whole, one run per folder, a folder every rank sees.

Written atomically. `atomic_write` writes to a temporary file in the same folder, flushes it to
disk, then renames it over the target in one step (`os.replace` is atomic on POSIX and Windows):
a crash mid-write leaves the previous file intact, never half a file. A write that fails (a full
disk) raises `CheckpointError` naming the file. `save_checkpoint`, the manifests and
summary.json are written through it.

One run per folder. `lock_folder` takes an exclusive `flock` on a folder (`parse_config` takes
one on `--out` and a checkpoint folder on global rank 0, before any process group; `RunRecorder`
takes it when `parse_config` has not): a second run on the same folder is refused in one line
naming the holder's pid. The kernel releases the lock when the holder's process ends, however it
ends (SIGKILL included), so a restarted run takes it again. The folders a launch holds are
listed in COURSE_LOCKED_FOLDERS (`LOCKED_ENV`) for the processes it starts.

Before a run: `check_writable_folder` (one process) and `require_shared_folder` (every rank,
once a process group exists) refuse, in one sentence, a folder the run could not use.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch.distributed as dist

from common.errors import CheckpointError, FolderInUseError
from common.log import log

LOCK_FILE = ".lock"
LOCKED_ENV = "COURSE_LOCKED_FOLDERS"  # the folders this launch's global rank 0 holds


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call `write(file)` on a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        cause = _os_error(e)
        if cause is not None:  # ENOSPC, EDQUOT, EIO, ...: say which file
            raise CheckpointError(f"cannot write {path}: {cause.strerror or cause}") from e
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`, if any: torch.save's zip writer, failing on a full disk, raises a
    RuntimeError ("unexpected pos") while it handles the OSError that started it."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


# --- which rank: global rank 0 of a process group, or the one process ---------------------------

def dist_ready() -> bool:
    """Is there a process group (else this process is the whole run)?"""
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's rank in the default group; 0 without one."""
    return dist.get_rank() if dist_ready() else 0


def broadcast_object(obj, src: int = 0):
    """`src`'s `obj` on every rank (a collective when a process group has 2 or more ranks)."""
    if not dist_ready() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# --- one run per folder --------------------------------------------------------------------------

_held: dict[str, int] = {}


def lock_folder(folder: str | os.PathLike, what: str = "--out", wait_s: float = 3.0) -> Path:
    """Take an exclusive lock on `folder` (created if needed) for this process, or raise
    `FolderInUseError` naming the holder's pid once `wait_s` has passed (a restarted run may
    find its predecessor still exiting). Re-entrant within a process; released when the process
    ends, however it ends, or by `unlock_folder`."""
    folder = Path(folder).resolve()
    key = str(folder)
    if key in _held:
        return folder
    try:
        import fcntl
    except ImportError:  # Windows: no flock; the course's multi-rank runs need Linux or macOS
        return folder
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        # a restart: the dead rank's DataLoader workers (forked, holding the lock's descriptor)
        # may outlive it by their watchdog's few seconds
        wait_s = max(wait_s, 15.0)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(f"cannot use {what} {folder}: {e.strerror or e}") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if not isinstance(e, BlockingIOError):  # ENOLCK, EOPNOTSUPP: a file system without flock
                os.close(fd)
                log.warning("cannot lock %s %s on this file system (%s): a second run on it would "
                            "not be refused", what, folder, e.strerror or e)
                return folder
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                try:
                    h = json.loads(holder)
                    who = f"pid {h['pid']} on {h['host']}"
                except (ValueError, KeyError, TypeError):
                    who = "another process"
                raise FolderInUseError(
                    f"{what} {folder} is in use by another run ({who}): wait for it to end, or "
                    f"give this run another {what}") from None
            time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    _held[key] = fd
    return folder


def unlock_folder(folder: str | os.PathLike) -> None:
    fd = _held.pop(str(Path(folder).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


def check_writable_folder(path: str | os.PathLike, what: str) -> None:
    """Make sure `path` is, or can become, a folder this process can write, by creating it and a
    file in it; raise `ValueError` with one sentence otherwise (called before any process group
    exists). Root passes permission bits, so only trying the write tells."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path} is not a folder this run can write "
                         f"({e.strerror or e})") from None


def require_shared_folder(path: str | os.PathLike, what: str = "--out") -> None:
    """Every rank must see the files rank 0 writes in `path` (a DCP checkpoint's shards and its
    `.metadata` are written by different ranks and read by all): rank 0 writes a probe file,
    every rank looks for it, and if some rank cannot see it (two nodes, each with its own
    local folder of that name) every rank raises `ValueError` with one sentence, before any
    training. Collective: every rank calls it. One process: nothing to check."""
    if not dist_ready() or dist.get_world_size() == 1:
        return
    path = Path(path)
    name = broadcast_object(f".shared-probe-{secrets.token_hex(8)}" if global_rank() == 0 else None)
    if global_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(name)
    dist.barrier()
    probe, main_path = path / name, broadcast_object(str(path))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, probe.exists() and probe.read_text() == name)
    dist.barrier()  # every rank has looked before the probe goes
    if global_rank() == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ValueError(f"{what} {main_path} is not one folder for every rank: ranks "
                         f"{', '.join(map(str, blind))} do not see rank 0's files there (another "
                         "node's local disk?); give every node the same shared folder")

