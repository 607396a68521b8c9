"""Build the course as a static, offline HTML book in build/book/ (`./course book`).

    python tools/book.py                 # build/book/index.html: every lesson and executed notebook
    python tools/book.py --out DIR       # somewhere else
    python tools/book.py --no-execute    # notebooks without a current executed copy: no outputs

Each lesson's README.md is rendered to HTML (mistune, which nbconvert already needs), with links
between lessons, to the notebooks and to the figures rewritten to the book's own pages (figures
and linked source files are copied in). Each notebook is shown executed, with its outputs, by
nbconvert's HTML exporter. The executions come from build/executed/chNN_slug.ipynb, which the
notebook tests write (tests/test_notebooks.py) with a fingerprint of the lesson.py they ran; a
notebook whose copy is missing or older than its lesson.py is executed here (announced, ~1 min
each). Formulas are typeset by MathJax copied into the book from Debian's libjs-mathjax
(`./course setup --system`), so the book opens from file:// on a machine without a network;
without it the book is built with the formulas left as TeX, and says so.

Bilingual (tools/book_nav.py): a chapter with a Chinese lesson README.zh.md also gets its Chinese
page, and with notebooks/chNN_slug.zh.ipynb its Chinese notebook page, whose outputs are the English
execution's, copied cell by cell while the code cells are identical; index.zh.html lists the
chapters by their Chinese titles. Every page's header switches language.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import sys
import time
from copy import deepcopy
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import notebooks  # noqa: E402
from tools.book_assets import (  # noqa: E402
    HEADER_STYLE,
    MATHJAX_CONFIG,
    copy_mathjax,
    find_mathjax,
)
from tools.book_nav import (  # noqa: E402,F401  (BOOK_TITLE, chapter_title: the tests read them here)
    BOOK_TITLE,
    VIEWPORT,
    Twins,
    chapter_title,
    footer,
    lesson_page,
    nav_for,
    notebook_page,
    page,
    page_name,
    write_indexes,
)

REPO_ROOT = notebooks.REPO_ROOT
EXECUTED = REPO_ROOT / "build" / "executed"
EXECUTE_S = 60  # rough cost of executing one notebook on 2 CPU cores


def chapters_in(root: Path = REPO_ROOT) -> list[Path]:
    """The chapters of the course at `root` (notebooks.chapters, for any root)."""
    return sorted(p for p in (root / "chapters").glob("ch[0-9][0-9]_*") if (p / "lesson.py").exists())


class Linker:
    """Rewrites the local links and images of a page to the book's pages and copies."""

    def __init__(self, book: Path, chapters: list[Path], root: Path = REPO_ROOT):
        self.book, self.chapters, self.root = book, {c.resolve() for c in chapters}, root.resolve()

    def target(self, url: str, base: Path) -> str:
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^//", url, re.I) or not url:
            return url
        path, _, anchor = url.partition("#")
        anchor = f"#{anchor}" if anchor else ""
        src = (base / path).resolve()
        try:
            rel = src.relative_to(self.root)
        except ValueError:
            return url
        if src == self.root / "README.md" or src == self.root:
            return "index.html" + anchor
        if src == self.root / "README.zh.md":
            return "index.zh.html" + anchor
        chapter = src if src.is_dir() else src.parent
        if chapter in self.chapters and (src.is_dir() or src.name == "README.md"):
            return lesson_page(chapter) + anchor
        if chapter in self.chapters and src.name == "README.zh.md" and src.exists():
            return page_name(chapter, zh=True) + anchor
        if src.suffix == ".ipynb" and src.parent == self.root / "notebooks":
            return f"{src.stem}.notebook.html" + anchor
        if not src.exists():
            return url  # left as it is; the book's test reports it
        dest = self.book / "files" / rel
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            return f"files/{rel.as_posix()}/" + anchor
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
        return f"files/{rel.as_posix()}" + anchor

    def rewrite(self, page: str, base: Path) -> str:
        def sub(m):
            url = html.unescape(m.group(3))
            return f'{m.group(1)}={m.group(2)}{html.escape(self.target(url, base))}{m.group(2)}'
        return re.sub(r'\b(href|src)=(["\'])([^"\']*)\2', sub, page)


def render_lesson(chapter: Path, linker: Linker, mathjax: bool, nav: str, zh: bool = False) -> str:
    import mistune

    md = mistune.create_markdown(escape=False, plugins=["table", "strikethrough", "url", "math",
                                                        "footnotes"])
    from tools.bilingual_text import EN_SWITCH, ZH_SWITCH

    text = (chapter / ("README.zh.md" if zh else "README.md")).read_text()
    # the lesson's own language switch: the page header has one that links the twin page
    body = md("\n".join(line for line in text.splitlines() if line.strip() not in (EN_SWITCH, ZH_SWITCH)))
    return page(chapter_title(chapter, zh), linker.rewrite(body, chapter), mathjax, nav, zh)


def executed_copy(chapter: Path, executed: Path = EXECUTED) -> Path:
    return executed / f"{chapter.name}.ipynb"


def is_current(chapter: Path, executed: Path = EXECUTED) -> bool:
    """An executed copy made from the lesson.py as it is now."""
    path = executed_copy(chapter, executed)
    if not path.exists():
        return False
    meta = json.loads(path.read_text()).get("metadata", {}).get("course", {})
    return meta.get("executed_from") == notebooks.source_hash(chapter / "lesson.py")


def save_executed(chapter: Path, nb, executed: Path = EXECUTED) -> Path:
    """Keep an executed notebook for the book, stamped with its lesson.py's fingerprint."""
    import nbformat

    nb.metadata.setdefault("course", {})["executed_from"] = notebooks.source_hash(chapter / "lesson.py")
    executed.mkdir(parents=True, exist_ok=True)
    path = executed / f"{chapter.name}.ipynb"
    nbformat.write(nb, path)
    return path


def execute(chapter: Path):
    """Run the chapter's notebook top to bottom (as tests/test_notebooks.py does) and keep it."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebooks.notebook_path(chapter), as_version=4)
    os.environ.setdefault("MPLBACKEND", "Agg")
    NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(REPO_ROOT / "notebooks")}}).execute()
    save_executed(chapter, nb)
    return nb


def with_outputs(zh_nb, executed_nb) -> int:
    """Give the Chinese notebook `zh_nb` the English execution's outputs, code cell by code cell
    while the two code cells are identical; from the first that differs on it has none (they would
    be the outputs of other code). Returns how many code cells got their outputs."""
    english = [c for c in executed_nb.cells if c.cell_type == "code"]
    code = [c for c in zh_nb.cells if c.cell_type == "code"]
    same = 0
    while same < min(len(code), len(english)) and code[same].source == english[same].source:
        same += 1
    for k, cell in enumerate(code):
        cell.outputs = deepcopy(english[k].get("outputs", [])) if k < same else []
        cell.execution_count = english[k].get("execution_count") if k < same else None
    return same


def render_notebook(chapter: Path, nb, linker: Linker, mathjax: bool, nav: str,
                    zh: bool = False) -> str:
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    exporter.mathjax_url = f"mathjax/MathJax.js?config={MATHJAX_CONFIG}"
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": chapter.name}})
    # offline: no require.js from a CDN (only widgets need it; these notebooks have none)
    body = re.sub(r'<script src="https://[^"]*require[^"]*\.js"></script>', "", body)
    if not mathjax:  # no CDN: without a local MathJax the formulas stay as TeX
        body = re.sub(r'<script src="mathjax/MathJax\.js[^"]*">\s*</script>', "", body)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav, body, count=1)
    # the lesson pages' header style and a phone's viewport, and the links again at the bottom
    body = body.replace("</head>", f"{VIEWPORT}<style>{HEADER_STYLE}</style></head>", 1)
    body = body.replace("</body>", f"{footer(nav)}</body>", 1)
    body = re.sub(r"<html[^>]*>", f'<html lang="{"zh-CN" if zh else "en"}">', body, count=1)
    return linker.rewrite(body, linker.root / "notebooks")


def build(out: Path, execute_missing: bool = True, log=print, root: Path = REPO_ROOT) -> dict:
    """Build the book of the course at `root` into `out`; returns what it did (chapters, executed,
    mathjax, zh: the chapters with a Chinese lesson page, zh_notebooks: with a Chinese notebook)."""
    import nbformat

    chapters, executed_dir = chapters_in(root), root / "build" / "executed"
    stale = [c for c in chapters if not is_current(c, executed_dir)]
    mathjax_src = find_mathjax()
    out.mkdir(parents=True, exist_ok=True)
    if mathjax_src:
        copy_mathjax(mathjax_src, out)
    else:
        log("no MathJax found (Debian's libjs-mathjax: ./course setup --system): "
            "formulas stay as raw TeX")
    if stale and execute_missing:
        log(f"executing {len(stale)} notebooks without a current executed copy "
            f"({', '.join(c.name[:4] for c in stale)}; ~{EXECUTE_S * len(stale) / 60:.0f} min)")
    linker, twins, mj = Linker(out, chapters, root), Twins(chapters, root), bool(mathjax_src)
    executed = []
    for i, chapter in enumerate(chapters):
        (out / lesson_page(chapter)).write_text(
            render_lesson(chapter, linker, mj, nav_for(chapters, i, False, twins=twins)))
        if chapter in stale and execute_missing:
            nb = execute(chapter)
            executed.append(chapter.name)
        elif chapter in stale:
            nb = nbformat.read(root / "notebooks" / f"{chapter.name}.ipynb", as_version=4)
        else:
            nb = nbformat.read(executed_copy(chapter, executed_dir), as_version=4)
        (out / notebook_page(chapter)).write_text(
            render_notebook(chapter, nb, linker, mj, nav_for(chapters, i, True, twins=twins)))
        log(f"wrote {lesson_page(chapter)} and {notebook_page(chapter)}")
        if twins.has(chapter):
            (out / page_name(chapter, zh=True)).write_text(
                render_lesson(chapter, linker, mj, nav_for(chapters, i, False, True, twins), zh=True))
            log(f"wrote {page_name(chapter, zh=True)}")
        if twins.has(chapter, notebook=True):
            zh_nb = nbformat.read(root / "notebooks" / f"{chapter.name}.zh.ipynb", as_version=4)
            same = with_outputs(zh_nb, nb)
            (out / page_name(chapter, True, True)).write_text(
                render_notebook(chapter, zh_nb, linker, mj, nav_for(chapters, i, True, True, twins), zh=True))
            log(f"wrote {page_name(chapter, True, True)} " + (
                "(no outputs: the English notebook has no current execution)"
                if chapter in stale and chapter.name not in executed
                else f"(the English execution's outputs for its {same} code cells equal to the English)"))
    write_indexes(out, chapters, twins)
    return {"chapters": [c.name for c in chapters], "executed": executed, "mathjax": mj,
            "zh": [c.name for c in twins.zh], "zh_notebooks": [c.name for c in twins.zh_notebooks]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "book", help="where to build")
    parser.add_argument("--no-execute", action="store_true",
                        help="do not execute notebooks that lack a current executed copy (no outputs)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    n = len(notebooks.chapters())
    print(f"building the book of {n} chapters into {args.out} (~{n} s from executed copies)", flush=True)
    done = build(args.out, execute_missing=not args.no_execute)
    print(f"done in {time.perf_counter() - start:.0f} s: open {args.out / 'index.html'} "
          f"({len(done['zh'])} chapters also in Chinese: index.zh.html)"
          + ("" if done["mathjax"] else " (formulas as raw TeX: no MathJax)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
