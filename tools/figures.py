"""Redraw every chapter's committed figures (chapters/chNN_slug/figures/*.png) from recorded data.

    python tools/figures.py                  # all chapters, from the recorded data (~15 s)
    python tools/figures.py ch07 ch08        # some chapters
    python tools/figures.py --rerun ch07     # re-measure ch07 (runs its scripts), save the data, redraw
    python tools/figures.py --out /tmp/figs  # draw into another folder (what the tests compare)

A chapter that draws figures has a `plots.py` with `make_figures(fig_dir: Path[, data]) -> list[Path]`.
A plots.py that measures something (runs the chapter's scripts, trains, times) also has
`measure() -> dict` and `MEASURE_S` (its rough cost in seconds): `--rerun` calls it and writes
what it returns to `figures/data.json` beside the figures (plain JSON, committed); without
`--rerun` the figures are drawn from that file, so drawing twice gives the same bytes. Formulas
and counted schedules are computed at draw time (quick and deterministic).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_NAME = "data.json"
DRAW_S_PER_CHAPTER = 0.8  # measured: 17 chapters drew in ~12 s (imports included), 2 cores


def plots_files(select: list[str] | None = None) -> list[Path]:
    """Each chapter's plots.py, in chapter order, restricted to the chapter prefixes given."""
    found = sorted((REPO_ROOT / "chapters").glob("ch[0-9][0-9]_*/plots.py"))
    return [p for p in found if not select or any(p.parent.name.startswith(s) for s in select)]


def data_path(plots: Path) -> Path:
    return plots.parent / "figures" / DATA_NAME


def plain(value):
    """`value` as plain JSON: tuples to lists, non-finite floats to null (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def save_data(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plain(data), indent=1, allow_nan=False) + "\n")


def load_data(path: Path) -> dict:
    return json.loads(path.read_text())


def draw(module, plots: Path, fig_dir: Path, rerun: bool) -> list[Path]:
    """Measure (if asked) and draw one chapter's figures into fig_dir."""
    if not hasattr(module, "measure"):
        return list(module.make_figures(fig_dir))
    path = data_path(plots)
    if rerun:
        save_data(path, module.measure())
        print("recorded", path.relative_to(REPO_ROOT))
    elif not path.exists():
        raise SystemExit(f"{path.relative_to(REPO_ROOT)} is missing: "
                         f"run python tools/figures.py --rerun {plots.parent.name[:4]}")
    return list(module.make_figures(fig_dir, load_data(path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter prefixes, e.g. ch01 ch07 (default: all)")
    parser.add_argument("--rerun", action="store_true",
                        help="re-measure (run the chapters' scripts) and rewrite figures/data.json")
    parser.add_argument("--out", type=Path, default=None,
                        help="draw into OUT/chNN_slug/ instead of the chapters' figures/ folders")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    files = plots_files(args.chapters)
    if not files:
        print(f"no chapter matches {' '.join(args.chapters)}", file=sys.stderr)
        return 2
    modules = [importlib.import_module(f"chapters.{p.parent.name}.plots") for p in files]
    n_pngs = sum(len(list((p.parent / "figures").glob("*.png"))) for p in files)
    draw_s = DRAW_S_PER_CHAPTER * len(files)
    if args.rerun:
        measuring = [(p.parent.name[:4], m.MEASURE_S) for p, m in zip(files, modules)
                     if hasattr(m, "measure")]
        total = sum(s for _, s in measuring) + draw_s
        print(f"--rerun: re-measuring {', '.join(c for c, _ in measuring) or 'nothing'} "
              f"(~{total / 60:.0f} min, it runs the chapters' scripts), then drawing "
              f"{n_pngs} figures", flush=True)
    else:
        print(f"drawing {n_pngs} figures of {len(files)} chapters from recorded data, "
              f"~{draw_s:.0f} s", flush=True)
    start = time.perf_counter()
    for plots, module in zip(files, modules):
        fig_dir = plots.parent / "figures" if args.out is None else args.out / plots.parent.name
        for path in draw(module, plots, fig_dir, args.rerun):
            path = Path(path).resolve()
            print("wrote", path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
