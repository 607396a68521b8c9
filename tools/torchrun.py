"""torchrun, as `./course run` starts it: the same launcher, with a failed run summarised in one line.

    python tools/torchrun.py --standalone --nproc_per_node=2 chapters/ch03_data_parallel/train.py

When a rank fails, torchrun stops the others and ends with a ~40-line `ChildFailedError` traceback
whose first entry is often a rank it stopped itself ("rank 1 ... SIGTERM"). The ranks have already
said what went wrong, above it; this prints which rank failed first, with its exit code, and exits
with that code. Everything else is torchrun's own `main`.
"""

from __future__ import annotations

import logging
import signal
import sys


def describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # The agent's per-process notices ("Sending process ... SIGTERM", "failed (exitcode ...)")
    # repeat what the summary below says.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        torchrun(argv)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        others = len(e.failures) - 1
        stopped = f"; torchrun then stopped {others} other rank{'s' * (others > 1)}" if others else ""
        print(f"course: {e.name} failed: rank {rank} {describe(first.exitcode)} first{stopped}. "
              "Its own messages are above.", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
