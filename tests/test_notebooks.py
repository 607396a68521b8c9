"""Every notebook equals its lesson.py cell by cell, holds no outputs, and runs top to bottom on CPU."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from urllib.parse import unquote

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
    # A run the chapter's tests already launched with the same command, in this session, is
    # handed to the notebook instead of being run a second time (common.launch; the kernel reads
    # the variable when it starts): the notebook's own code still runs on a real run's output.
    # Runs are handed only into empty folders, so the folder the notebook writes its run to,
    # which this execution rewrites anyway, starts empty.
    shutil.rmtree(Path(notebooks.REPO_ROOT, "runs", "notebooks", chapter.name[:4]), ignore_errors=True)
    os.environ["COURSE_RUN_REPLAY"] = os.environ.get("COURSE_RUN_RECORD", "")
    try:
        client.execute()
    finally:  # kept for the book (tools/book.py), stamped with the lesson.py it ran
        os.environ.pop("COURSE_RUN_REPLAY", None)
        book.save_executed(chapter, nb)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors


# The book (tools/book.py, `./course book`): built from the executions above, so these tests stay
# at the end of this module and reuse them instead of running every notebook twice.

def local_links(page: Path) -> list[str]:
    """The local href/src targets of an HTML page (no scheme, not a pure anchor)."""
    from html.parser import HTMLParser

    found = []

    class Links(HTMLParser):
        def handle_starttag(self, tag, attrs):
            for key, value in attrs:
                if key in ("href", "src") and value and not value.startswith("#") \
                        and not re.match(r"^[a-z][a-z0-9+.-]*:|^//", value, re.I):
                    found.append(value)

    Links().feed(page.read_text())
    return found


def missing_targets(root: Path) -> list[str]:
    """Every local link or image of every page under `root` whose target does not exist."""
    missing = []
    for page in sorted(root.glob("*.html")):
        for url in local_links(page):
            target = (page.parent / unquote(url.split("#")[0].split("?")[0])).resolve()
            if not target.exists():
                missing.append(f"{page.name}: {url}")
    return missing


@pytest.fixture(scope="module")
def built_book(tmp_path_factory):
    stale = [c.name for c in CHAPTERS if not book.is_current(c)]
    if stale:
        pytest.skip(f"no current executed copy in build/executed/ for {', '.join(stale)}: "
                    "the notebook executions of this module write them (run the module whole)")
    out = tmp_path_factory.mktemp("book")
    done = book.build(out, execute_missing=False, log=lambda *a: None)
    assert done["executed"] == [], "the book ran notebooks again instead of reusing the executions"
    return out, done


@pytest.mark.timeout(120)
def test_book_has_every_page_link_and_image_and_no_errors(built_book, tmp_path):
    out, done = built_book
    written = sorted(p.parent.name for p in (notebooks.REPO_ROOT / "chapters").glob("ch[0-9][0-9]_*/README.md"))
    assert done["chapters"] == written
    for name in written:
        for page in (f"{name}.html", f"{name}.notebook.html"):
            assert (out / page).stat().st_size > 1000, f"{page} missing or empty"
    index = (out / "index.html").read_text()
    listed = re.findall(r'<li><a href="(ch\d\d_[a-z0-9_]+)\.html"', index)
    assert listed == written, "the index lists the chapters out of order or misses some"
    assert not missing_targets(out), missing_targets(out)[:10]
    assert sum(len(local_links(p)) for p in out.glob("ch*.html")) > 100  # the links were read
    assert any("files/chapters/" in u and u.endswith(".png") for u in local_links(out / "ch07_communication.html"))
    for page in out.glob("*.html"):  # offline: no script from a CDN
        assert not re.search(r'<script[^>]+src="(https?:)?//', page.read_text()), page.name
    for chapter in CHAPTERS:
        nb = nbformat.read(book.executed_copy(chapter), as_version=4)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.output_type == "error"]
        assert not errors, f"{chapter.name}: a cell output holds an error"
        assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{chapter.name}: no outputs"
    # the link check can fail: a page with a missing image and a link to nowhere
    (tmp_path / "p.html").write_text('<img src="figures/none.png"><a href="nowhere.html#x">x</a>'
                                     '<a href="#top">t</a><a href="https://example.org/">e</a>')
    assert missing_targets(tmp_path) == ["p.html: figures/none.png", "p.html: nowhere.html#x"]


def screenshot_is_not_blank(png: Path) -> bool:
    from PIL import Image

    with Image.open(png) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    return colours is None or len(colours) > 1


# What a reader's browser shows, read from the page's DOM once its scripts ran (MathJax included):
# written into the page as JSON by this script, then dumped by headless Chromium.
PROBE_JS = r"""(function () {
  function report() {
    var imgs = Array.prototype.slice.call(document.images);
    var broken = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); })
                     .map(function (i) { return i.getAttribute("src"); });
    var walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT, null), raw = [];
    for (var n = walker.nextNode(); n; n = walker.nextNode()) {
      if (n.parentElement.closest("pre, code, script, style, textarea")) continue;
      if (/\\\(|\\\[|\$\$/.test(n.nodeValue)) raw.push(n.nodeValue.trim().slice(0, 60));
    }
    var header = document.querySelector("header.course-header");
    var next = document.querySelector("header.course-header a.next");
    var el = document.createElement("pre");
    el.id = "course-probe";
    el.textContent = JSON.stringify({
      images: imgs.length, broken: broken, raw_tex: raw.slice(0, 5),
      math: document.querySelectorAll(".mjx-chtml, .MathJax_CHTML").length,
      header: header ? header.textContent.replace(/\s+/g, " ").trim() : null,
      next: next ? next.getAttribute("href") : null,
      width: window.innerWidth, scroll_width: document.documentElement.scrollWidth});
    document.body.appendChild(el);
  }
  window.addEventListener("load", function () {
    if (window.MathJax && MathJax.Hub) MathJax.Hub.Queue(report); else report();
  });
})();
"""
DESKTOP, NARROW = "1280,900", "390,844"  # headless Chromium widens the narrow one to 500 px


def probe_page(browser: str, book_dir: Path, page: str, size: str) -> dict:
    """Open `page` of the built book at a window `size` and return what PROBE_JS saw."""
    import json
    import subprocess

    (book_dir / "_probe.js").write_text(PROBE_JS)
    probed = book_dir / f"_probe_{page}"
    probed.write_text((book_dir / page).read_text().replace(
        "</body>", '<script src="_probe.js"></script></body>', 1))
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--virtual-time-budget=15000", f"--window-size={size}", "--dump-dom",
                          probed.as_uri()], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r'<pre id="course-probe">(.*?)</pre>', dom, re.S)
    assert found, f"{page} at {size}: the probe did not report (the page's scripts did not finish)"
    import html

    return json.loads(html.unescape(found.group(1)))


@pytest.mark.timeout(180)
def test_book_pages_render_in_headless_chromium(built_book, tmp_path):
    """The book as a reader meets it, checked in the DOM after its scripts ran: at a desktop
    width, the lesson and notebook pages of the first chapter, two middle ones and the last (and
    the contents); at a phone's width (headless Chromium's narrowest, 500 px), chapter 07's two
    pages and the contents. Each page: every image loaded, MathJax typeset the lesson's formulas
    and left no raw TeX delimiter outside code, the same header on lesson and notebook pages
    (book, chapter, page kind) with a next link, and nothing wider than the window."""
    import shutil
    import subprocess

    if os.environ.get("COURSE_SYSTEM_TESTS") != "1":
        pytest.skip("set COURSE_SYSTEM_TESTS=1 (and ./course setup --system) to open the book in Chromium")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium binary (./course setup --system installs Debian's chromium)")
    out, done = built_book
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=15000", f"--window-size={DESKTOP}"]
    shot = tmp_path / "ch07.png"
    subprocess.run([*flags, f"--screenshot={shot}", (out / "ch07_communication.html").as_uri()],
                   capture_output=True, timeout=60)
    assert shot.exists() and screenshot_is_not_blank(shot), "ch07_communication.html: blank or no screenshot"
    names = [c.name for c in CHAPTERS]
    picked = [names[0], "ch07_communication", "ch18_long_context", names[-1]]
    runs = [(p, DESKTOP) for c in picked for p in (f"{c}.html", f"{c}.notebook.html")]
    runs += [("ch07_communication.html", NARROW), ("ch07_communication.notebook.html", NARROW),
             ("index.html", DESKTOP), ("index.html", NARROW)]
    seen, problems = {}, []
    for page, size in runs:
        got = seen[page, size] = probe_page(browser, out, page, size)
        where = f"{page} at {got['width']} px"
        if got["broken"]:
            problems.append(f"{where}: images not loaded: {got['broken'][:3]}")
        if got["raw_tex"] and done["mathjax"]:  # without MathJax the formulas stay TeX (skipped below)
            problems.append(f"{where}: raw TeX left untypeset: {got['raw_tex'][:2]}")
        if got["next"] is None:
            problems.append(f"{where}: no next link in the header")
        if got["scroll_width"] > got["width"]:
            problems.append(f"{where}: the page is {got['scroll_width']} px wide, wider than the window")
        chapter = page.split(".")[0]
        if chapter in names:
            kind = "notebook" if ".notebook." in page else "lesson"
            if not got["header"] or book.BOOK_TITLE not in got["header"] or kind not in got["header"]:
                problems.append(f"{where}: header {got['header']!r} lacks the book or the page kind")
    for c in picked:  # the same header on both pages of a chapter, but for the page kind
        lesson, nb = seen[f"{c}.html", DESKTOP]["header"], seen[f"{c}.notebook.html", DESKTOP]["header"]
        if lesson.split(" · lesson")[0] != nb.split(" · notebook")[0]:
            problems.append(f"{c}: lesson header {lesson!r} != notebook header {nb!r}")
    last = names[-1]
    if seen[f"{last}.html", DESKTOP]["next"] != "index.html":
        problems.append(f"{last}: the last chapter's next link does not lead to the contents")
    typeset = seen["ch07_communication.html", DESKTOP]["math"]
    if done["mathjax"] and typeset < 10:
        problems.append(f"ch07_communication.html: MathJax typeset {typeset} formulas (< 10)")
    if seen["ch07_communication.html", DESKTOP]["images"] < 1:
        problems.append("ch07_communication.html: its figures are not in the page")
    assert not problems, "\n".join(problems)
    assert len(seen) == len(runs)  # every page at every width reported
    if not done["mathjax"]:
        pytest.skip("the book was built without MathJax (no libjs-mathjax): formulas not typeset")
