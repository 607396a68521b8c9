"""Generate each chapter's notebook from its `lesson.py` (jupytext percent format).

    python tools/notebooks.py            # regenerate every notebooks/chNN_slug.ipynb
    python tools/notebooks.py ch03       # just one chapter
    python tools/notebooks.py --check    # exit 1 if a notebook is out of date (what the tests check)
    python tools/notebooks.py --force    # also overwrite notebooks that hold your edits

A chapter with a Chinese text of its notebook (chapters/chNN_slug/lesson.zh.md: each markdown cell
of lesson.py, in order, as `<!-- cell N en: STAMP -->` then the Chinese; see tools/bilingual.py)
also gets notebooks/chNN_slug.zh.ipynb: the English notebook with its markdown cells replaced by
the Chinese and its code cells the same, so the code is never written twice.

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
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}
ZH_MARKER = re.compile(r"^<!-- cell (\d+) en:[ \t]*([0-9a-f]*)[ \t]*-->[ \t]*$", re.M)


def chapters(select: str = "") -> list[Path]:
    return sorted(p for p in (REPO_ROOT / "chapters").glob("ch[0-9][0-9]_*")
                  if (p / "lesson.py").exists() and p.name.startswith(select))


def notebook_path(chapter: Path, notebooks_dir: Path = NOTEBOOKS) -> Path:
    return notebooks_dir / f"{chapter.name}.ipynb"


def zh_notebook_path(chapter: Path, notebooks_dir: Path = NOTEBOOKS) -> Path:
    return notebooks_dir / f"{chapter.name}.zh.ipynb"


def has_zh(chapter: Path) -> bool:
    return (chapter / "lesson.zh.md").exists()


def zh_cells(text: str) -> list[tuple[int, str, str]]:
    """(N, stamp, Chinese markdown) of each `<!-- cell N en: STAMP -->` of a lesson.zh.md, in order."""
    parts = ZH_MARKER.split(text)
    return [(int(parts[i]), parts[i + 1], parts[i + 2].strip()) for i in range(1, len(parts), 3)]


def zh_notebook(chapter: Path):
    """The Chinese notebook: lesson_notebook() with its markdown cells from lesson.zh.md."""
    nb = lesson_notebook(chapter)
    markdown = [c for c in nb.cells if c.cell_type == "markdown"]
    zh = zh_cells((chapter / "lesson.zh.md").read_text())
    if [n for n, _, _ in zh] != list(range(len(markdown))):
        raise ValueError(f"{chapter.name}/lesson.zh.md has {len(zh)} cells for lesson.py's "
                         f"{len(markdown)} markdown cells: python tools/bilingual.py check {chapter.name[:4]}")
    for cell, (_, _, text) in zip(markdown, zh):
        cell.source = text
    nb.metadata["course"] = {"cells": cells_stamp(cells(nb))}
    return nb


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


def write(chapter: Path, notebooks_dir: Path = NOTEBOOKS, force: bool = False, zh: bool = False) -> str:
    """Write the chapter's notebook (zh: its Chinese one). Returns "wrote", "unchanged" or
    "edited" (left alone)."""
    path = (zh_notebook_path if zh else notebook_path)(chapter, notebooks_dir)
    text = render(zh_notebook(chapter) if zh else lesson_notebook(chapter))
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


def stale(chapter: Path, notebooks_dir: Path = NOTEBOOKS) -> list[str]:
    """The chapter's notebooks (English, Chinese) whose cells differ from their sources."""
    import nbformat

    out = []
    for path, make in ((notebook_path(chapter, notebooks_dir), lesson_notebook),
                       (zh_notebook_path(chapter, notebooks_dir), zh_notebook)):
        if make is zh_notebook and not has_zh(chapter):
            if path.exists():
                out.append(f"{path.name} (no lesson.zh.md: delete it)")
            continue
        current = nbformat.read(path, as_version=4) if path.exists() else None
        try:
            if current is None or cells(current) != cells(make(chapter)):
                out.append(path.name)
        except ValueError as e:
            out.append(f"{path.name} ({e})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapter", nargs="?", default="", help="chapter prefix, e.g. ch03")
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    parser.add_argument("--force", action="store_true",
                        help="overwrite notebooks even where they hold your edits or outputs")
    args = parser.parse_args(argv)
    selected = chapters(args.chapter)
    if not selected:
        print(f"no chapter with a lesson.py matches {args.chapter!r}", file=sys.stderr)
        return 2
    if args.check:
        out_of_date = [name for chapter in selected for name in stale(chapter)]
        if out_of_date:
            print("out of date (run python tools/notebooks.py):", ", ".join(out_of_date), file=sys.stderr)
        return 1 if out_of_date else 0
    jobs = [(c, zh) for c in selected for zh in (False, True) if not zh or has_zh(c)]
    print(f"writing {len(jobs)} notebooks from the chapters' lesson.py into notebooks/ "
          "(outputs stripped; a few seconds)", flush=True)
    kept, broken = [], []
    for chapter, zh in jobs:
        rel = (zh_notebook_path if zh else notebook_path)(chapter).relative_to(REPO_ROOT)
        try:
            status = write(chapter, force=args.force, zh=zh)
        except ValueError as e:
            broken.append(rel)
            print(f"{rel} not written: {e}")
            continue
        if status == "edited":
            kept.append(rel)
            print(f"{rel} has your edits; copy them elsewhere or pass --force")
        elif status == "wrote":
            print("wrote", rel)
    print(f"done: {len(jobs) - len(kept) - len(broken)} notebooks up to date"
          + (f", {len(kept)} left alone (pass --force to overwrite them)" if kept else "")
          + (f", {len(broken)} Chinese notebooks not written" if broken else ""))
    return 1 if kept or broken else 0


if __name__ == "__main__":
    sys.exit(main())
