"""Every notebook equals its lesson.py cell by cell, holds no outputs, and runs top to bottom on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

from tools import book, notebooks

CHAPTERS = notebooks.chapters()


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_notebook_matches_its_source_and_has_no_outputs(chapter):
    path = notebooks.notebook_path(chapter)
    nb = nbformat.read(path, as_version=4)
    assert notebooks.cells(nb) == notebooks.cells(notebooks.lesson_notebook(chapter)), \
        f"{path.name} is stale: run python tools/notebooks.py {chapter.name[:4]}"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} holds outputs"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_notebook_executes_on_cpu(chapter, tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(notebooks.notebook_path(chapter), as_version=4)
    os.environ.setdefault("MPLBACKEND", "Agg")
    client = NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(Path(notebooks.REPO_ROOT, "notebooks"))}})
    try:
        client.execute()
    finally:  # kept for the book (tools/book.py), stamped with the lesson.py it ran
        book.save_executed(chapter, nb)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
