"""Regenerate every chapter's committed figures (chapters/chNN_slug/figures/*.png).

    python tools/figures.py          # all chapters
    python tools/figures.py ch01     # one chapter

A chapter that draws figures has a `plots.py` with `make_figures(fig_dir: Path) -> list[Path]`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapter", nargs="?", default="", help="chapter prefix, e.g. ch01")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    for plots in sorted((REPO_ROOT / "chapters").glob(f"{args.chapter}*/plots.py")):
        module = importlib.import_module(f"chapters.{plots.parent.name}.plots")
        for path in module.make_figures(plots.parent / "figures"):
            print("wrote", Path(path).resolve().relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
