"""Generate each chapter's notebook from its `lesson.py` (jupytext percent format).

    python tools/notebooks.py            # regenerate every notebooks/chNN_slug.ipynb
    python tools/notebooks.py ch03       # just one chapter
    python tools/notebooks.py --check    # exit 1 if a notebook is out of date (what the tests check)
    python tools/notebooks.py --force    # also overwrite notebooks that hold your edits

The notebook is written without outputs and with stable cell ids (chapter and cell number), so
running this twice changes nothing. A notebook that differs from its committed version and from
what this tool wrote (you saved outputs or edited cells in it) is left alone unless --force:
copy your work elsewhere first (`./course lab` works on copies under lab/ for this reason).
Open a notebook in Jupyter from the repository root or anywhere (the course is installed in
editable mode, so its imports work from any folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def chapters(select: str = "") -> list[Path]:
    return sorted(p for p in (REPO_ROOT / "chapters").glob("ch[0-9][0-9]_*")
                  if (p / "lesson.py").exists() and p.name.startswith(select))


def notebook_path(chapter: Path, notebooks_dir: Path = NOTEBOOKS) -> Path:
    return notebooks_dir / f"{chapter.name}.ipynb"


def source_hash(path: Path) -> str:
    """Fingerprint of a lesson.py: what an executed copy of its notebook was made from."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def lesson_notebook(chapter: Path):
    """The notebook jupytext makes of `chapter/lesson.py`, with no outputs and stable cell ids."""
    import jupytext

    nb = jupytext.read(chapter / "lesson.py", fmt="py:percent")
    nb.nbformat, nb.nbformat_minor = 4, 5
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"},
                   "jupytext": {"formats": "ipynb,py:percent"}}
    for i, cell in enumerate(nb.cells):
        cell.id = f"{chapter.name[:4]}-{i:03d}"  # stable: the same file every time
        cell.metadata.pop("lines_to_next_cell", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata["course"] = {"cells": cells_stamp(cells(nb))}
    return nb


def cells(nb) -> list[tuple[str, str]]:
    """(type, source) of each cell: what 'the notebook equals its source' compares."""
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def render(nb) -> str:
    import nbformat

    return nbformat.writes(nb) + "\n"


def committed_text(path: Path) -> str | None:
    """The file as the last commit has it (None: not committed, or no git)."""
    try:
        out = subprocess.run(["git", "-C", str(path.parent), "show", f"HEAD:./{path.name}"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def cells_stamp(pairs: list[tuple[str, str]]) -> str:
    """Fingerprint of a notebook's cells as this tool wrote them (kept in its metadata)."""
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def looks_generated(text: str) -> bool:
    """True if `text` is a notebook as this tool wrote it from some version of the lesson: no
    outputs, and its cells still match the stamp written with them (edited cells do not)."""
    try:
        nb = json.loads(text)
        pairs = [(c["cell_type"], "".join(c["source"]).strip()) for c in nb["cells"]]
        return (all(not c.get("outputs") and c.get("execution_count") is None for c in nb["cells"])
                and nb["metadata"].get("course", {}).get("cells") == cells_stamp(pairs))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def write(chapter: Path, notebooks_dir: Path = NOTEBOOKS, force: bool = False) -> str:
    """Write the chapter's notebook. Returns "wrote", "unchanged" or "edited" (left alone)."""
    path = notebook_path(chapter, notebooks_dir)
    text = render(lesson_notebook(chapter))
    if path.exists():
        current = path.read_text()
        if current == text:
            return "unchanged"
        edited = current != committed_text(path) and not looks_generated(current)
        if edited and not force:
            return "edited"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return "wrote"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapter", nargs="?", default="", help="chapter prefix, e.g. ch03")
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    parser.add_argument("--force", action="store_true",
                        help="overwrite notebooks even where they hold your edits or outputs")
    args = parser.parse_args(argv)
    import nbformat

    selected = chapters(args.chapter)
    if not selected:
        print(f"no chapter with a lesson.py matches {args.chapter!r}", file=sys.stderr)
        return 2
    if args.check:
        stale = []
        for chapter in selected:
            path = notebook_path(chapter)
            current = nbformat.read(path, as_version=4) if path.exists() else None
            if current is None or cells(current) != cells(lesson_notebook(chapter)):
                stale.append(path.name)
        if stale:
            print("out of date (run python tools/notebooks.py):", ", ".join(stale), file=sys.stderr)
        return 1 if stale else 0
    print(f"writing {len(selected)} notebooks from the chapters' lesson.py into notebooks/ "
          "(outputs stripped; a few seconds)", flush=True)
    kept = []
    for chapter in selected:
        status = write(chapter, force=args.force)
        rel = notebook_path(chapter).relative_to(REPO_ROOT)
        if status == "edited":
            kept.append(rel)
            print(f"{rel} has your edits; copy them elsewhere or pass --force")
        elif status == "wrote":
            print("wrote", rel)
    print(f"done: {len(selected) - len(kept)} notebooks up to date"
          + (f", {len(kept)} left alone (pass --force to overwrite them)" if kept else ""))
    return 1 if kept else 0


if __name__ == "__main__":
    sys.exit(main())
