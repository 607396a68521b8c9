"""Rank-aware logging and progress.

Rank 0 speaks at INFO; other ranks only warn, unless `all_ranks=True`, in which case every
line carries its rank. `print` is never shadowed: chapters call `log.info(...)`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator

log = logging.getLogger("course")


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is when a line is logged (Jupyter and pytest swap it)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(rank: int = 0, world_size: int = 1, all_ranks: bool = False) -> logging.Logger:
    """Configure the course logger for this rank and return it."""
    prefix = f"[rank {rank}] " if world_size > 1 and (all_ranks or rank != 0) else ""
    handler = _StdoutHandler()
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    return log


def progress(iterable: Iterable, total: int | None = None, desc: str = "",
             enabled: bool = True, every: int = 10) -> Iterator:
    """Iterate with a progress bar on a terminal (tqdm, if installed) or a log line every
    `every` items otherwise (CI logs, notebooks' subprocesses). Disabled on non-main ranks."""
    if not enabled:
        yield from iterable
        return
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            yield from tqdm(iterable, total=total, desc=desc, leave=False)
            return
    start = time.perf_counter()
    for i, item in enumerate(iterable, 1):
        yield item
        if i % every == 0 or i == total:
            of = f"/{total}" if total else ""
            log.info("%s %d%s (%.1f s)", desc, i, of, time.perf_counter() - start)
