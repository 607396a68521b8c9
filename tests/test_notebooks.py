"""Every notebook equals its lesson.py cell by cell, holds no outputs, and runs top to bottom on CPU."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from tools import book, book_nav, notebooks
from tools.book_probe import (
    DESKTOP,
    NARROW,
    cjk_fonts,
    glyph_problem,
    local_links,
    missing_targets,
    page_problems,
    probe_page,
    without_cjk_fonts,
)

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
# at the end of this module and reuse them instead of running every notebook twice. What they
# read of the pages (links, and the DOM in headless Chromium) is tools/book_probe.py's.

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
    zh = [c.name for c in CHAPTERS if (c / "README.zh.md").exists()]
    assert done["zh"] == zh and set(done["zh_notebooks"]) <= set(zh)
    for name in zh:  # the Chinese pages of every chapter with a Chinese lesson, and the Chinese contents
        for page in (f"{name}.zh.html", *([f"{name}.zh.notebook.html"] if name in done["zh_notebooks"] else [])):
            assert (out / page).stat().st_size > 1000, f"{page} missing or empty"
    listed = re.findall(r'<li data-chapter="(ch\d\d_[a-z0-9_]+)"', (out / "index.zh.html").read_text())
    assert listed == written, "index.zh.html lists the chapters out of order or misses some"
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


def chromium() -> str:
    if os.environ.get("COURSE_SYSTEM_TESTS") != "1":
        pytest.skip("set COURSE_SYSTEM_TESTS=1 (and ./course setup --system) to open the book in Chromium")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium binary (./course setup --system installs Debian's chromium)")
    return browser


def screenshot_is_not_blank(png: Path) -> bool:
    from PIL import Image

    with Image.open(png) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    return colours is None or len(colours) > 1


@pytest.mark.timeout(180)
def test_book_pages_render_in_headless_chromium(built_book, tmp_path):
    """The book as a reader meets it, checked in the DOM after its scripts ran: at a desktop
    width, the lesson and notebook pages of the first chapter, two middle ones and the last (and
    the contents); at a phone's width (headless Chromium's narrowest, 500 px), chapter 07's two
    pages and the contents. Each page: every image loaded, MathJax typeset the lesson's formulas
    and left no raw TeX delimiter outside code, the same header on lesson and notebook pages
    (book, chapter, page kind) with a next link and the language switch (linking the Chinese
    page where it exists, else saying it is not yet written), nothing wider than the window, and
    where a CJK font is installed, the Chinese of the chapter titles drawn as glyphs."""
    import subprocess

    browser = chromium()
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
        problems += page_problems(out, page, got, done)
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


@pytest.mark.timeout(180)
def test_book_chinese_pages_render_in_headless_chromium(built_book):
    """The Chinese contents and the Chinese pages of the first two chapters that have them, as
    the English pages are checked above, plus: <html lang="zh-CN">, the header in Chinese (book,
    chapter, 讲义 or notebook, 目录), the switch linking the English page, Chinese drawn as glyphs."""
    browser = chromium()
    out, done = built_book
    if not done["zh"]:
        pytest.skip("no chapter has a Chinese lesson (chapters/chNN_slug/README.zh.md) yet: the Chinese "
                    "pages are tested on a made-up chapter (test_book_writes_chinese_pages_of_a_chapter)")
    if not cjk_fonts():
        pytest.skip("no CJK font (./course setup --system installs fonts-noto-cjk)")
    runs = [("index.zh.html", DESKTOP), (f"{done['zh'][0]}.zh.html", NARROW)]
    for name in done["zh"][:2]:
        runs += [(f"{name}.zh.html", DESKTOP)]
        runs += [(f"{name}.zh.notebook.html", DESKTOP)] if name in done["zh_notebooks"] else []
    problems = []
    for page, size in runs:
        got = probe_page(browser, out, page, size)
        problems += page_problems(out, page, got, done)
        if not got["glyphs"] or glyph_problem(got["glyphs"]):
            problems.append(f"{page}: {glyph_problem(got['glyphs'])}")
        kind = "notebook" if ".notebook." in page else "讲义"
        if page != "index.zh.html" and not (book_nav.BOOK_TITLE_ZH in got["header"]
                                            and kind in got["header"] and "目录" in got["header"]):
            problems.append(f"{page}: header {got['header']!r} is not the Chinese one")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(120)
def test_book_renders_chinese_glyphs_not_boxes(tmp_path):
    """The contents pages show the chapters' Chinese titles (通信优化基础 ...): with the CJK font
    that ./course setup --system installs, Chromium draws them as glyphs, each character its
    own bitmap, unlike the box of an unassigned code point and about one em wide; the same check
    fails where the font is missing (fontconfig shown every font but the CJK ones, or none)."""
    browser = chromium()
    if not cjk_fonts():
        pytest.skip("no CJK font (./course setup --system installs fonts-noto-cjk)")
    book_nav.write_indexes(tmp_path, CHAPTERS, book_nav.Twins(CHAPTERS, notebooks.REPO_ROOT))
    for page in ("index.html", "index.zh.html"):
        got = probe_page(browser, tmp_path, page, DESKTOP)["glyphs"]
        assert got and glyph_problem(got) is None, glyph_problem(got)
        assert got["distinct"] == got["chars"] >= 2 and got["as_box"] == 0
    hidden = without_cjk_fonts(tmp_path / "no-cjk")
    got = probe_page(browser, tmp_path, "index.html", DESKTOP, {"FONTCONFIG_FILE": str(hidden)})["glyphs"]
    assert "missing-glyph box" in (glyph_problem(got) or ""), f"not caught without a CJK font: {got}"
    assert got["as_box"] == got["chars"] and got["width"] == got["tofu_width"]
    (tmp_path / "empty.conf").write_text(f"<fontconfig><cachedir>{tmp_path / 'c'}</cachedir></fontconfig>")
    got = probe_page(browser, tmp_path, "index.html", DESKTOP, {"FONTCONFIG_FILE": str(tmp_path / "empty.conf")})
    assert glyph_problem(got["glyphs"]), f"not caught without any font: {got['glyphs']}"


def test_book_writes_chinese_pages_of_a_chapter(tmp_path):
    """On a made-up course of two chapters, the first with a Chinese lesson and notebook (its
    second code cell changed): the Chinese pages, their headers and switches, the contents in
    Chinese, and the Chinese notebook showing the English execution's outputs only for the code
    cells before the first that differs."""
    (tmp_path / "README.md").write_text("| # | chapter | 中文 |\n|---|---|---|\n"
                                        "| 01 | [Alpha](chapters/ch01_alpha/README.md) | 阿尔法 |\n"
                                        "| 02 | [Beta](chapters/ch02_beta/README.md) | 贝塔之章 |\n")
    (tmp_path / "README.zh.md").write_text("# 课程\n\n[English](README.md) · 中文\n")
    code = '# %% [markdown]\n# Text, see [next](../chapters/ch02_beta/README.md).\n\n# %%\nprint("out-1")\n\n# %%\nprint("out-2")\n'
    (tmp_path / "notebooks").mkdir()
    chapters = []
    for name, title in (("ch01_alpha", "Alpha"), ("ch02_beta", "Beta")):
        chapter = tmp_path / "chapters" / name
        chapter.mkdir(parents=True)
        (chapter / "lesson.py").write_text(code)
        switch = "English · [中文](README.zh.md)\n\n" if name == "ch01_alpha" else ""  # its twin exists
        (chapter / "README.md").write_text(f"# Chapter {name[2:4]} · {title}\n{switch}\nSee [the "
                                           f"notebook](../../notebooks/{name}.ipynb).\n")
        nb = notebooks.lesson_notebook(chapter)
        nbformat.write(nb, notebooks.notebook_path(chapter, tmp_path / "notebooks"))
        for cell in nb.cells[1:]:
            cell.outputs = [nbformat.v4.new_output("stream", text=f"shown {cell.source[11]}\n")]
        book.save_executed(chapter, nb, tmp_path / "build" / "executed")
        chapters.append(chapter)
    (chapters[0] / "README.zh.md").write_text("# 第 01 章 · 阿尔法之章\n\n[English](README.md) · 中文\n\n"
                                              "中文正文，见 [notebook](../../notebooks/ch01_alpha.zh.ipynb)。\n")
    zh_nb = notebooks.lesson_notebook(chapters[0])
    zh_nb.cells[0].source = "中文说明，见[下一章](../chapters/ch02_beta/README.md)。"
    zh_nb.cells[2].source = 'print("changed")'
    nbformat.write(zh_nb, tmp_path / "notebooks" / "ch01_alpha.zh.ipynb")
    done = book.build(out := tmp_path / "book", execute_missing=False, log=lambda *a: None, root=tmp_path)
    assert done["executed"] == [] and done["zh"] == done["zh_notebooks"] == ["ch01_alpha"]
    assert not missing_targets(out), missing_targets(out)
    pages = {p.name: p.read_text() for p in out.glob("*.html")}
    assert sorted(pages) == ["ch01_alpha.html", "ch01_alpha.notebook.html", "ch01_alpha.zh.html",
                             "ch01_alpha.zh.notebook.html", "ch02_beta.html", "ch02_beta.notebook.html",
                             "index.html", "index.zh.html"]
    switch = {n: re.search(r'<span class="lang">(.*?)</span><nav>', p).group(1) for n, p in pages.items()}
    assert 'href="ch01_alpha.zh.html"' in switch["ch01_alpha.html"] and 'href="ch01_alpha.zh.notebook.html"' in switch["ch01_alpha.notebook.html"]
    assert 'href="ch01_alpha.html"' in switch["ch01_alpha.zh.html"] and "<b>中文</b>" in switch["ch01_alpha.zh.html"]
    assert "尚未写成" in switch["ch02_beta.html"] and "href" not in switch["ch02_beta.html"]
    assert 'href="index.zh.html"' in switch["index.html"] and 'href="index.html"' in switch["index.zh.html"]
    for name in ("ch01_alpha.zh.html", "ch01_alpha.zh.notebook.html", "index.zh.html"):
        assert '<html lang="zh-CN">' in pages[name], name
    assert '<html lang="en">' in pages["ch01_alpha.notebook.html"]
    zh = pages["ch01_alpha.zh.html"]
    assert "中文正文" in zh and "第 01 章 · 阿尔法之章" in zh and 'href="ch01_alpha.zh.notebook.html"' in zh
    assert '目录</a>' in zh and '下一章：ch02（英文）' in zh and 'href="ch01_alpha.zh.html"' in pages["ch01_alpha.html"]
    assert "中文说明" in pages["ch01_alpha.zh.notebook.html"] and "讲义" in pages["ch01_alpha.zh.notebook.html"]
    assert "shown 1" in pages["ch01_alpha.zh.notebook.html"] and "shown 2" not in pages["ch01_alpha.zh.notebook.html"]
    assert "shown 1" in pages["ch01_alpha.notebook.html"] and "shown 2" in pages["ch01_alpha.notebook.html"]
    assert re.findall(r'<li data-chapter="(\w+)">', index := pages["index.zh.html"]) == ["ch01_alpha", "ch02_beta"]
    assert '<a href="ch01_alpha.zh.html">第 01 章 · 阿尔法之章</a>' in index
    assert '第 02 章 · 贝塔之章（中文版尚未写成：<a href="ch02_beta.html"' in index
    # outputs only while the code is the same: a first code cell that differs leaves none at all
    english = nbformat.read(tmp_path / "build" / "executed" / "ch01_alpha.ipynb", as_version=4)
    zh_nb.cells[1].source = 'print("other")'
    assert book.with_outputs(zh_nb, english) == 0
    assert all(c.outputs == [] for c in zh_nb.cells if c.cell_type == "code")
