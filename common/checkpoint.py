"""Checkpoint I/O that cannot lie: atomic writes, verified and safe loads, one run per folder.

This module is the one chapters import checkpoints from; it holds the single-file checkpoint and
a run's identity, and re-exports the rest from where it lives:

- `common.files`: written atomically (`atomic_write`: a temporary file, flushed, renamed over the
  target, so a crash mid-write leaves the previous checkpoint intact, never half a file; a write
  that fails, a full disk, raises `CheckpointError` naming the file), and one run per folder
  (`lock_folder`: a second run on the same folder is refused in one line naming the holder's pid).
- `common.manifest`: a folder checkpoint carries `manifest.json`, with every file's size and
  SHA-256, written last: a folder without one is an unfinished save (`write_manifest`,
  `verify_manifest`).
- `common.checkpoint_dcp`: DCP verified (`save_dcp`/`verify_dcp`, collective) and loaded safely
  (`load_dcp`, `read_dcp_metadata`).
- `common.errors`: `CheckpointError`, `FolderInUseError`, `error_line`.

Verified before use. `torch.save` writes a zip archive whose members carry CRC-32s, but
`torch.load` never checks them: flipped bytes in a weight load silently. `load_checkpoint`
checks every member's CRC first (`verify_zip`). `newest_verified` walks a run's checkpoints from
the newest and takes the first that verifies, saying in one line which it skipped and why.

Safe to load. A checksum proves a file is the one that was written, not that its writer was
honest: whoever crafts a file can write its manifest too. So nothing loaded here can run code.
`torch.load` is always called with `weights_only=True` (RNG states are stored as tensors and
lists, `common.seed.capture_rng_state`, so that such a load accepts them); DCP's `.metadata` and
non-tensor entries are read as safely (`common.checkpoint_dcp`).

Whose checkpoint. A checkpoint records the run that wrote it (`run_id`: kept in `--out` across
restarts) and the shapes of the model and optimizer state (`training_shapes`); `check_identity`
refuses another run's checkpoint in one line. World size and layout are deliberately not part
of the identity: a checkpoint resharded to another world size is still this run's.
"""

from __future__ import annotations

import os
import uuid
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

# What chapters, lessons and tests import from `common.checkpoint` (re-exported; see above).
from common.checkpoint_dcp import (  # noqa: F401
    RestrictedUnpickler,
    commit_dcp_manifest,
    load_dcp,
    read_dcp_metadata,
    safe_load_planner,
    safe_reader,
    save_dcp,
    verify_dcp,
)
from common.errors import (  # noqa: F401
    CheckpointError,
    FolderInUseError,
    dcp_error_line,
    error_line,
    is_disk_full,
)
from common.files import (  # noqa: F401
    LOCK_FILE,
    atomic_write,
    broadcast_object,
    check_writable_folder,
    dist_ready,
    global_rank,
    lock_folder,
    require_shared_folder,
    unlock_folder,
)
from common.log import log
from common.manifest import (  # noqa: F401
    MANIFEST,
    check_entry,
    file_entry,
    read_manifest,
    sha256_file,
    verify_manifest,
    write_manifest,
)

RUN_ID_FILE = "run_id"


def save_checkpoint(path: str | os.PathLike, state: dict) -> Path:
    """Atomically `torch.save` a dict of tensors, numbers, strings, lists and dicts."""
    return atomic_write(path, lambda f: torch.save(state, f))


# --- verifying -----------------------------------------------------------------------------------

def verify_zip(path: str | os.PathLike) -> None:
    """Check every member of a `torch.save` archive against its CRC-32 (which `torch.load` never
    does); a damaged or truncated file raises `CheckpointError` naming it and the member."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every member, returns the first whose CRC differs
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{path} is truncated or not a checkpoint ({e})") from None
    except Exception as e:  # a damaged local header, a short read: testzip raises
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e})") from None
    if bad is not None:
        raise CheckpointError(f"{path} is damaged: member {bad} fails its CRC-32 check")


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """Verify (`verify_zip`), then load with `weights_only=True`; a missing, damaged or foreign
    file raises `CheckpointError` with one sentence saying which file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    verify_zip(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {first})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dict")
    return state


def newest_verified(candidates: Iterable, verify: Callable, describe: Callable = str):
    """Walk `candidates` from the newest (the end of the sequence) and return `(candidate,
    verify(candidate))` for the first that verifies; each one skipped is logged in one line with
    its reason. `(None, None)` when there are no candidates; `CheckpointError` when there are some
    but none verifies (the run must not start over silently)."""
    candidates, reasons = list(candidates), []
    # (a collective `verify` raises the same collective error on every rank: only rank 0 logs it)
    for c in reversed(candidates):
        try:
            return c, verify(c)
        except CheckpointError as e:
            reasons.append(str(e))
            if not e.collective or global_rank() == 0:  # one verdict of every rank: rank 0 says it
                log.warning("skipping checkpoint %s: %s", describe(c), e)
    if not candidates:
        return None, None
    raise CheckpointError(f"none of the {len(candidates)} checkpoints verifies "
                          f"(the newest: {reasons[0]})", collective=True)


# --- whose checkpoint ----------------------------------------------------------------------------

def run_id(out_dir: str | os.PathLike) -> str:
    """This run's id: read from `out_dir/run_id`, created there on the first start (global rank
    0 decides; every rank gets it: a collective when a process group exists). A restart with the
    same `--out` keeps it."""
    rid = None
    if not dist_ready() or dist.get_rank() == 0:
        path = Path(out_dir) / RUN_ID_FILE
        try:
            rid = path.read_text().strip()
        except FileNotFoundError:
            rid = ""
        if not rid:
            rid = uuid.uuid4().hex[:12]
            atomic_write(path, lambda f: f.write(rid.encode() + b"\n"))
    return broadcast_object(rid)


def training_shapes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """The global shapes of the model's parameters, and the optimizer's kind and groups: what a
    checkpoint must match to be this run's. A DTensor's `.shape` is the global shape, so the
    world size and the sharding layout are not part of it."""
    shapes = {"model": {n: list(p.shape) for n, p in model.named_parameters()}}
    if optimizer is not None:
        shapes["optimizer"] = {"kind": type(optimizer).__name__,
                               "group_sizes": [len(g["params"]) for g in optimizer.param_groups]}
    return shapes


def _first_difference(a, b, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{where}{k} is {'missing' if k not in a else 'new'}"
            d = _first_difference(a[k], b[k], f"{where}{k}.")
            if d:
                return d
        return None
    return None if a == b else f"{where.rstrip('.')} is {b} here, {a} in the checkpoint"


def check_identity(saved: dict, rid: str, shapes: dict, where) -> None:
    """Refuse, in one line, a checkpoint of another run (`saved["run_id"]`) or of another model
    (`saved["shapes"]`). `saved` holds what the writer recorded; `where` names the checkpoint."""
    if saved.get("run_id") != rid:
        raise CheckpointError(
            f"{where} belongs to run {saved.get('run_id')!r}, not to this run {rid!r} (the run id "
            f"in --out): resume with the --out of the run that wrote it, or use another "
            f"checkpoint folder", collective=True)
    diff = _first_difference(saved.get("shapes"), shapes)
    if diff:
        raise CheckpointError(f"{where} was written for another model or optimizer: {diff}",
                              collective=True)
