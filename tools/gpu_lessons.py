"""The lessons' "on a GPU" blocks: what `./course gpu-check` measured, between two markers.

Each lesson (chapters/chNN_*/README.md, and any translation beside it, README.*.md) has one block

    <!-- gpu-figures:begin -->
    ...
    <!-- gpu-figures:end -->

that says, until a GPU check has run, that the GPU figures are not yet measured, and afterwards
what `./course gpu-check --fill-lessons runs/gpu-check/report.json` writes there from the report:
the chapter's result on that machine and its GPU figures. Only the text between the markers is
ever replaced; filling twice from the same report changes nothing the second time.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu-figures:begin -->", "<!-- gpu-figures:end -->"
BLOCK = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.DOTALL)
NOT_MEASURED = ("**On a GPU:** not yet measured. No script of this chapter has run on a GPU yet; "
                "the first\n`./course gpu-check` on a GPU machine writes its results and GPU "
                "figures here\n(`./course gpu-check --fill-lessons runs/gpu-check/report.json`).\n")


def lessons(root: Path = REPO_ROOT) -> list[Path]:
    """Every lesson file: chapters/chNN_*/README.md and its translations (README.zh.md, ...)."""
    return sorted(root.glob("chapters/ch[0-9][0-9]_*/README*.md"))


def block_text(chapter: dict, report: dict) -> str:
    """What goes between the markers for one chapter's entry of report.json."""
    m = report["machine"]
    where = (f"{m.get('gpu', 'no GPU')} x {m['gpus']}, torch {m['torch']}, CUDA {m.get('cuda', '-')}, "
             f"`./course gpu-check` of {report.get('date', '?')}")
    status = chapter["status"] + (f": {chapter['why']}" if chapter.get("why") else "")
    runs = ", ".join(f"{n} {s}" for s, n in chapter.get("runs", {}).items() if n)
    lines = [f"**On a GPU** ({where}): {status.replace(chr(10), ' ')}" + (f" (runs: {runs})." if runs else ".")]
    figures = chapter.get("figures", {})
    if figures:
        lines += ["", "| GPU figure (timing phase, one run at a time) | measured | run |", "|---|---|---|"]
        for name, f in figures.items():
            unit = f" {f['unit']}" if f.get("unit") else ""
            lines.append(f"| {name} ({f['script']}, world {f['world']}) | {f['measured']}{unit} | {f['run']} |")
    if chapter.get("figures_note"):
        lines += ["", f"Note: {chapter['figures_note']}."]
    cannot = [c["what"] for c in report.get("cannot_test", [])]
    if cannot:
        lines += ["", f"What {m['gpus']} GPU(s) on one node cannot test: {'; '.join(cannot)}."]
    return "\n".join(lines) + "\n"


def add_block(text: str, before: str = "\n## How the code works") -> str:
    """`text` with a not-yet-measured block added at the end of its "What you should see"
    section (before `before`), unless it has one already."""
    if BEGIN in text:
        return text
    if before not in text:
        raise ValueError(f"no {before.strip()!r} heading to put the block before")
    return text.replace(before, f"\n{BEGIN}\n{NOT_MEASURED}{END}\n{before}", 1)


def replace_block(text: str, inner: str) -> str:
    """`text` with what lies between its one pair of markers replaced by `inner`; the rest of
    the text byte for byte as it was. ValueError if the markers are not there exactly once."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or not BLOCK.search(text):
        raise ValueError("needs exactly one gpu-figures block (begin marker, newline, ..., end marker)")
    return BLOCK.sub(lambda _: f"{BEGIN}\n{inner}{END}", text, count=1)


def fill_lessons(report: dict, root: Path = REPO_ROOT) -> list[Path]:
    """Write each chapter of `report` (report.json, parsed) into its lessons' blocks. Lessons
    without a block, and chapters the report does not hold, are left alone. The files changed."""
    changed = []
    for path in lessons(root):
        chapter = report["chapters"].get(path.parent.name)
        text = path.read_text()
        if chapter is None or BEGIN not in text:
            continue
        new = replace_block(text, block_text(chapter, report))
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed
