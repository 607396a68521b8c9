"""Keep each Chinese lesson true to its English twin (issue 24's file formats, GLOSSARY.md).

    python tools/bilingual.py check              # every chapter with a Chinese text, and the root
    python tools/bilingual.py check ch03 root    # just these (chNN, NN or root)
    python tools/bilingual.py stamp ch03         # after translating: write the <!-- en: ... --> stamps

A lesson is cut into sections: a heading line (`#`..`######` at line start, outside ``` fences) and
everything up to the next one; the text before the first heading is section 0. README.zh.md must
have the English's sections in the same order with the same heading levels; under each heading
`<!-- en: XXXXXXXXXX -->`, the first 10 hex digits of sha256 of the English section it translates
(heading and body, each line's trailing whitespace stripped, the language-switch line left out),
so an English edit fails the check until the Chinese is updated and stamped again. Over the file:
the same fenced code blocks byte for byte and the same images in order. Per section: the same
multiset of link targets (`#fragment` dropped, README.zh.md read as README.md), every inline code
span and `$math$` of the English at least as often, and every number of the English prose (outside
code and math; thousands separators `,`, space, U+2009, U+202F removed; Chinese `1.2 万`, `3 亿`
also count multiplied out). No Chinese text may use a rejected variant of GLOSSARY.md. Line 2 of
README.zh.md is `[English](README.md) · 中文`; README.md then has `English · [中文](README.zh.md)`.
chapters/chNN/lesson.zh.md holds the Chinese of lesson.py's markdown cells, each under
`<!-- cell N en: XXXXXXXXXX -->` (the stamp of the English cell's source), with the same per-cell
rules; tools/notebooks.py builds notebooks/chNN_slug.zh.ipynb from it. The root README.zh.md is
held to sections, stamps, code blocks, numbers and links (not inline code).
`stamp` writes the stamps only when the sections (or cells) line up, then prints what else is off.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import notebooks  # noqa: E402
from tools.bilingual_text import (  # noqa: E402
    EN_SWITCH,
    HEADING,
    REPO_ROOT,
    STAMP,
    ZH_SWITCH,
    Prose,
    Section,
    emphasis_problems,
    glossary_problems,
    kinds,
    read_prose,
    sections,
    stamp_of,
)


def compare_prose(en: Prose, zh: Prose, where: str, base: Path, inline: bool = True) -> list[str]:
    """The per-section (per-cell) rules: links, inline code and math, numbers."""
    problems = []
    for target, n in (en.links - zh.links).items():
        problems.append(f"{where}: link to {target} of the English is missing ({n}x)")
    for target, n in (zh.links - en.links).items():
        problems.append(f"{where}: link to {target} is not in the English section ({n}x)")
    for target in zh.raw_links:
        t = target.split("#", 1)[0]
        if t.endswith("README.zh.md") and "://" not in t and not (base / t).exists():
            problems.append(f"{where}: links to {t}, which does not exist (link its README.md)")
    for kind, en_spans, zh_spans in (("inline code", en.codes, zh.codes), ("math", en.maths, zh.maths)):
        if inline:
            for span, n in (en_spans - zh_spans).items():
                problems.append(f"{where}: {kind} {span!r} of the English is missing ({n}x)")
    for value, written in en.numbers.items():
        if value not in zh.numbers:
            problems.append(f"{where}: number {written} of the English is missing")
    return problems


def compare_texts(en_text: str, zh_text: str, label: str, base: Path, inline: bool = True,
                  stamps: bool = True) -> list[str]:
    """Every problem between an English markdown text and its Chinese translation."""
    en, zh = sections(en_text), sections(zh_text)
    structure = structure_problems(en, zh, label)
    en_code = [b for s in en for b in s.code]
    zh_code = [(b, k) for k, s in enumerate(zh) for b in s.code]
    problems = [f"{label}: {len(zh_code)} code blocks, the English has {len(en_code)}"] \
        if len(en_code) != len(zh_code) else []
    for i, (a, (b, k)) in enumerate(zip(en_code, zh_code), 1):
        if a != b:
            x, y = next((x, y) for x, y in zip(a.splitlines() + [""], b.splitlines() + [""]) if x != y)
            problems.append(f"{label} {zh[k].label(k)}: code block {i} differs from the English "
                            f"(English {x.strip()[:50]!r}, Chinese {y.strip()[:50]!r})")
    en_prose = [read_prose(s.prose) for s in en]
    zh_prose = [read_prose(s.prose, chinese=True) for s in zh]
    en_images = [i for p in en_prose for i in p.images]
    zh_images = [i for p in zh_prose for i in p.images]
    if en_images != zh_images:
        problems.append(f"{label}: images {zh_images} differ from the English's {en_images} (same order)")

    def where(k: int) -> str:  # a notebook cell's text before its first heading: just the cell
        return label if k == 0 and not stamps else f"{label} {zh[k].label(k)}"

    for k, s in enumerate(zh):
        problems += glossary_problems("\n".join(s.lines), where(k))
        problems += emphasis_problems("\n".join(s.prose), where(k))
    if structure:
        return structure + problems  # sections do not line up: the per-section rules would be noise
    for k, (e, z) in enumerate(zip(en, zh)):
        if stamps and k > 0:
            got = STAMP.match(z.lines[1].strip()) if len(z.lines) > 1 else None
            if got is None:
                problems.append(f"{where(k)}: no <!-- en: ... --> stamp under the heading (run stamp)")
            elif got.group(1) != stamp_of("\n".join(e.lines)):
                problems.append(f"{where(k)}: stale stamp en: {got.group(1)}: the English section "
                                f"({e.heading.strip()}) changed; update the Chinese, then run stamp")
        problems += compare_prose(en_prose[k], zh_prose[k], where(k), base, inline)
    return problems


def structure_problems(en: list[Section], zh: list[Section], label: str) -> list[str]:
    """Same number of sections, same heading level each: what `stamp` needs before it writes."""
    levels_en, levels_zh = [s.level for s in en], [s.level for s in zh]
    if levels_en == levels_zh:
        return []
    k = next((i for i, (a, b) in enumerate(zip(levels_en, levels_zh)) if a != b), min(len(en), len(zh)))
    e = en[k].heading.strip() if k < len(en) else "(none)"
    z = zh[k].heading.strip() if k < len(zh) else "(none)"
    if len(en) != len(zh):
        return [f"{label}: {len(zh) - 1} sections, the English has {len(en) - 1}; the first "
                f"difference is section {k}: English {e!r}, Chinese {z!r}"]
    return [f"{label} section {k} ({z}): heading level {levels_zh[k]}, the English ({e}) has {levels_en[k]}"]


def readme_problems(folder: Path, name: str) -> list[str]:
    en_path, zh_path = folder / "README.md", folder / "README.zh.md"
    if not en_path.exists():
        return []
    en_lines = en_path.read_text().splitlines()
    if not zh_path.exists():
        return [f"{name} README.md: says {EN_SWITCH!r} but README.zh.md does not exist"] \
            if EN_SWITCH in (line.strip() for line in en_lines) else []
    zh_text = zh_path.read_text()
    zh_lines, label = zh_text.splitlines(), f"{name} README.zh.md"
    problems = []
    if len(en_lines) < 2 or en_lines[1].strip() != EN_SWITCH:
        problems.append(f"{name} README.md: line 2 must be {EN_SWITCH!r} (its Chinese twin exists; stamp writes it)")
    if not zh_lines or not HEADING.match(zh_lines[0]):
        problems.append(f"{label}: line 1 must be the Chinese title heading")
    if len(zh_lines) < 2 or zh_lines[1].strip() != ZH_SWITCH:
        problems.append(f"{label}: line 2 must be {ZH_SWITCH!r}")
    return problems + compare_texts("\n".join(en_lines), zh_text, label, folder, inline=name != "root")


def lesson_problems(chapter: Path, name: str) -> list[str]:
    """lesson.zh.md against lesson.py's markdown cells: count, stamps, then the per-cell rules."""
    zh_path = chapter / "lesson.zh.md"
    if not zh_path.exists() or not (chapter / "lesson.py").exists():
        return []
    label = f"{name} lesson.zh.md"
    en = [c.source for c in notebooks.lesson_notebook(chapter).cells if c.cell_type == "markdown"]
    zh_text = zh_path.read_text()
    zh = notebooks.zh_cells(zh_text)
    problems = cell_structure_problems(len(en), zh, label, zh_text)
    if problems:
        return problems + glossary_problems(zh_text, label)
    for (n, got, text), source in zip(zh, en):
        where = f"{label} cell {n}"
        if got != stamp_of(source.strip()):
            problems.append(f"{where}: stale stamp en: {got or '(empty)'}: the English cell "
                            f"({source.strip().splitlines()[0][:50]!r}) changed; update it, then run stamp")
        problems += compare_texts(source.strip(), text, where, notebooks.NOTEBOOKS, stamps=False)
    return problems


def cell_structure_problems(count: int, zh: list, label: str, zh_text: str) -> list[str]:
    numbers = [n for n, _, _ in zh]
    if numbers != list(range(count)):
        return [f"{label}: cells numbered {numbers[:3]}..{numbers[-3:]} ({len(zh)}), lesson.py has "
                f"{count} markdown cells: want <!-- cell N en: ... --> for N = 0..{count - 1} in order"]
    if notebooks.ZH_MARKER.split(zh_text)[0].strip():
        return [f"{label}: text before <!-- cell 0 en: ... --> (every line belongs to a cell)"]
    return []


def resolve(name: str) -> tuple[Path, str]:
    """'ch03', '03', '3' or 'root' -> (folder, short name)."""
    if name == "root":
        return REPO_ROOT, "root"
    number = name[2:] if name.startswith("ch") else name
    found = sorted((REPO_ROOT / "chapters").glob(f"ch{int(number):02d}_*")) if number.isdigit() else []
    if not found:
        raise SystemExit(f"bilingual: no chapter {name!r} (want chNN, NN or root)")
    return found[0], found[0].name[:4]


def check(chapter: Path | str) -> list[str]:
    """Every problem between a chapter's (or the root's, given the repo root) two languages."""
    folder, name = resolve(chapter) if isinstance(chapter, str) else \
        (chapter, "root" if chapter == REPO_ROOT else chapter.name[:4])
    return readme_problems(folder, name) + lesson_problems(folder, name)


def stamp(chapter: Path | str, log=print) -> list[str]:
    """Write the stamps of README.zh.md and lesson.zh.md (and README.md's switch line) when their
    sections (cells) line up with the English. Returns the problems that stopped it (none: written)."""
    folder, name = resolve(chapter) if isinstance(chapter, str) else \
        (chapter, "root" if chapter == REPO_ROOT else chapter.name[:4])
    en_path, zh_path, lesson_zh = folder / "README.md", folder / "README.zh.md", folder / "lesson.zh.md"
    problems = []
    if zh_path.exists():
        en, zh_text = sections(en_path.read_text()), zh_path.read_text()
        problems += structure_problems(en, sections(zh_text), f"{name} README.zh.md")
    if lesson_zh.exists():
        en_cells = [c.source for c in notebooks.lesson_notebook(folder).cells if c.cell_type == "markdown"]
        zh_cells = notebooks.zh_cells(lesson_zh.read_text())
        numbers_ok = [n for n, _, _ in zh_cells] == list(range(len(en_cells)))
        if not numbers_ok:
            problems += cell_structure_problems(len(en_cells), zh_cells, f"{name} lesson.zh.md", lesson_zh.read_text())
    if problems or not (zh_path.exists() or lesson_zh.exists()):
        return problems or [f"{name}: neither README.zh.md nor lesson.zh.md to stamp"]
    if zh_path.exists():
        write_readme_stamps(en_path, zh_path, en, name, log)
    if lesson_zh.exists():
        text = lesson_zh.read_text()
        for n, source in enumerate(en_cells):
            text = re.sub(rf"^<!-- cell {n} en:[ \t]*[0-9a-f]*[ \t]*-->[ \t]*$",
                          f"<!-- cell {n} en: {stamp_of(source.strip())} -->", text, count=1, flags=re.M)
        if text != lesson_zh.read_text():
            lesson_zh.write_text(text)
            log(f"{name} lesson.zh.md: stamped {len(en_cells)} cells")
    return []


def write_readme_stamps(en_path: Path, zh_path: Path, en: list[Section], name: str, log) -> None:
    """Put `<!-- en: ... -->` under each heading of README.zh.md (after line 2's switch under the
    title), replacing an old stamp; add the switch line under README.md's title if missing."""
    lines = zh_path.read_text().splitlines()
    out, k, changed, skip = [], 0, [], 0
    for i, (line, kind) in enumerate(zip(lines, kinds(lines))):
        if skip:
            skip -= 1
            continue
        out.append(line)
        if kind != "heading":
            continue
        k += 1
        after = i + 1
        if after < len(lines) and lines[after].strip() == ZH_SWITCH:
            out.append(lines[after])
            after += 1
        want = f"<!-- en: {stamp_of(chr(10).join(en[k].lines))} -->"
        old = lines[after].strip() if after < len(lines) else ""
        if STAMP.match(old):
            after += 1
        if old != want:
            changed.append(str(k))
        out.append(want)
        skip = after - i - 1
    zh_path.write_text("\n".join(out) + "\n")
    log(f"{name} README.zh.md: {len(changed)} of {k} stamps written or updated"
        + (f" (sections {', '.join(changed)})" if changed else ""))
    en_lines = en_path.read_text().splitlines()
    if len(en_lines) < 2 or en_lines[1].strip() != EN_SWITCH:
        en_path.write_text("\n".join([en_lines[0], EN_SWITCH] + en_lines[1:]) + "\n")
        log(f"{name} README.md: added {EN_SWITCH!r} under its title")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="report every problem (exit 1 if any)")
    c.add_argument("names", nargs="*", help="chNN, NN or root (default: all with a Chinese text)")
    s = sub.add_parser("stamp", help="write the <!-- en: ... --> stamps once the sections line up")
    s.add_argument("name", help="chNN, NN or root")
    args = parser.parse_args(argv)
    if args.command == "stamp":
        refused = stamp(args.name)
        for p in refused:
            print(p, file=sys.stderr)
        if refused:
            print("nothing stamped: make the sections (cells) line up first", file=sys.stderr)
            return 1
        names = [args.name]
    else:
        names = args.names or ["root"] + [p.name[:4] for p in sorted((REPO_ROOT / "chapters").glob("ch[0-9][0-9]_*"))]
    problems = [p for n in names for p in check(n)]
    for p in problems:
        print(p)
    print(f"{len(problems)} problems in {', '.join(names)}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
