"""The lessons' "on a GPU" blocks: what `./course gpu-check` measured, between two markers.

Each lesson (chapters/chNN_*/README.md, and any translation beside it, README.*.md) has one block

    <!-- gpu-figures:begin -->
    ...
    <!-- gpu-figures:end -->

that says, until a GPU check has run, that the GPU figures are not yet measured, and afterwards
what `./course gpu-check --fill-lessons runs/gpu-check/report.json` writes there from the report:
the chapter's result on that machine and its GPU figures. Only the text between the markers is
ever replaced; filling twice from the same report changes nothing the second time. A Chinese
lesson (README.zh.md) gets the same figures in Chinese, and where its section was current with the
English (tools/bilingual.py's stamp), its stamp follows the English section's new text, so that the
two stay in step without hiding a translation that was already stale.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.bilingual_text import carry_stamps

REPO_ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu-figures:begin -->", "<!-- gpu-figures:end -->"
BLOCK = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.DOTALL)
NOT_MEASURED = ("**On a GPU:** not yet measured. No script of this chapter has run on a GPU yet; "
                "the first\n`./course gpu-check` on a GPU machine writes its results and GPU "
                "figures here\n(`./course gpu-check --fill-lessons runs/gpu-check/report.json`).\n")


def lessons(root: Path = REPO_ROOT) -> list[Path]:
    """Every lesson file: chapters/chNN_*/README.md and its translations (README.zh.md, ...)."""
    return sorted(root.glob("chapters/ch[0-9][0-9]_*/README*.md"))


WORDS = {  # the block's own words; what comes from the report (status, names) stays as it is
    "en": {"on": "**On a GPU** ({where}): {status}", "runs": " (runs: {runs}).", "end": ".",
           "table": "| GPU figure (timing phase, one run at a time) | measured | run |",
           "row": "| {name} ({script}, world {world}) | {value} | {run} |", "note": "Note: {note}.",
           "cannot": "What {gpus} GPU(s) on one node cannot test: {what}."},
    "zh": {"on": "**GPU 上**（{where}）：{status}", "runs": "（运行：{runs}）。", "end": "。",
           "table": "| GPU 数值（计时阶段，一次只跑一个） | 实测 | 运行 |",
           "row": "| {name}（{script}，world {world}） | {value} | {run} |", "note": "注：{note}。",
           "cannot": "单节点上 {gpus} 张 GPU 测不了的：{what}。"},
}


def block_text(chapter: dict, report: dict, lang: str = "en") -> str:
    """What goes between the markers for one chapter's entry of report.json, in `lang`."""
    w, m = WORDS[lang], report["machine"]
    where = (f"{m.get('gpu', 'no GPU')} x {m['gpus']}, torch {m['torch']}, CUDA {m.get('cuda', '-')}, "
             f"`./course gpu-check` of {report.get('date', '?')}")
    status = (chapter["status"] + (f": {chapter['why']}" if chapter.get("why") else "")).replace("\n", " ")
    runs = ", ".join(f"{n} {s}" for s, n in chapter.get("runs", {}).items() if n)
    lines = [w["on"].format(where=where, status=status) + (w["runs"].format(runs=runs) if runs else w["end"])]
    figures = chapter.get("figures", {})
    if figures:
        lines += ["", w["table"], "|---|---|---|"]
        for name, f in figures.items():
            value = f"{f['measured']}" + (f" {f['unit']}" if f.get("unit") else "")
            lines.append(w["row"].format(name=name, script=f["script"], world=f["world"], value=value,
                                         run=f["run"]))
    if chapter.get("figures_note"):
        lines += ["", w["note"].format(note=chapter["figures_note"])]
    cannot = [c["what"] for c in report.get("cannot_test", [])]
    if cannot:
        lines += ["", w["cannot"].format(gpus=m["gpus"], what="; ".join(cannot))]
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
    changed, english = [], {}
    for path in sorted(lessons(root), key=lambda p: (p.parent, p.name != "README.md")):
        chapter = report["chapters"].get(path.parent.name)
        text = path.read_text()
        if chapter is None or BEGIN not in text:
            continue
        lang = "zh" if path.name == "README.zh.md" else "en"
        new = replace_block(text, block_text(chapter, report, lang))
        if path.name == "README.md":
            english[path.parent] = (text, new)
        elif lang == "zh" and path.parent in english:
            new = carry_stamps(new, *english[path.parent])
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed
