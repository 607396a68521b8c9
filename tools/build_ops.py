"""Build the C++ operators DeepSpeed compiles on first use, once, before anything is timed.

    python tools/build_ops.py               # build what is missing; one line before, one after
    python tools/build_ops.py --log FILE    # the compiler's output goes to FILE (default: a
                                            # temporary file, named if the build fails)
    python tools/build_ops.py --stamp FILE  # afterwards, list in FILE the operators built (empty:
                                            # this machine needs none), for ./course to check

`./course setup` and `./course test` call it (so CI does too): on a CPU machine DeepSpeed builds
its shared-memory communication operator (`deepspeed_shm_comm`) the first time a process group
starts, about a minute on two idle cores and several minutes under load; inside a chapter's timed
test that build once took 224 s of chapter 06's budget. Built here, it is loaded from torch's
extension cache (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions) by every later run.

The operator is built exactly as DeepSpeed builds it at start-up (the accelerator's
`ShareMemCommBuilder`, the same name, sources and flags), so the cache entry is the one it looks
for. On CUDA DeepSpeed communicates through NCCL and builds nothing: nothing to do there.

A build killed halfway cannot hang a later one: torch guards the build folder with an advisory
lock that the kernel releases when its holder dies (torch.utils.cpp_extension, `FileLock` on
`<build folder>/lock`), not with a lock file whose existence blocks, and the next process simply
builds again. tests/test_course.py checks that a lock file left behind by a dead builder blocks no
load, and that a live builder's lock does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

OPS = ("ShareMemCommBuilder",)  # what the course's DeepSpeed runs build (chapters 06, 12, 18, 19)


def say(msg: str) -> None:
    print(f"course: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def output_to(path: Path):
    """File descriptors 1 and 2 (the compiler's output, DeepSpeed's prints, torch's C++ warnings)
    go to `path` for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def builders() -> list:
    """The operator builders this machine's DeepSpeed would run at start-up ([] if none)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__

    found = []
    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and __compatible_ops__.get(builder.NAME, False):
            found.append(builder)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, default=None,
                        help="file for the compiler's output (default: a temporary file)")
    parser.add_argument("--stamp", type=Path, default=None,
                        help="file to list the built operators in, once all are built")
    args = parser.parse_args(argv)
    from common.log import extension_folder, torch_extension_built

    log_path = args.log or Path(tempfile.mkstemp(prefix="course-ops-", suffix=".log")[1])
    try:
        with output_to(log_path):  # DeepSpeed's import says which accelerator it found
            found = builders()
        needed = [b.NAME for b in found]
        todo = [b for b in found if not torch_extension_built(b.NAME)]
    except ImportError:
        say("DeepSpeed is not installed: no operator to build (chapters 06, 12, 18, 19 need it)")
        needed = todo = []
    for builder in todo:
        say(f"building DeepSpeed's {builder.NAME} operator (once per machine; about a minute "
            f"on two idle cores) ...")
        start = time.perf_counter()
        try:
            with output_to(log_path):
                builder.load(verbose=False)
        except Exception as exc:  # a compiler missing or failing: the chapters would fail too
            say(f"building {builder.NAME} failed ({type(exc).__name__}); the compiler's output "
                f"is in {log_path}")
            return 1
        say(f"built {builder.NAME} in {time.perf_counter() - start:.0f} s")
    if args.log is None:  # kept only when a build failed
        log_path.unlink(missing_ok=True)
    if args.stamp is not None:
        args.stamp.parent.mkdir(parents=True, exist_ok=True)
        args.stamp.write_text("".join(f"{extension_folder(n) / (n + '.so')}\n" for n in needed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
