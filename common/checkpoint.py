"""Checkpoint I/O that cannot lie: atomic writes, verified and safe loads, one run per folder.

Written atomically. A checkpoint goes to a temporary file in the same folder, is flushed to disk,
then renamed over the target in one step (`os.replace` is atomic on POSIX and Windows): a crash
mid-write leaves the previous checkpoint intact, never half a file. A write that fails (a full
disk) raises `CheckpointError` naming the file.

Verified before use. `torch.save` writes a zip archive whose members carry CRC-32s, but
`torch.load` never checks them: flipped bytes in a weight load silently. `load_checkpoint`
checks every member's CRC first (`verify_zip`). A folder checkpoint (DCP, chapter 24's objects)
carries a manifest, `manifest.json`, with every file's size and SHA-256, written last: a folder
without one is an unfinished save (`write_manifest`, `verify_manifest`; the DCP versions
`save_dcp`/`verify_dcp` are collective). `newest_verified` walks a run's checkpoints from the newest
and takes the first that verifies, saying in one line which it skipped and why.

Safe to load. A checksum proves a file is the one that was written, not that its writer was
honest: whoever crafts a file can write its manifest too. So nothing loaded here can run code.
`torch.load` is always called with `weights_only=True` (RNG states are stored as tensors and
lists, `common.seed.capture_rng_state`, so that such a load accepts them). DCP un-pickles its
`.metadata` with plain `pickle` and its default planner calls `torch.load(weights_only=False)`
on every non-tensor entry; `load_dcp` and `read_dcp_metadata` read through `SafeReader`, whose
unpickler builds only the classes a real `.metadata` holds, and `SafeLoadPlanner`, which loads
those entries with `weights_only=True`.

Whose checkpoint. A checkpoint records the run that wrote it (`run_id`: kept in `--out` across
restarts) and the shapes of the model and optimizer state (`training_shapes`); `check_identity`
refuses another run's checkpoint in one line. World size and layout are deliberately not part
of the identity: a checkpoint resharded to another world size is still this run's.

One run per folder. `lock_folder` takes an exclusive `flock` on a folder (`RunRecorder` takes one
on `--out` on global rank 0, a script with a checkpoint folder on that too): a second run on the
same folder is refused in one line naming the holder's pid. The kernel releases the lock when
the holder's process ends, however it ends (SIGKILL included), so a restarted run takes it again.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import socket
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import torch

MANIFEST = "manifest.json"
RUN_ID_FILE = "run_id"
LOCK_FILE = ".lock"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, another run's, or cannot be written.

    `collective=True`: every rank raised the same error from the same verdict, so only rank 0
    needs to say it (see `common.log.one_line_errors`)."""

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


class FolderInUseError(RuntimeError):
    """Another run holds the folder's lock (`collective` as for `CheckpointError`)."""

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


# --- writing -------------------------------------------------------------------------------------

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


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(path: str | os.PathLike) -> dict:
    """A manifest entry: the file's size and SHA-256."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def write_manifest(folder: str | os.PathLike, files: dict[str, dict], **meta) -> Path:
    """Write `folder/manifest.json` atomically: `files` maps names relative to the folder to
    `file_entry`s; `meta` (run id, step, shapes) is kept beside them. Write it last: a folder
    without a manifest is a save that did not finish."""
    text = json.dumps({"format": 1, **meta, "files": dict(sorted(files.items()))}, indent=1)
    return atomic_write(Path(folder) / MANIFEST, lambda f: f.write(text.encode()))


def read_manifest(folder: str | os.PathLike) -> dict:
    """The manifest of a folder checkpoint; `CheckpointError` if it is missing or torn."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        if not Path(folder).is_dir():
            raise CheckpointError(f"no checkpoint at {folder}") from None
        raise CheckpointError(f"{folder} has no {MANIFEST}: a save that did not finish") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is torn or not a manifest ({e})") from None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)):
        raise CheckpointError(f"{path} is not a manifest (no 'files' table)")
    return manifest


def check_entry(folder: Path, name: str, entry: dict) -> str | None:
    """Why file `name` does not match its manifest entry (missing, truncated, changed), or None."""
    path = folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return f"{MANIFEST} of {folder} names a file outside the folder: {name}"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is in the manifest but missing"
    if size != entry.get("bytes"):
        return f"{path} has {size} bytes, its manifest says {entry.get('bytes')} (truncated or changed)"
    if sha256_file(path) != entry.get("sha256"):
        return f"{path} does not match its manifest (SHA-256 differs: damaged or changed)"
    return None


def verify_manifest(folder: str | os.PathLike, rank: int = 0, world: int = 1) -> dict:
    """Check the files of a folder checkpoint against its manifest and return the manifest.
    With `rank`/`world`, this caller checks every world-th file from `rank` (the ranks share the
    reading); `verify_dcp` gathers their verdicts."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for name in sorted(manifest["files"])[rank::world]:
        problem = check_entry(folder, name, manifest["files"][name])
        if problem:
            raise CheckpointError(problem)
    return manifest


def newest_verified(candidates: Iterable, verify: Callable, describe: Callable = str):
    """Walk `candidates` from the newest (the end of the sequence) and return `(candidate,
    verify(candidate))` for the first that verifies; each one skipped is logged in one line with
    its reason. `(None, None)` when there are no candidates; `CheckpointError` when there are some
    but none verifies (the run must not start over silently)."""
    from common.log import log

    candidates, reasons = list(candidates), []
    # (a collective `verify` raises the same collective error on every rank: only rank 0 logs it)
    for c in reversed(candidates):
        try:
            return c, verify(c)
        except CheckpointError as e:
            reasons.append(str(e))
            if not e.collective or _rank() == 0:  # one verdict of every rank: rank 0 says it
                log.warning("skipping checkpoint %s: %s", describe(c), e)
    if not candidates:
        return None, None
    raise CheckpointError(f"none of the {len(candidates)} checkpoints verifies "
                          f"(the newest: {reasons[0]})", collective=True)


# --- whose checkpoint ----------------------------------------------------------------------------

def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _dist_ready() else 0


def _broadcast_object(obj, src: int = 0):
    import torch.distributed as dist

    if not _dist_ready() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def run_id(out_dir: str | os.PathLike) -> str:
    """This run's id: read from `out_dir/run_id`, created there on the first start (global rank
    0 decides; every rank gets it: a collective when a process group exists). A restart with the
    same `--out` keeps it."""
    import torch.distributed as dist

    rid = None
    if not _dist_ready() or dist.get_rank() == 0:
        path = Path(out_dir) / RUN_ID_FILE
        try:
            rid = path.read_text().strip()
        except FileNotFoundError:
            rid = ""
        if not rid:
            rid = uuid.uuid4().hex[:12]
            atomic_write(path, lambda f: f.write(rid.encode() + b"\n"))
    return _broadcast_object(rid)


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
                from common.log import log

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
    import secrets

    import torch.distributed as dist

    if not _dist_ready() or dist.get_world_size() == 1:
        return
    path = Path(path)
    name = _broadcast_object(f".shared-probe-{secrets.token_hex(8)}" if _rank() == 0 else None)
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(name)
    dist.barrier()
    probe, main_path = path / name, _broadcast_object(str(path))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, probe.exists() and probe.read_text() == name)
    dist.barrier()  # every rank has looked before the probe goes
    if _rank() == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ValueError(f"{what} {main_path} is not one folder for every rank: ranks "
                         f"{', '.join(map(str, blind))} do not see rank 0's files there (another "
                         "node's local disk?); give every node the same shared folder")


# --- DCP, verified and safe ----------------------------------------------------------------------

# What a real DCP `.metadata` holds (torch 2.4 to 2.14): its dataclasses, torch.Size, dtypes,
# layouts, paths. Nothing else is built, so no pickled `os.system` or `eval` can run.
_DCP_METADATA_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
}


def _buildable() -> tuple[type, ...]:
    """The only types whose instances a DCP `.metadata` may set state on (pickle's BUILD)."""
    from torch.distributed.checkpoint import filesystem, metadata

    return (metadata.Metadata, metadata.MetadataIndex, metadata.StorageMeta,
            metadata.TensorProperties, metadata.TensorStorageMetadata,
            metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata, filesystem._StorageInfo)


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that builds only DCP metadata's classes and torch's dtypes (the "restricting
    globals" recipe of Python's pickle documentation), and sets state (BUILD) only on instances
    of DCP's metadata dataclasses: C's unpickler would `setattr` on anything on its stack, a
    class or a function included, so a crafted file could rewrite `pathlib.PosixPath` for the
    rest of the process. This is Python's own unpickler (the `_Unpickler` class `pickle` keeps for
    that purpose), with its BUILD guarded; metadata is small, its speed does not matter."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]  # BUILD pops the state, sets it on inst
        if type(inst) not in _buildable():
            raise pickle.UnpicklingError(f"DCP metadata may not set state on {type(inst).__name__}")
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict) and any(not isinstance(k, str) or k.startswith("__") for k in part):
                raise pickle.UnpicklingError("DCP metadata may not set special attributes")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


def _safe_reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file-system reader with `.metadata` read through `RestrictedUnpickler`."""

        def read_metadata(self, *args, **kwargs):
            path = Path(self.path) / ".metadata"
            try:
                with open(path, "rb") as f:
                    metadata = RestrictedUnpickler(f).load()
                if not isinstance(metadata, Metadata):
                    raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}")
            except FileNotFoundError:
                raise CheckpointError(f"{path.parent} has no .metadata: not a DCP checkpoint") from None
            except Exception as e:
                raise CheckpointError(f"{path} is not DCP metadata ({type(e).__name__}: {e})") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _safe_planner_class():
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner, with the non-tensor entries (numbers, lists, strings)
        loaded with `weights_only=True` (the default planner passes False)."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner


def safe_reader(folder: str | os.PathLike):
    """A `FileSystemReader` for `folder` that builds nothing but DCP metadata."""
    return _safe_reader_class()(str(folder))


def safe_load_planner():
    return _safe_planner_class()()


def read_dcp_metadata(folder: str | os.PathLike):
    """A DCP checkpoint's metadata (keys, global shapes, which file holds what), read safely."""
    return safe_reader(folder).read_metadata()


def dcp_error_line(e: BaseException) -> str:
    """DCP's `CheckpointException` carries every failing rank's exception and traceback; the
    first rank's exception, in one line, with the ranks that failed."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    ranks = sorted(failures)
    first = failures[ranks[0]]
    inner = first[0] if isinstance(first, tuple) else first
    return f"failed on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {error_line(inner)}"


def error_line(e: BaseException) -> str:
    """One line saying what went wrong, with the file when the error names one."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        return dcp_error_line(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def save_dcp(state: dict, folder: str | os.PathLike, **meta) -> Path:
    """`dcp.save` into `folder`, then its manifest (`commit_dcp_manifest`). Collective. An old
    manifest is removed first, so a save that dies midway leaves a folder without one, which
    `verify_dcp` refuses; a failure raises one `CheckpointError` naming the folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(folder)
    if not _dist_ready() or dist.get_rank() == 0:
        (folder / MANIFEST).unlink(missing_ok=True)
    try:
        dcp.save(state, checkpoint_id=str(folder))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"saving {folder} {error_line(e)}", collective=True) from e
    return commit_dcp_manifest(folder, **meta)


def commit_dcp_manifest(folder: str | os.PathLike, **meta) -> Path:
    """Collective, after every rank's DCP save has finished (for `dcp.async_save`, after its
    future completes): each rank hashes the data files it wrote (`__<rank>_*.distcp`), global
    rank 0 gathers the entries, adds `.metadata` and writes `manifest.json` last."""
    import torch.distributed as dist

    folder = Path(folder)
    rank = dist.get_rank() if _dist_ready() else 0
    try:
        mine = {p.name: file_entry(p) for p in sorted(folder.glob(f"__{rank}_*.distcp"))}
    except OSError as e:
        raise CheckpointError(f"cannot read back {folder}: {error_line(e)}") from e
    everyone = [mine]
    if _dist_ready() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {name: entry for part in everyone for name, entry in part.items()}
        files[".metadata"] = file_entry(folder / ".metadata")
        write_manifest(folder, files, **meta)
    if _dist_ready():
        dist.barrier()  # nobody goes on (or reads it back) before the manifest exists
    return folder / MANIFEST


def verify_dcp(folder: str | os.PathLike) -> dict:
    """Verify a DCP folder against its manifest and return the manifest. Collective: the ranks
    share the hashing and agree on one verdict. Beyond the hashes, every file that the (safely
    read) metadata points to must be in the manifest: a resharded load may read any of them."""
    import torch.distributed as dist

    folder = Path(folder)
    rank, world = (dist.get_rank(), dist.get_world_size()) if _dist_ready() else (0, 1)
    try:
        manifest = verify_manifest(folder, rank, world)
        problem = None
    except CheckpointError as e:
        manifest, problem = None, str(e)
    problems = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(problems[0], collective=True)
    try:
        meta = read_dcp_metadata(folder)  # its bytes were verified above
    except CheckpointError as e:
        raise CheckpointError(str(e), collective=True) from None
    read = {info.relative_path for info in meta.storage_data.values()}
    unlisted = sorted(read - set(manifest["files"]))
    if unlisted:
        raise CheckpointError(f"{folder}: {unlisted[0]} is read by a load but not in its manifest",
                              collective=True)
    return manifest


def load_dcp(state: dict, folder: str | os.PathLike) -> None:
    """`dcp.load` into `state` (in place) through `SafeReader` and `SafeLoadPlanner`. Verify the
    folder before (`verify_dcp`, which `newest_verified` can call): this only loads. A failure
    raises one `CheckpointError` naming the folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=safe_reader(folder), planner=safe_load_planner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"loading {folder} {error_line(e)}", collective=True) from e


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
