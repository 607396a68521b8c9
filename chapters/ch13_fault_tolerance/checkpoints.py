"""Chapter 13's checkpoint: a two-phase save that a crash cannot half-commit, and a resume that
uses only a checkpoint that verifies, with one verdict for all ranks.

Save (`save_state`): rank 0 writes what every replica shares once, every rank its own RNG
stream, each file atomically (`write_file`); once every rank's file is written, rank 0 commits
the step with its manifest (every file's size and SHA-256), then names it in `latest`. Resume
(`load_state`): the step folders with a manifest, newest first (`candidates`), each verified on
every rank (`read_step`) under one verdict (`agreed`); a rejected folder is kept aside
(`keep_aside`), never deleted. Nothing here depends on the world size. How often to save:
`young_daly_interval`.
"""

import hashlib
import io
import math
import re
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import (
    MANIFEST,
    CheckpointError,
    atomic_write,
    check_identity,
    load_checkpoint,
    newest_verified,
    verify_manifest,
    write_manifest,
)
from common.log import log

STEP_FOLDER = re.compile(r"step(\d{6})")  # step000010: a checkpoint; step000010.rejected: kept aside


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Checkpoint interval that minimises saving plus expected lost work, sqrt(2 δ M) (Young
    1974; Daly 2006 adds higher-order terms that matter only when δ is not small against M)."""
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def write_file(path: Path, obj: dict, crash=None) -> dict:
    """Atomic torch.save (temporary file, fsync, rename); returns the file's manifest entry
    (`common.checkpoint.file_entry`'s size and SHA-256, of the bytes written: no second read).
    `crash` (the fault injector) is called after half the bytes are written: the process dies
    with a half-written .tmp file."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()

    def write(f) -> None:
        f.write(data[:len(data) // 2])
        if crash is not None:
            f.flush()
            crash()
        f.write(data[len(data) // 2:])

    atomic_write(path, write)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def uncommit(folder: Path) -> None:
    """Remove a step folder's manifest before that step is saved again: the re-save is then
    uncommitted until its end (a crash halfway leaves a folder no resume reads)."""
    (folder / MANIFEST).unlink(missing_ok=True)


def save_state(ckpt_dir: Path, step: int, shared: dict, rng: dict, rank: int, crash=None) -> None:
    """Two phases, independent of the world size. Phase 1: rank 0 writes what every replica
    holds alike (model, optimizer, data position, step, world size, run id, shapes) once, every
    rank its own RNG stream, each file atomically. Phase 2, once every rank's entry has reached
    rank 0 (the gather is the barrier): rank 0 writes the folder's manifest, every file with its
    size and SHA-256, and then names the step in `latest`. The manifest is the commit: a crash
    before it leaves a folder without one, which no resume reads. A step saved again (its folder
    already committed) is first uncommitted by rank 0, and a barrier keeps the other ranks' files
    out of the folder until then. A write that fails (a full disk: `atomic_write` names the
    file) fails the save on every rank, in both phases: one collective `CheckpointError`, so that
    no rank is left waiting in a collective for a rank that has gone."""
    folder, world = ckpt_dir / f"step{step:06d}", dist.get_world_size()
    if rank == 0:
        uncommit(folder)
    if world > 1:
        dist.barrier()  # no rank writes into a committed folder: its manifest is gone first
    mine, problem = {}, None
    try:
        if rank == 0:
            mine["state.pt"] = write_file(folder / "state.pt", shared, crash)
        mine[f"rng{rank}.pt"] = write_file(folder / f"rng{rank}.pt", rng, crash)
    except CheckpointError as e:
        problem = str(e)
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, problem))
    problem = next((p for _, p in everyone if p), None)
    if rank == 0 and problem is None:
        try:
            write_manifest(folder, {name: e for part, _ in everyone for name, e in part.items()},
                           step=step, world_size=world, run_id=shared["run_id"])
            atomic_write(ckpt_dir / "latest", lambda f: f.write(str(step).encode()))
        except CheckpointError as e:
            problem = str(e)
    problem = from_rank0(problem)
    if problem:
        raise CheckpointError(problem, collective=True)


def from_rank0(obj):
    """Global rank 0's `obj` on every rank (a collective when the world has several ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def group_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def candidates(ckpt_dir: Path) -> list[Path]:
    """The checkpoints a resume may use, oldest first: every step folder holding a manifest (a
    committed save), and the one `latest` names. `latest` is a hint: a folder it names is tried
    even without a manifest (a committed folder that lost it is skipped in a line, not ignored);
    a torn `latest` is reported and the folders speak for themselves. Global rank 0 lists the
    folder and reads `latest`, and every rank gets its list: on a shared file system another
    node may see a stale listing, and ranks walking different lists would call the verdict's
    collectives a different number of times (a hang)."""
    found = None
    if group_rank() == 0:
        found = {p for p in ckpt_dir.glob("step*")
                 if STEP_FOLDER.fullmatch(p.name) and (p / MANIFEST).exists()}
        try:
            text = (ckpt_dir / "latest").read_bytes().decode(errors="replace")
        except FileNotFoundError:
            text = None
        if text is not None and text.strip().isdigit():
            found.add(ckpt_dir / f"step{int(text):06d}")
        elif text is not None:
            log.warning("%s is torn (%r): trying the step folders", ckpt_dir / "latest", text[:20])
        found = sorted(found)
    return from_rank0(found)


def read_step(folder: Path, rank: int, world_size: int) -> dict:
    """This rank's part of checkpoint `folder`, verified, or `CheckpointError` saying what is
    wrong with which file. The ranks share the hashing of the files against the manifest
    (`verify_manifest`); every `.pt` is checked against its zip CRCs and loaded with
    `weights_only=True` (`load_checkpoint`); the manifest must list `state.pt` and the RNG file
    of every rank of the world that saved it."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} does not exist (`latest` names it)")
    group = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    manifest = verify_manifest(folder, *group)  # each rank hashes every world-th file
    state = load_checkpoint(folder / "state.pt")
    missing = [key for key in ("step", "cursor", "world_size", "model", "optimizer") if key not in state]
    if missing:
        raise CheckpointError(f"{folder / 'state.pt'} is not this script's checkpoint (no {missing[0]})")
    saved_world = state["world_size"]
    needed = ["state.pt", *(f"rng{r}.pt" for r in range(saved_world))]
    unlisted = [name for name in needed if name not in manifest["files"]]
    if unlisted:
        raise CheckpointError(f"{folder} is incomplete: a world of {saved_world} saved it, and its "
                              f"{MANIFEST} lists no {unlisted[0]}")
    state["rng"] = load_checkpoint(folder / f"rng{rank}.pt") if saved_world == world_size else None
    return state


def agreed(verify):
    """`verify(folder)` on every rank, with one verdict for all: the first problem any rank
    found fails the folder on every rank (a collective `CheckpointError`), so that every rank
    resumes from the same checkpoint."""
    def verdict(folder: Path):
        result, problem = None, None
        try:
            result = verify(folder)
        except CheckpointError as e:
            problem = str(e)
        problems = [problem]
        if dist.is_initialized() and dist.get_world_size() > 1:
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p), None)
        if first:
            raise CheckpointError(first, collective=True)
        return result
    return verdict


def keep_aside(folder: Path) -> Path:
    """Rename a rejected checkpoint out of the way (`step000010.rejected`, `.rejected2`, ...):
    the resumed run saves that step again, and the damaged one stays for whoever looks."""
    for n in range(1, 1000):
        aside = folder.with_name(f"{folder.name}.rejected{n if n > 1 else ''}")
        if not aside.exists():
            folder.rename(aside)
            return aside
    raise CheckpointError(f"{folder}: too many rejected copies beside it")


def load_state(ckpt_dir: Path, rank: int, world_size: int, identity: dict | None = None) -> dict | None:
    """The newest checkpoint that verifies, or None for a fresh start (no committed checkpoint
    at all). A checkpoint that fails is skipped with one line naming the file and why (from
    `newest_verified`); none verifying is refused in one line. `identity` ({"run_id", "shapes"}
    of this run): a checkpoint of another run or model is refused in one line. Rejected folders
    newer than the one used are renamed aside (`keep_aside`), never deleted, and `latest` then
    names the step used. The state's `rng`
    is this rank's saved stream when the world size is the one that saved it, else None (a
    resize: rank r of the new world has no stream of its own in the checkpoint)."""
    rejected, verdict = [], agreed(lambda folder: read_step(folder, rank, world_size))

    def verify(folder: Path) -> dict:
        try:
            return verdict(folder)
        except CheckpointError:
            rejected.append(folder)
            raise

    # (the verdicts are collective, so `newest_verified` has rank 0 alone say what it skips)
    folder, state = newest_verified(candidates(ckpt_dir), verify, describe=lambda p: p.name)
    if state is None:
        return None
    if identity is not None:
        check_identity(state, identity["run_id"], identity["shapes"], folder)
    if group_rank() == 0:
        for bad in rejected:
            if bad.exists():
                log.warning("kept the rejected %s as %s", bad.name, keep_aside(bad).name)
        latest = ckpt_dir / "latest"
        if not latest.exists() or latest.read_bytes() != str(state["step"]).encode():
            atomic_write(latest, lambda f: f.write(str(state["step"]).encode()))  # the hint, true again
    if rejected and dist.is_initialized():
        dist.barrier()  # nobody saves into a folder before it is out of the way
    state["folder"] = str(folder)
    return state
