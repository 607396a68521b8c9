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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import notebooks  # noqa: E402
from tools.book_assets import (  # noqa: E402
    HEADER_STYLE,
    MATHJAX_CONFIG,
    MATHJAX_SCRIPT,
    STYLE,
    copy_mathjax,
    find_mathjax,
)

REPO_ROOT = notebooks.REPO_ROOT
EXECUTED = REPO_ROOT / "build" / "executed"
EXECUTE_S = 60  # rough cost of executing one notebook on 2 CPU cores

def chapter_title(chapter: Path) -> str:
    for line in (chapter / "README.md").read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return chapter.name


def lesson_page(chapter: Path) -> str:
    return f"{chapter.name}.html"


def notebook_page(chapter: Path) -> str:
    return f"{chapter.name}.notebook.html"


class Linker:
    """Rewrites the local links and images of a page to the book's pages and copies."""

    def __init__(self, book: Path, chapters: list[Path]):
        self.book, self.chapters = book, {c.resolve() for c in chapters}

    def target(self, url: str, base: Path) -> str:
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^//", url, re.I) or not url:
            return url
        path, _, anchor = url.partition("#")
        anchor = f"#{anchor}" if anchor else ""
        src = (base / path).resolve()
        try:
            rel = src.relative_to(REPO_ROOT)
        except ValueError:
            return url
        if src == REPO_ROOT / "README.md" or src == REPO_ROOT:
            return "index.html" + anchor
        chapter = src if src.is_dir() else src.parent
        if chapter in self.chapters and (src.is_dir() or src.name == "README.md"):
            return lesson_page(chapter) + anchor
        if src.suffix == ".ipynb" and src.parent == REPO_ROOT / "notebooks":
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


VIEWPORT = '<meta name="viewport" content="width=device-width, initial-scale=1">'


def page(title: str, body: str, mathjax: bool, nav: str = "") -> str:
    head = MATHJAX_SCRIPT if mathjax else ""
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">{VIEWPORT}"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style>{head}</head>\n"
            f"<body>{nav}\n{body}\n{footer(nav)}</body></html>\n")


def footer(header_html: str) -> str:
    """The header's links again at the bottom of the page (where a reader finishes)."""
    links = re.search(r"<nav>.*?</nav>", header_html, re.S)
    return f"<footer>{links.group(0)}</footer>" if links else ""


def render_lesson(chapter: Path, linker: Linker, mathjax: bool, nav: str) -> str:
    import mistune

    md = mistune.create_markdown(escape=False, plugins=["table", "strikethrough", "url", "math",
                                                        "footnotes"])
    body = md((chapter / "README.md").read_text())
    return page(chapter_title(chapter), linker.rewrite(body, chapter), mathjax, nav)


def executed_copy(chapter: Path) -> Path:
    return EXECUTED / f"{chapter.name}.ipynb"


def is_current(chapter: Path) -> bool:
    """An executed copy made from the lesson.py as it is now."""
    path = executed_copy(chapter)
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


def render_notebook(chapter: Path, nb, linker: Linker, mathjax: bool, nav: str) -> str:
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
    return linker.rewrite(body, REPO_ROOT / "notebooks")


BOOK_TITLE = "Distributed training, from one device to many"


def nav_for(chapters: list[Path], i: int, notebook: bool) -> str:
    """The header every page of a chapter has, lesson and notebook alike: the book, the chapter
    and which of its two pages this is, then contents, previous, the other page, next (the last
    chapter's next is the contents)."""
    here = chapters[i]
    kind = "notebook" if notebook else "lesson"
    title = (f'<span class="book">{html.escape(BOOK_TITLE)}</span> · '
             f'<span class="chapter">{html.escape(chapter_title(here))}</span> · '
             f'<span class="kind">{kind}</span>')
    links = ['<a href="index.html">contents</a>']
    if i > 0:
        links.append(f'<a href="{lesson_page(chapters[i - 1])}">previous: {chapters[i - 1].name[:4]}</a>')
    links.append(f'<a href="{lesson_page(here)}">lesson</a>' if notebook
                 else f'<a href="{notebook_page(here)}">notebook, executed</a>')
    if i + 1 < len(chapters):
        links.append(f'<a class="next" href="{lesson_page(chapters[i + 1])}">next: '
                     f'{chapters[i + 1].name[:4]}</a>')
    else:
        links.append('<a class="next" href="index.html">next: the contents</a>')
    return f'<header class="course-header">{title}<nav>' + " · ".join(links) + "</nav></header>"


def build(out: Path, execute_missing: bool = True, log=print) -> dict:
    """Build the book into `out`; returns what it did (chapters, executed, mathjax)."""
    import nbformat

    chapters = notebooks.chapters()
    stale = [c for c in chapters if not is_current(c)]
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
    linker = Linker(out, chapters)
    executed = []
    for i, chapter in enumerate(chapters):
        (out / lesson_page(chapter)).write_text(
            render_lesson(chapter, linker, bool(mathjax_src), nav_for(chapters, i, False)))
        if chapter in stale and execute_missing:
            nb = execute(chapter)
            executed.append(chapter.name)
        elif chapter in stale:
            nb = nbformat.read(notebooks.notebook_path(chapter), as_version=4)
        else:
            nb = nbformat.read(executed_copy(chapter), as_version=4)
        (out / notebook_page(chapter)).write_text(
            render_notebook(chapter, nb, linker, bool(mathjax_src), nav_for(chapters, i, True)))
        log(f"wrote {lesson_page(chapter)} and {notebook_page(chapter)}")
    items = "\n".join(
        f'<li><a href="{lesson_page(c)}">{html.escape(chapter_title(c))}</a> '
        f'(<a href="{notebook_page(c)}">notebook</a>)</li>' for c in chapters)
    intro = ("<p>Every lesson of the course, and its notebook executed on a CPU with its outputs. "
             "Built by <code>./course book</code>; it opens offline.</p>")
    first = (f'<header class="course-header"><span class="book">{html.escape(BOOK_TITLE)}</span>'
             f'<nav><a class="next" href="{lesson_page(chapters[0])}">next: '
             f'{chapters[0].name[:4]}</a></nav></header>') if chapters else ""
    (out / "index.html").write_text(page(BOOK_TITLE, f"<h1>Distributed training: the book</h1>{intro}"
                                         f"<ol class=\"chapters\">\n{items}\n</ol>", False, first))
    return {"chapters": [c.name for c in chapters], "executed": executed, "mathjax": bool(mathjax_src)}


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
    print(f"done in {time.perf_counter() - start:.0f} s: open {args.out / 'index.html'}"
          + ("" if done["mathjax"] else " (formulas as raw TeX: no MathJax)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
