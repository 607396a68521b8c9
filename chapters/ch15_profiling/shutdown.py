"""Ending a process that used gloo under DDP or FSDP2 without an abort at exit.

DDP and FSDP2 keep references to the process group, so `destroy_process_group` does not destroy
it, and gloo's worker threads live on until the interpreter shuts down. A worker may still hold
the tensors of the last collective (the checks `RunRecorder.finish` gathers, just before the
end) when the main thread has already dropped their Python objects. Releasing them then takes the
GIL, and a thread that takes the GIL while Python shuts down is ended in a way that aborts the
process: "terminate called without an active exception", SIGABRT, exit status -6, after a run
that passed every check (pytorch/pytorch#190489). Here: 2 of 25 three-rank runs of chapter 16,
on a rank other than 0, with no traceback. A process group that nothing else holds is joined by
`destroy_process_group` (its worker threads end there), so chapter 14's hand-written all-reduce
is not affected.

Written for chapters 15 and 16; it belongs in `common.distributed` (teardown) and in
`common.launch` (the ranks that `run_on_ranks` starts).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import NoReturn


def exit_without_shutdown(code: int) -> NoReturn:
    """Exit with `code` now, skipping the interpreter's shutdown, where the abort happens. Call
    it last, after `teardown_distributed`, when every file is written and closed: it flushes the
    logs and the standard streams, then `os._exit`. No shutdown, no abort: a guarantee."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def let_gloo_workers_release(seconds: float = 0.2) -> None:
    """For a process that must end through Python's shutdown (a function run by
    `common.launch.run_on_ranks`, whose result is saved after it returns): wait with the GIL
    released after the last collective, so gloo's worker threads run and release its tensors
    first. A runnable thread gets a core within milliseconds even on a loaded machine, so 0.2 s
    is ample; unlike `exit_without_shutdown` it is a margin, not a guarantee."""
    time.sleep(seconds)
