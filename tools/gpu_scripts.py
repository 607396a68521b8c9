"""The chapter scripts `./course gpu-check` runs, and the packages each needs to start.

A script is a chapter file with a `__main__` guard that calls `parse_config`. What it needs is
what it imports at module level (outside `try`), following this course's own modules, plus
`NEEDS` for what it imports only when it runs; a row whose package is missing is "skipped"
before anything is launched. Part of tools/gpu_check.py (its docstring tells the whole check).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Packages a script imports only when it runs (inside a function), so the import scan below
# cannot see them; the module-level imports of a script and of the course modules it imports
# are found by `imported_packages`.
NEEDS = {
    "ch06_hybrid_zero/deepspeed_zero": ["deepspeed"],
    "ch12_checkpointing/deepspeed_ckpt": ["deepspeed"],
    "ch19_moe/deepspeed_moe": ["deepspeed"],
    "ch21_hyperparameters/tune": ["ray"],
    "ch27_rlhf/trl_grpo": ["trl"],
    "ch24_cloud/train": ["fsspec"],  # its checkpoint store
    "ch25_llm/train": ["tokenizers", "transformers"],  # its tokenizer, its Hugging Face export
    "ch28_inference/train": ["transformers"],  # its reference Llama
}
NOT_IMPORTS = {"chapters", "common", "tools", "__future__"}


def chapter_scripts(only: list[str] = ()) -> list[Path]:
    scripts = sorted(p for p in REPO_ROOT.glob("chapters/ch[0-9][0-9]_*/*.py")
                     if "__main__" in (t := p.read_text()) and "parse_config(" in t)
    return [p for p in scripts if not only or any(p.parent.name.startswith(o) for o in only)]


def script_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def _module_file(name: str) -> Path | None:
    """chapters.ch03_x.train or common.log -> its file in this checkout, if it is one."""
    base = REPO_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _direct_imports(path: Path) -> tuple[frozenset[str], tuple[Path, ...]]:
    """(packages, this course's module files) that `path` imports at module level, outside `try`."""
    packages, own = set(), []
    for node in ast.parse(path.read_text()).body:  # module level only; a `try` is optional
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            top = name.split(".")[0]
            if top in NOT_IMPORTS:
                if (file := _module_file(name)) is not None:
                    own.append(file)
            elif top not in sys.stdlib_module_names:
                packages.add(top)
    return frozenset(packages), tuple(own)


def imported_packages(path: Path) -> set[str]:
    """The top-level packages that `path` imports when it is loaded (module-level imports, not
    those under `try` or inside functions), following this course's own modules (chapters.*,
    common.*): what must be installed for the script to start. The standard library is left out."""
    found: set[str] = set()
    todo, seen = [Path(path)], set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        packages, own = _direct_imports(file)
        found |= packages
        todo += own
    return found


def missing_packages(path: Path, absent: set[str] = frozenset()) -> list[str]:
    """The packages `path` needs (its imports, and NEEDS) that this interpreter cannot find (or
    that `absent` says the planned machine lacks)."""
    wanted = imported_packages(path) | set(NEEDS.get(script_id(path), []))
    return sorted(m for m in wanted if m in absent or importlib.util.find_spec(m) is None)

