"""The text side of tools/bilingual.py: a markdown lesson cut into sections, and what its rules
compare in each (code blocks, inline code, math, images, links, numbers), plus GLOSSARY.md's rows.
The formats are issue 24's; tools/bilingual.py's docstring states them.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ZH_SWITCH, EN_SWITCH = "[English](README.md) · 中文", "English · [中文](README.zh.md)"
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
HEADING = re.compile(r"^(#{1,6})(?:[ \t]|$)")
STAMP = re.compile(r"^<!-- en:[ \t]*([0-9a-f]*)[ \t]*-->$")
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
INLINE_MATH = re.compile(r"(?<![\\$\w])\$(?=[^\s$])((?:[^$\n]|\n(?![ \t]*\n))*?[^\s\\$])\$(?![\d$])")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
TAG = re.compile(r"</?[A-Za-z][^>\n]*>")
THOUSANDS = re.compile(r"(?<=\d)[, \u2009\u202f](?=\d{3}(?!\d))")
NUMBER = re.compile(r"\d+(?:\.\d+)*(?:e[+-]?\d+)?")
CJK_NUMBER = re.compile(r"(\d+(?:\.\d+)?)\s*(万亿|万|亿)")
CJK_UNITS = {"万": 10**4, "亿": 10**8, "万亿": 10**12}


@dataclass
class Section:
    heading: str  # the heading line ("" for the preamble)
    level: int  # 0 for the preamble
    lines: list[str] = field(default_factory=list)  # heading + body, switch line left out
    code: list[str] = field(default_factory=list)  # fenced blocks, fence lines included
    prose: list[str] = field(default_factory=list)  # the lines outside fences

    def label(self, k: int) -> str:
        return f"section {k}" + (f" ({self.heading.strip()})" if self.heading else " (before the first heading)")


def kinds(lines: list[str]) -> list[str]:
    """Each line's kind: "heading", "open" (a fence opening a code block), "code" (inside a block,
    its closing fence included) or "prose"."""
    out, fence = [], None
    for line in lines:
        opener = FENCE.match(line)
        if fence is None:
            out.append("open" if opener else "heading" if HEADING.match(line) else "prose")
            fence = opener.group(1) if opener else None
        else:
            out.append("code")
            if opener and opener.group(1)[0] == fence[0] and len(opener.group(1)) >= len(fence) \
                    and not line.strip()[len(opener.group(1)):].strip():
                fence = None
    return out


def sections(text: str) -> list[Section]:
    """The sections of a markdown text, the preamble first (headings inside fences are code)."""
    lines = text.splitlines()
    out = [Section("", 0)]
    for line, kind in zip(lines, kinds(lines)):
        if kind == "prose" and line.strip() in (ZH_SWITCH, EN_SWITCH):
            continue
        if kind == "heading":
            out.append(Section(line, len(HEADING.match(line).group(1))))
        out[-1].lines.append(line)
        if kind == "open":
            out[-1].code.append(line)
        elif kind == "code":
            out[-1].code[-1] += "\n" + line
        else:
            out[-1].prose.append(line)
    return out


def stamp_of(text: str) -> str:
    """First 10 hex digits of sha256 of `text`, each line's trailing whitespace stripped."""
    return hashlib.sha256("\n".join(line.rstrip() for line in text.splitlines()).encode()).hexdigest()[:10]


def carry_stamps(zh_text: str, old_en: str, new_en: str) -> str:
    """`zh_text` with each stamp that was current for a section of `old_en` moved to that section
    of `new_en`: for a generator that rewrote both languages alike (the GPU figures, chapter 02's
    diff); stale stamps stay stale, and nothing moves if the English's sections changed."""
    old, new = ([stamp_of("\n".join(s.lines)) for s in sections(t)] for t in (old_en, new_en))
    if len(old) != len(new):
        return zh_text
    moves = {f"<!-- en: {a} -->": f"<!-- en: {b} -->" for a, b in zip(old, new) if a != b}
    lines = [moves.get(line.strip(), line) for line in zh_text.splitlines()]
    return "\n".join(lines) + ("\n" if zh_text.endswith("\n") else "")


@dataclass
class Prose:
    codes: Counter
    maths: Counter
    images: list[str]
    links: Counter
    numbers: dict[str, str]  # canonical value -> the number as written
    raw_links: list[str]


def canonical(number: str) -> str:
    try:
        value = Decimal(number)
    except InvalidOperation:  # 2.4.1: a version, compared as written
        return number
    return str(int(value)) if value == value.to_integral_value() else format(value.normalize(), "f")


def read_prose(lines: list[str], chinese: bool = False) -> Prose:
    """What the rules compare in the prose of a section or cell (code blocks already removed)."""
    text = COMMENT.sub(" ", "\n".join(lines))
    codes = Counter(one_line(m.group(2)).strip() for m in CODE_SPAN.finditer(text))
    text = CODE_SPAN.sub(" ", text)
    maths = Counter(one_line(m.group(0)) for m in DISPLAY_MATH.finditer(text))
    text = DISPLAY_MATH.sub(" ", text)
    maths += Counter(one_line(m.group(0)) for m in INLINE_MATH.finditer(text))
    text = INLINE_MATH.sub(" ", text)
    images = IMAGE.findall(text)
    raw_links = LINK.findall(text)
    links = Counter(normal_link(t) for t in raw_links)
    text = TAG.sub(" ", re.sub(r"\]\([^)]*\)", "] ", text))
    text = THOUSANDS.sub("", text)
    numbers = {canonical(n): n for n in NUMBER.findall(text)}
    if chinese:
        for m in CJK_NUMBER.finditer(text):
            value = Decimal(m.group(1)) * CJK_UNITS[m.group(2)]
            numbers.setdefault(canonical(str(value)), m.group(0))
    return Prose(codes, maths, images, links, numbers, raw_links)


def one_line(span: str) -> str:
    """A code span or formula as markdown reads it: a line break (and its indent) is a space."""
    return re.sub(r"[ \t]*\n[ \t]*", " ", span)


def normal_link(target: str) -> str:
    target = target.split("#", 1)[0]
    return target[:-len("README.zh.md")] + "README.md" if target.endswith("README.zh.md") else target


def glossary(path: Path = REPO_ROOT / "GLOSSARY.md") -> list[tuple[str, str, str, list[str]]]:
    """(English, 中文, chapter, rejected variants) of each row of GLOSSARY.md's table."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] == "English" or set(cells[0]) <= set("-: "):
            continue
        rejected = [] if cells[-1] in ("—", "-", "") else [v.strip() for v in cells[-1].split(";")]
        rows.append((cells[0], cells[1], cells[2] if len(cells) > 2 else "", rejected))
    return rows


LEFT_OVER_EMPHASIS = re.compile(r"\*\*[^\n]*?\*\*|\*\*|(?<![\w*\\])\*(?=\S)[^*\n]*?(?<=\S)\*(?!\*)")


def emphasis_problems(prose: str, where: str) -> list[str]:
    """Bold or italic that CommonMark (GitHub, Jupyter) leaves as literal asterisks: in Chinese, a
    closing `**` after punctuation needs a space (or punctuation) after it, `**粗体：**中文` fails."""
    from markdown_it import MarkdownIt

    text = INLINE_MATH.sub("§", DISPLAY_MATH.sub("§", prose))  # a formula is one opaque token
    html = MarkdownIt("commonmark").enable("table").render(text)
    html = re.sub(r"<code>.*?</code>", " ", html, flags=re.S)
    shown = re.sub(r"<[^>]+>", "", html)
    return [f"{where}: emphasis not rendered (CommonMark needs a space after the closing * here): "
            f"{shown[max(m.start() - 15, 0):m.end() + 15].strip()!r}" for m in LEFT_OVER_EMPHASIS.finditer(shown)]


def glossary_problems(text: str, where: str) -> list[str]:
    return [f"{where}: uses {bad!r}, a rejected variant of {en!r} (GLOSSARY.md: {zh})"
            for en, zh, _, rejected in glossary() for bad in rejected if bad in text]
