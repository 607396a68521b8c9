"""Checkpoints on object storage, through fsspec (a local path, `file://`, `s3://`, `gs://`,
`oss://`): every object is written whole, and a step counts only once its `manifest.json`,
written last, exists (`ObjectStoreCheckpoints.save`). A load reads every object once and checks
it against the manifest's size and SHA-256 and its own zip CRC-32s (`check_zip_bytes`), loads it
with `weights_only=True` (`load_blob`), and takes the newest step that verifies on every rank
(`ObjectStoreCheckpoints.load_latest`) if it is this run's (`run_identity`).
"""

import contextlib
import hashlib
import io
import json
import logging
import zipfile

import torch
import torch.distributed as dist

from common.checkpoint import (
    CheckpointError,
    atomic_write,
    check_identity,
    newest_verified,
    run_id,
    training_shapes,
)
from common.log import log

MANIFEST = "manifest.json"


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def step_folder(step: int) -> str:
    return f"step{step:06d}"


def run_identity(out, model, buffers) -> dict:
    """Whose checkpoint this run may resume: the run id kept in `out` (created there on the first
    start, `common.checkpoint.run_id`; collective when a process group exists) and the global
    shapes of the model and of the momentum buffers (the world size is not part of it: a
    checkpoint resumes at any world size)."""
    shapes = training_shapes(model)
    shapes["optimizer"] = {"kind": "sgd_momentum", "buffers": [list(b.shape) for b in buffers]}
    return {"run_id": run_id(out), "shapes": shapes}


def names_to_check(names, rank: int, world_size: int, own: set[str]) -> list[str]:
    """The objects of a checkpoint this rank verifies: the ones it loads (`own`) and every
    world_size-th of all of them from `rank` (the ranks share the rest; at any world size their
    union is every object, and a rank whose share is empty still checks what it loads)."""
    return sorted(set(own) | set(sorted(names)[rank::world_size]))


def check_zip_bytes(where: str, data: bytes) -> None:
    """Every member of a `torch.save` archive against its CRC-32 (as `common.checkpoint.verify_zip`
    does for a file; `torch.load` checks none). The CRCs are written by `torch.save` itself: they
    catch an archive damaged before its manifest entry was computed, which the SHA-256 cannot."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{where} is truncated or not a checkpoint ({e})") from None
    except Exception as e:  # a damaged local header
        raise CheckpointError(f"{where} is damaged ({type(e).__name__}: {e})") from None
    if bad is not None:
        raise CheckpointError(f"{where} is damaged: member {bad} fails its CRC-32 check")


def load_blob(where: str, data: bytes):
    """`torch.load` of verified bytes with `weights_only=True`: tensors, numbers, strings, lists,
    dicts, nothing that runs code; anything else is refused in one line naming the object."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError (a forbidden global), RuntimeError, EOFError ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{where} is not a safe checkpoint ({type(e).__name__}: "
                              f"{first[:160]})") from None


@contextlib.contextmanager
def said_by_rank0(rank: int):
    """The verdicts of a collective load are the same on every rank (`ObjectStoreCheckpoints.load`):
    rank 0 says which steps were skipped, the others keep quiet while they walk."""
    level = log.level
    if rank != 0:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class ObjectStoreCheckpoints:
    """Checkpoints under an fsspec URL: `stepNNNNNN/state.pt` (what the replicas share, written by
    rank 0), `stepNNNNNN/rng<r>.pt` (each rank's RNG) and, written last by rank 0 once every rank
    has finished, `stepNNNNNN/manifest.json` with each object's size and SHA-256 and whose run it
    is (run id, shapes). An object store has no rename: an object appears whole or not at all, so
    the manifest is the commit. On a local file system each object is still written to a
    temporary name and renamed (`common.checkpoint.atomic_write`, chapter 12).

    A load trusts nothing it has not checked: the newest manifest whose objects are all there,
    of the listed size and SHA-256, whose archives pass their CRC-32s and unpickle with
    `weights_only=True`; a step that fails is skipped with one line saying why, for the one
    before it (`common.checkpoint.newest_verified`), and a manifest of another run is refused."""

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem
        self.url = url
        self.fs, self.root = url_to_fs(url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.puts = 0  # objects written (a count the tests read)

    def _path(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key}"

    def put(self, key: str, data: bytes) -> dict:
        """Write one object whole; return its manifest entry (size and SHA-256 of these bytes)."""
        if self.local:
            atomic_write(self._path(key), lambda f: f.write(data))
        else:
            self.fs.pipe_file(self._path(key), data)  # one PUT: whole or nothing
        self.puts += 1
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def get(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def committed_steps(self) -> list[int]:
        """Steps whose manifest exists, oldest first (a listing, no `latest` pointer to update).
        Global rank 0 lists and tells the others: every rank must walk the same steps."""
        steps = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            found = self.fs.glob(self._path(f"step*/{MANIFEST}"))
            steps = sorted(int(p.rstrip("/").split("/")[-2][4:]) for p in found)
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [steps]
            dist.broadcast_object_list(box, src=0)
            steps = box[0]
        return steps

    def save(self, step: int, shared: dict, rng: dict, rank: int, meta: dict, pause=None) -> dict:
        """Every rank writes its objects; their entries are gathered; rank 0 writes the manifest
        (with `meta`: run id and shapes) last; a barrier keeps every rank until the step is
        committed. Only this step's objects are written: older steps are never touched. `pause`
        (a test hook) runs on rank 0 between the data objects and the manifest."""
        folder = step_folder(step)
        mine = {"state.pt": self.put(f"{folder}/state.pt", _bytes(shared))} if rank == 0 else {}
        mine[f"rng{rank}.pt"] = self.put(f"{folder}/rng{rank}.pt", _bytes(rng))
        world = dist.get_world_size() if dist.is_initialized() else 1
        everyone: list = [mine]
        if dist.is_initialized():
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)  # also: every rank's objects are written
        files = {name: entry for part in everyone for name, entry in part.items()}
        manifest = {"format": 1, "step": step, "world_size": world, **meta,
                    "files": dict(sorted(files.items()))}
        if rank == 0:
            if pause is not None:
                pause()
            self.put(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        if dist.is_initialized():
            dist.barrier()
        return manifest

    def read_manifest(self, step: int) -> dict:
        """The manifest of `step`; `CheckpointError` in one line if it is gone or torn."""
        where = self._path(f"{step_folder(step)}/{MANIFEST}")
        try:
            manifest = json.loads(self.get(f"{step_folder(step)}/{MANIFEST}"))
        except FileNotFoundError:
            raise CheckpointError(f"{where} is missing (listed, then gone)") from None
        except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            raise CheckpointError(f"{where} is torn or not a manifest ({e})") from None
        if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)
                and isinstance(manifest.get("world_size"), int)):
            raise CheckpointError(f"{where} is not a manifest of this chapter (no 'files' table)")
        return manifest

    def verified_bytes(self, step: int, name: str, entry: dict) -> bytes:
        """The object `name` of `step`, read once and checked, as read, against its manifest entry
        (size, SHA-256) and its own CRC-32s: the bytes that are checked are the bytes loaded."""
        key = f"{step_folder(step)}/{name}"
        where = self._path(key)
        if "/" in name or name.startswith("."):
            raise CheckpointError(f"the manifest of {self._path(step_folder(step))} names an "
                                  f"object outside its step: {name}")
        try:
            data = self.get(key)
        except FileNotFoundError:
            raise CheckpointError(f"{where} is in the manifest but missing") from None
        if len(data) != entry.get("bytes"):
            raise CheckpointError(f"{where} has {len(data)} bytes, its manifest says "
                                  f"{entry.get('bytes')} (truncated or changed)")
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise CheckpointError(f"{where} does not match its manifest (SHA-256 differs: "
                                  f"damaged or changed)")
        check_zip_bytes(where, data)
        return data

    def read_step(self, step: int, rank: int, world_size: int) -> dict:
        """This rank's part of verifying `step` (see `names_to_check`), and its state loaded
        from the verified bytes. `state["rng"]` is this rank's stream when the world size is the
        one that saved it, else None; `state["manifest"]` is the manifest."""
        manifest = self.read_manifest(step)
        files, folder = manifest["files"], self._path(step_folder(step))
        same_world = manifest["world_size"] == world_size
        own = {"state.pt"} | ({f"rng{rank}.pt"} if same_world else set())
        blobs = {}
        for name in names_to_check(files, rank, world_size, own):
            if name not in files:
                raise CheckpointError(f"the manifest of {folder} lists no {name}")
            blobs[name] = self.verified_bytes(step, name, files[name])
        state = load_blob(f"{folder}/state.pt", blobs["state.pt"])
        if not (isinstance(state, dict) and {"step", "cursor", "model", "optimizer"} <= set(state)):
            raise CheckpointError(f"{folder}/state.pt holds no training state")
        state["rng"] = (load_blob(f"{folder}/rng{rank}.pt", blobs[f"rng{rank}.pt"])
                        if same_world else None)
        state["manifest"] = manifest
        return state

    def load(self, step: int, rank: int, world_size: int) -> dict:
        """`read_step` on every rank, and one verdict for all of them (collective): a rank that
        found a problem (the RNG object only it reads, its share of the others) makes every rank
        skip the step, so that no two ranks resume from different steps."""
        try:
            state, problem = self.read_step(step, rank, world_size), None
        except CheckpointError as e:
            state, problem = None, str(e)
        problems = [problem]
        if dist.is_initialized() and dist.get_world_size() > 1:
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        problems = [p for p in problems if p]
        if problems:
            raise CheckpointError(problems[0], collective=True)
        return state

    def keep_aside(self, step: int) -> str:
        """Move a committed step that failed verification to `skipped-stepNNNNNN` (numbered if
        that is taken): kept whole for a post-mortem, no longer listed, and its name free for the
        resumed run to save that step anew. On an object store a move is a copy and a delete."""
        src = self._path(step_folder(step))
        dst, n = self._path(f"skipped-{step_folder(step)}"), 0
        while self.fs.exists(dst):
            n += 1
            dst = self._path(f"skipped-{step_folder(step)}-{n}")
        self.fs.mv(src, dst, recursive=True)
        return dst

    def load_latest(self, rank: int, world_size: int, identity: dict) -> dict | None:
        """The newest step that verifies on every rank (each one skipped is logged in one line,
        `newest_verified`), if it is this run's (`identity`: `run_identity`, else refused in
        one line); None when nothing is committed; `CheckpointError` when none verifies (then
        nothing is moved). The newer steps that failed are kept aside by rank 0 (`keep_aside`)."""
        steps = self.committed_steps()
        with said_by_rank0(rank):
            step, state = newest_verified(steps, lambda s: self.load(s, rank, world_size),
                                          describe=step_folder)  # each reason names the file
        if step is None:
            return None
        check_identity(state["manifest"], identity["run_id"], identity["shapes"],
                       self._path(step_folder(step)))
        if rank == 0:
            for bad in (s for s in steps if s > step):
                log.info("kept %s aside as %s", step_folder(bad), self.keep_aside(bad))
        if dist.is_initialized():
            dist.barrier()  # nobody saves into a step folder before it is moved aside
        return state
