"""DCP (torch.distributed.checkpoint), verified and safe: a manifest, and loads that run no code.

`save_dcp` is `dcp.save` followed by a manifest (`commit_dcp_manifest`: every rank hashes the
files it wrote, global rank 0 writes `manifest.json` last); `verify_dcp` checks a folder against
it, the ranks sharing the hashing and agreeing on one verdict. All three are collective.

A checksum proves a file is the one that was written, not that its writer was honest. DCP
un-pickles its `.metadata` with plain `pickle` and its default planner calls
`torch.load(weights_only=False)` on every non-tensor entry; `load_dcp` and `read_dcp_metadata`
read through `SafeReader`, whose unpickler builds only the classes a real `.metadata` holds, and
`SafeLoadPlanner`, which loads those entries with `weights_only=True`.

Re-exported by `common.checkpoint`, where chapters import it from. The imports of
`torch.distributed.checkpoint` stay inside the functions: a heavy import, for the runs that use it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import CheckpointError, error_line
from common.files import dist_ready
from common.manifest import MANIFEST, file_entry, verify_manifest, write_manifest

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


def save_dcp(state: dict, folder: str | os.PathLike, **meta) -> Path:
    """`dcp.save` into `folder`, then its manifest (`commit_dcp_manifest`). Collective. An old
    manifest is removed first, so a save that dies midway leaves a folder without one, which
    `verify_dcp` refuses; a failure raises one `CheckpointError` naming the folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(folder)
    if not dist_ready() or dist.get_rank() == 0:
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
    folder = Path(folder)
    rank = dist.get_rank() if dist_ready() else 0
    try:
        mine = {p.name: file_entry(p) for p in sorted(folder.glob(f"__{rank}_*.distcp"))}
    except OSError as e:
        raise CheckpointError(f"cannot read back {folder}: {error_line(e)}") from e
    everyone = [mine]
    if dist_ready() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {name: entry for part in everyone for name, entry in part.items()}
        files[".metadata"] = file_entry(folder / ".metadata")
        write_manifest(folder, files, **meta)
    if dist_ready():
        dist.barrier()  # nobody goes on (or reads it back) before the manifest exists
    return folder / MANIFEST


def verify_dcp(folder: str | os.PathLike) -> dict:
    """Verify a DCP folder against its manifest and return the manifest. Collective: the ranks
    share the hashing and agree on one verdict. Beyond the hashes, every file that the (safely
    read) metadata points to must be in the manifest: a resharded load may read any of them."""
    folder = Path(folder)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist_ready() else (0, 1)
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

