"""Generate each chapter's notebook from its `lesson.py` (jupytext percent format).

    python tools/notebooks.py            # regenerate every notebooks/chNN_slug.ipynb
    python tools/notebooks.py ch03       # just one chapter
    python tools/notebooks.py --check    # exit 1 if a notebook is out of date (what the tests check)

The notebook is written without outputs; open it in Jupyter from the repository root or
anywhere (the course is installed in editable mode, so its imports work from any folder).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def chapters(select: str = "") -> list[Path]:
    return sorted(p for p in (REPO_ROOT / "chapters").glob("ch[0-9][0-9]_*")
                  if (p / "lesson.py").exists() and p.name.startswith(select))


def notebook_path(chapter: Path) -> Path:
    return REPO_ROOT / "notebooks" / f"{chapter.name}.ipynb"


def lesson_notebook(chapter: Path):
    """The notebook jupytext makes of `chapter/lesson.py`, with no outputs."""
    import jupytext

    nb = jupytext.read(chapter / "lesson.py", fmt="py:percent")
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"},
                   "jupytext": {"formats": "ipynb,py:percent"}}
    for cell in nb.cells:
        cell.metadata.pop("lines_to_next_cell", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def cells(nb) -> list[tuple[str, str]]:
    """(type, source) of each cell: what 'the notebook equals its source' compares."""
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def write(chapter: Path) -> Path:
    import nbformat

    path = notebook_path(chapter)
    path.parent.mkdir(exist_ok=True)
    nbformat.write(lesson_notebook(chapter), path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapter", nargs="?", default="", help="chapter prefix, e.g. ch03")
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args()
    import nbformat

    stale = []
    for chapter in chapters(args.chapter):
        path = notebook_path(chapter)
        if args.check:
            current = nbformat.read(path, as_version=4) if path.exists() else None
            if current is None or cells(current) != cells(lesson_notebook(chapter)):
                stale.append(path.name)
        else:
            print("wrote", write(chapter).relative_to(REPO_ROOT))
    if stale:
        print("out of date (run python tools/notebooks.py):", ", ".join(stale), file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
