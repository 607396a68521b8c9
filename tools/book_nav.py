"""The book's pages in its two languages: their names, titles, headers with the language switch,
and the two contents pages (tools/book.py renders the lessons and notebooks into them).

A chapter has an English lesson page chNN_slug.html and notebook page chNN_slug.notebook.html;
when its Chinese lesson chapters/chNN_slug/README.zh.md exists, also chNN_slug.zh.html, and when
notebooks/chNN_slug.zh.ipynb exists too, chNN_slug.zh.notebook.html. Every page's header says
"English · 中文" and links the other language's page; a page without a Chinese twin says that the
Chinese is not yet written, in plain text (no link to a page that does not exist).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from tools.book_assets import MATHJAX_SCRIPT, STYLE

BOOK_TITLE = "Distributed training, from one device to many"
BOOK_TITLE_ZH = "分布式训练：从一台设备到多台"
VIEWPORT = '<meta name="viewport" content="width=device-width, initial-scale=1">'
NOT_YET = '<span lang="zh-CN">中文版尚未写成</span> (the Chinese is not yet written)'
# the header's words, English and Chinese
WORDS = {False: {"contents": "contents", "previous": "previous: ", "next": "next: ", "lesson": "lesson",
                 "notebook": "notebook", "to_notebook": "notebook, executed", "end": "next: the contents",
                 "english": ""},
         True: {"contents": "目录", "previous": "上一章：", "next": "下一章：", "lesson": "讲义",
                "notebook": "notebook", "to_notebook": "notebook（已执行）", "end": "下一章：目录",
                "english": "（英文）"}}


def page_name(chapter: Path, notebook: bool = False, zh: bool = False) -> str:
    return f"{chapter.name}{'.zh' if zh else ''}{'.notebook' if notebook else ''}.html"


def lesson_page(chapter: Path) -> str:
    return page_name(chapter)


def notebook_page(chapter: Path) -> str:
    return page_name(chapter, notebook=True)


def chapter_title(chapter: Path, zh: bool = False) -> str:
    """Line 1 of the lesson (README.md, or README.zh.md for zh), without its '# '."""
    for line in (chapter / ("README.zh.md" if zh else "README.md")).read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return chapter.name


def table_titles(root: Path) -> dict[str, str]:
    """Chapter number -> its Chinese title, from the 中文 column of the top README's table."""
    titles, column = {}, None
    for line in (root / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None and "中文" in cells and "#" in cells:
            column = cells.index("中文")
        elif column is not None and re.fullmatch(r"\d\d", cells[0]) and len(cells) > column:
            titles[cells[0]] = cells[column]
    return titles


class Twins:
    """Which chapters have Chinese pages, and each chapter's Chinese title."""

    def __init__(self, chapters: list[Path], root: Path):
        self.chapters = chapters
        self.zh = [c for c in chapters if (c / "README.zh.md").exists()]
        self.zh_notebooks = [c for c in self.zh if (root / "notebooks" / f"{c.name}.zh.ipynb").exists()]
        self.table = table_titles(root) if (root / "README.md").exists() else {}

    def has(self, chapter: Path, notebook: bool = False) -> bool:
        return chapter in (self.zh_notebooks if notebook else self.zh)

    def title(self, chapter: Path, zh: bool) -> str:
        """The Chinese lesson's title; before it is written, '第 NN 章 · ' and the README table's."""
        if not zh:
            return chapter_title(chapter)
        if self.has(chapter):
            return chapter_title(chapter, zh=True)
        number = chapter.name[2:4]
        return f"第 {number} 章 · {self.table[number]}" if number in self.table else chapter_title(chapter)

    def link(self, chapter: Path, zh: bool, notebook: bool = False) -> tuple[str, str]:
        """(page, suffix): the page a reader of language zh is sent to, in Chinese where it exists."""
        if zh and self.has(chapter, notebook):
            return page_name(chapter, notebook, zh=True), ""
        return page_name(chapter, notebook), WORDS[zh]["english"]


def lang_switch(twin: str | None, zh: bool) -> str:
    """'English · 中文', the other language a link to its page `twin` (None: not yet written)."""
    if zh:
        return (f' <span class="lang"><a href="{twin}" hreflang="en" lang="en">English</a> · '
                '<b>中文</b></span>')
    other = (f'<a href="{twin}" hreflang="zh-CN" lang="zh-CN">中文</a>' if twin else NOT_YET)
    return f' <span class="lang"><b>English</b> · {other}</span>'


def nav_for(chapters: list[Path], i: int, notebook: bool, zh: bool = False,
            twins: Twins | None = None) -> str:
    """The header every page of a chapter has, lesson and notebook alike: the book, the chapter
    and which of its two pages this is, the language switch, then contents, previous, the other
    page, next (the last chapter's next is the contents). Chinese pages say it in Chinese and
    link Chinese pages where they exist (else the English page, marked 英文)."""
    twins = twins or Twins(chapters, chapters[0].parents[1])
    here, w = chapters[i], WORDS[zh]
    kind = w["notebook"] if notebook else w["lesson"]
    title = (f'<span class="book">{html.escape(BOOK_TITLE_ZH if zh else BOOK_TITLE)}</span> · '
             f'<span class="chapter">{html.escape(twins.title(here, zh))}</span> · '
             f'<span class="kind">{kind}</span>')
    twin = page_name(here, notebook) if zh else (
        page_name(here, notebook, zh=True) if twins.has(here, notebook) else None)
    links = [f'<a href="{"index.zh.html" if zh else "index.html"}">{w["contents"]}</a>']
    if i > 0:
        target, suffix = twins.link(chapters[i - 1], zh)
        links.append(f'<a href="{target}">{w["previous"]}{chapters[i - 1].name[:4]}{suffix}</a>')
    other, suffix = twins.link(here, zh, notebook=not notebook)
    links.append(f'<a href="{other}">{w["lesson"]}{suffix}</a>' if notebook
                 else f'<a href="{other}">{w["to_notebook"]}{suffix}</a>')
    if i + 1 < len(chapters):
        target, suffix = twins.link(chapters[i + 1], zh)
        links.append(f'<a class="next" href="{target}">{w["next"]}{chapters[i + 1].name[:4]}{suffix}</a>')
    else:
        links.append(f'<a class="next" href="{"index.zh.html" if zh else "index.html"}">{w["end"]}</a>')
    return (f'<header class="course-header">{title}{lang_switch(twin, zh)}<nav>'
            + " · ".join(links) + "</nav></header>")


def page(title: str, body: str, mathjax: bool, nav: str = "", zh: bool = False) -> str:
    head = MATHJAX_SCRIPT if mathjax else ""
    return (f"<!DOCTYPE html>\n<html lang=\"{'zh-CN' if zh else 'en'}\"><head><meta charset=\"utf-8\">"
            f"{VIEWPORT}<title>{html.escape(title)}</title><style>{STYLE}</style>{head}</head>\n"
            f"<body>{nav}\n{body}\n{footer(nav)}</body></html>\n")


def footer(header_html: str) -> str:
    """The header's links again at the bottom of the page (where a reader finishes)."""
    links = re.search(r"<nav>.*?</nav>", header_html, re.S)
    return f"<footer>{links.group(0)}</footer>" if links else ""


def write_indexes(out: Path, chapters: list[Path], twins: Twins) -> None:
    """index.html (English titles) and index.zh.html (Chinese titles, linking the Chinese pages
    where they exist, else saying so and linking the English ones)."""
    items = "\n".join(
        f'<li><a href="{lesson_page(c)}">{html.escape(chapter_title(c))}</a> '
        f'(<a href="{notebook_page(c)}">notebook</a>)</li>' for c in chapters)
    intro = ("<p>Every lesson of the course, and its notebook executed on a CPU with its outputs. "
             "Built by <code>./course book</code>; it opens offline.</p>")
    first = (f'<header class="course-header"><span class="book">{html.escape(BOOK_TITLE)}</span>'
             f'{lang_switch("index.zh.html", False)}<nav><a class="next" href="{lesson_page(chapters[0])}">'
             f'next: {chapters[0].name[:4]}</a></nav></header>') if chapters else ""
    (out / "index.html").write_text(page(BOOK_TITLE, f"<h1>Distributed training: the book</h1>{intro}"
                                         f"<ol class=\"chapters\">\n{items}\n</ol>", False, first))
    rows = []
    for c in chapters:
        title = html.escape(twins.title(c, zh=True))
        if twins.has(c):
            nb, suffix = twins.link(c, True, notebook=True)
            rows.append(f'<li data-chapter="{c.name}"><a href="{page_name(c, zh=True)}">{title}</a>'
                        f'（<a href="{nb}">notebook{suffix}</a>）</li>')
        else:
            rows.append(f'<li data-chapter="{c.name}">{title}（中文版尚未写成：'
                        f'<a href="{lesson_page(c)}" hreflang="en">English</a>）</li>')
    intro = (f"<p>课程的每一章：讲义，以及在 CPU 上执行过、带输出的 notebook。已有中文版的 {len(twins.zh)} 章"
             "链接中文页面，其余链接英文原文。由 <code>./course book</code> 生成，可离线打开。</p>")
    if chapters:
        target, suffix = twins.link(chapters[0], True)
        first = (f'<header class="course-header"><span class="book">{html.escape(BOOK_TITLE_ZH)}</span>'
                 f'{lang_switch("index.html", True)}<nav><a class="next" href="{target}">'
                 f'下一章：{chapters[0].name[:4]}{suffix}</a></nav></header>')
    (out / "index.zh.html").write_text(page(BOOK_TITLE_ZH, f"<h1>分布式训练：全书目录</h1>{intro}"
                                            f"<ol class=\"chapters\">\n{chr(10).join(rows)}\n</ol>",
                                            False, first, zh=True))
