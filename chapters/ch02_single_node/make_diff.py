"""The diff single.py → train.py in the chapter's README, between the markers
`<!-- diff:start -->` and `<!-- diff:end -->`, generated so the lesson never shows a stale diff.

    python tools/figures.py ch02     # rewrites it, with the chapter's figure (plots.py calls write_readme)

tests/test_ch02_single_node.py fails when the README's block differs from `render_diff()`. The
Chinese lesson (README.zh.md) holds the same block and is rewritten with it; its section's stamp
follows the English one's where it was current, as tools/gpu_lessons.py's GPU figures do.
The module docstrings (which differ in their run commands) are left out of the diff. This is a
module, not a script: the course's scripts are training scripts with the common options.
"""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
ZH = HERE / "README.zh.md"
READMES = (README, ZH)
START, END = "<!-- diff:start -->", "<!-- diff:end -->"


def code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring."""
    text = path.read_text()
    body = ast.parse(text).body
    skip = body[0].end_lineno if body and isinstance(body[0], ast.Expr) else 0
    return text.splitlines(keepends=True)[skip:]


def render_diff(old: str = "single.py", new: str = "train.py", context: int = 1) -> str:
    """A unified diff of the two scripts' code, as a fenced markdown block."""
    lines = difflib.unified_diff(code_lines(HERE / old), code_lines(HERE / new),
                                 fromfile=old, tofile=new, n=context)
    return "```diff\n" + "".join(lines) + "```\n"


def readme_with_diff(readme: str, diff: str) -> str:
    """The README text with the block between the markers replaced by `diff`."""
    head, start, rest = readme.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"README.md lacks the markers {START} ... {END}")
    return f"{head}{START}\n{diff}{END}{tail}"


def write_readme() -> Path:
    """Rewrite the lessons' diff block (English, and Chinese where it exists) from the files. The
    block is code, the same in both languages: where the Chinese section's stamp was current, it
    follows the English section's new text (tools/bilingual_text.py's `carry_stamps`)."""
    from tools.bilingual_text import carry_stamps

    diff = render_diff()
    old_en = README.read_text()
    new_en = readme_with_diff(old_en, diff)
    README.write_text(new_en)
    if ZH.exists():
        ZH.write_text(carry_stamps(readme_with_diff(ZH.read_text(), diff), old_en, new_en))
    return README
