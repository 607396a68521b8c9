"""A folder checkpoint's manifest: every file's size and SHA-256, written last.

A folder checkpoint (DCP, chapter 13's step folders, chapter 24's objects) carries
`manifest.json`, with every file's size and SHA-256 (`file_entry`), written atomically and last
(`write_manifest`): a folder without one is an unfinished save. `verify_manifest` checks every
file against it (the ranks can share the hashing, `common.checkpoint_dcp.verify_dcp`); a missing,
truncated or changed file raises `CheckpointError` naming it. Re-exported by `common.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from common.errors import CheckpointError
from common.files import atomic_write

MANIFEST = "manifest.json"


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
