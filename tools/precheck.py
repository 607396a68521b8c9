"""Check a chapter script's options in one plain process, before any rank starts.

    python tools/precheck.py chapters/ch03_data_parallel/train.py 2 --steps 50

parses the options exactly as the script will (`Config` and `validate(cfg, world_size)` from the
script's module) at the world size given, and exits with
  0  the options are valid: go on and launch;
  2  they are not: one line says why (an unknown option, a value out of range, a layout the
     world size cannot hold, a device or backend this machine cannot give that many processes);
  10 `--help` was asked for and printed: nothing to launch.
`./course run` calls it so that a typo costs a second, not a torchrun start per rank. A script
that starts its own processes (`# launch: python`) is validated at its own `--nprocs`, or 1.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HELP_PRINTED = 10


def script_module(path: str | Path):
    """Import a chapter script by its path (chapters/ch03_x/train.py -> chapters.ch03_x.train)."""
    path = Path(path).resolve()
    rel = path.relative_to(REPO_ROOT).with_suffix("")
    return importlib.import_module(".".join(rel.parts))


def launches_itself(path: str | Path) -> bool:
    """Does the script start its own processes (or run as one), i.e. `python`, not torchrun?"""
    return any(line.startswith("# launch: python") for line in Path(path).read_text().splitlines())


def pinned_torch() -> str:
    """The torch version requirements.txt pins (the lessons' numbers were made with it)."""
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith("torch=="):
            return line.split("==", 1)[1].strip()
    return ""


def torch_note(found: str, pinned: str) -> str | None:
    """One line when the torch found is not the pinned one (e.g. a GPU machine's own 2.11)."""
    found = found.split("+")[0]
    if not pinned or found == pinned:
        return None
    return (f"course: note: torch {found} found, the course is pinned to {pinned}; the scripts run,"
            " but figures and messages may differ from the lessons'")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[1].isdigit():
        print("usage: python tools/precheck.py SCRIPT WORLD_SIZE [options...]", file=sys.stderr)
        return 2
    script, world, args = Path(argv[0]), int(argv[1]), argv[2:]
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's code, whatever is installed
    from common.config import build_parser, parse_config

    module = script_module(script)
    import torch

    if note := torch_note(torch.__version__, pinned_torch()):
        print(note, file=sys.stderr)
    if any(a in ("-h", "--help") for a in args):
        build_parser(module.Config, description=module.__doc__, prog=script.name).print_help()
        return HELP_PRINTED
    validate = getattr(module, "validate", None)
    cfg = parse_config(module.Config, args, description=module.__doc__, prog=script.name)
    if launches_itself(script):
        world = getattr(cfg, "nprocs", 1)
    if validate is not None:
        try:
            validate(cfg, world)
        except ValueError as e:
            print(f"{script.name}: error: {e} (world size {world})", file=sys.stderr)
            return 2
    # The device and backend this machine can give `world` processes (--backend nccl on a CPU,
    # more processes than GPUs): refused here rather than in every rank's traceback.
    from common.distributed import DistributedSetupError, choose_device_and_backend

    try:
        choose_device_and_backend(0, world, getattr(cfg, "device", "auto"),
                                  getattr(cfg, "backend", "auto"))
    except DistributedSetupError as e:
        print(f"{script.name}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
