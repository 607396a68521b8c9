"""Rank-aware logging, progress, and a log file for the libraries' noise.

Rank 0 speaks at INFO; other ranks only warn, unless `all_ranks=True`, in which case every
line carries its rank. `print` is never shadowed: chapters call `log.info(...)`.

The console holds the course's own lines; what libraries say goes to `<out>/library.log`:

- `library_log(out_dir, rank)` (called by `parse_config` and `RunRecorder`, so no chapter calls
  it) sends Python warnings and the records of every other library's loggers (torch, DeepSpeed,
  wandb, ...) to the file, which is created on the first message only. Rank r > 0 writes
  `library.rank<r>.log`. At the end of the run rank 0 names the file in one line if anything
  was written.
- `with library_output():` around one noisy call (`deepspeed.initialize`, `wandb.init`, a
  profiler export) also sends file descriptors 1 and 2 there: C++ log lines, a compiler's build
  log, a library's `print`. The course's own lines still reach the console.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

# `parse_config` installs it; it lives with the errors it says in one line (re-exported here, where
# it was first written)
from common.errors import one_line_errors  # noqa: F401

log = logging.getLogger("course")


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is when a line is logged (Jupyter and pytest swap it), or
    to the console itself while `library_output` sends file descriptor 1 to the library log."""

    @property
    def stream(self):
        return _console if _console is not None else sys.stdout

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


# --- the library log --------------------------------------------------------------------------

_library: dict = {}  # path, rank, file (opened on the first message), named (the line printed)
_console = None  # the console (a copy of fd 1) while library_output() has taken fds 1 and 2


def library_log_path() -> Path | None:
    """This process's library log (None if `library_log` was not called)."""
    return _library.get("path")


def _library_file():
    if _library.get("file") is None:
        _library["path"].parent.mkdir(parents=True, exist_ok=True)
        _library["file"] = open(_library["path"], "a", buffering=1, errors="replace")
    return _library["file"]


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    _library_file().write(warnings.formatwarning(message, category, filename, lineno, line))


class _LibraryFileHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            _library_file().write(self.format(record) + "\n")
        except Exception:  # never let a library's log line end the run
            self.handleError(record)


_file_handler = _LibraryFileHandler()
_file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))


def _divert(record: logging.LogRecord) -> bool:
    """A filter on the libraries' console handlers: the record goes to the file instead."""
    if _library:
        _file_handler.handle(record)
        return False
    return True


def _is_console_handler(handler: logging.Handler) -> bool:
    if isinstance(handler, (logging.FileHandler, _StdoutHandler)):
        return False
    if type(handler).__name__ == "_StderrHandler":  # torch's: writes to sys.stderr of the moment
        return True
    stream = getattr(handler, "stream", None)
    return stream is not None and stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


def route_library_loggers() -> None:
    """Send the records of every logger but the course's to the library log: a filter on each
    handler that writes to the console (libraries such as DeepSpeed and torch install their own
    when imported, so this runs again after a `library_output` block), and the file as the root
    logger's handler (for loggers without one of their own). Idempotent."""
    if not _library:
        return
    if _file_handler not in logging.root.handlers:
        logging.root.addHandler(_file_handler)
    loggers = [logging.root, *logging.root.manager.loggerDict.values()]
    for logger in loggers:
        if not isinstance(logger, logging.Logger) or logger is log:
            continue
        for handler in logger.handlers:
            if _divert not in handler.filters and _is_console_handler(handler):
                handler.addFilter(_divert)


def library_log(out_dir: str | Path, rank: int = 0) -> Path:
    """Send Python warnings and the libraries' log records of this process to
    `<out_dir>/library.log` (`library.rank<r>.log` on rank r > 0); return that path.

    The file is truncated when it is first written, and created only if something is; a stale
    one from an earlier run is removed now. Calling it again with the same folder does nothing.
    """
    name = "library.log" if rank == 0 else f"library.rank{rank}.log"
    path = Path(out_dir) / name
    if _library.get("path") == path:
        return path
    if _library.get("file") is not None:
        _library["file"].close()
    _library.clear()
    _library.update(path=path, rank=rank, file=None, named=False)
    with contextlib.suppress(OSError):
        path.unlink()
    warnings.showwarning = _show_warning
    route_library_loggers()
    if not _library.get("atexit"):
        atexit.register(name_library_log)
        _library["atexit"] = True
    return path


def shown_path(path: str | Path) -> str:
    """A path as the learner would type it: relative to the working folder when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def name_library_log() -> None:
    """On rank 0, say in one line where the libraries' messages went, if anything was written
    (by this rank, or by another into its own file). Once per run."""
    if not _library or _library["named"] or _library["rank"] != 0:
        return
    path = _library["path"]
    others = [p for p in path.parent.glob("library.rank*.log") if p.stat().st_size]
    if not ((path.exists() and path.stat().st_size) or others):
        return
    _library["named"] = True
    more = f" (+{len(others)} of other ranks, beside it)" if others else ""
    log.info("library warnings and logs%s:\n  %s", more, shown_path(path))


@contextlib.contextmanager
def library_output():
    """Inside the block, whatever this process writes to file descriptors 1 and 2 (C++ log
    lines, a compiler's build log, a library's prints) goes to the library log, while the
    course's logger still writes to the console. Does nothing if `library_log` was not called
    (a test or a notebook calling the chapter's functions in process)."""
    global _console
    if not _library or _console is not None:
        yield
        return
    target = _library_file()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    _console = os.fdopen(os.dup(saved[1]), "w", buffering=1, errors="replace")
    try:
        target.flush()
        for fd in (1, 2):
            os.dup2(target.fileno(), fd)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        _console.close()
        _console = None
        if target.tell() == 0 and os.fstat(target.fileno()).st_size == 0:  # nothing was said
            target.close()
            _library["file"] = None
            with contextlib.suppress(OSError):
                _library["path"].unlink()
        route_library_loggers()  # loggers the block's imports created


def extension_folder(name: str) -> Path:
    """Where torch builds the C++ extension `name` for this interpreter and torch build:
    TORCH_EXTENSIONS_DIR/NAME, else <cache>/torch_extensions/py<XY>_<cuZZZ|rocmZZZ|cpu>/NAME
    (torch.utils.cpp_extension._get_build_directory, without creating it)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / name
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}" / name


def torch_extension_built(name: str) -> bool:
    """Is the C++ extension `name` (e.g. DeepSpeed's "deepspeed_shm_comm") already built where
    torch will look for it, so that loading it compiles nothing? Lets a script announce a long
    first build only when it comes."""
    return (extension_folder(name) / f"{name}.so").is_file()


def init_deepspeed(info):
    """Import DeepSpeed and join it to the process group `common.distributed.setup_distributed`
    made (`info`); returns the `deepspeed` module. Its start-up is kept off the console: on CPU the
    first run builds its communication operator (about a minute, announced only when it is not
    cached) and its warnings and build log go to the run's library log. DeepSpeed asserts that
    LOCAL_RANK is set, which Slurm-started ranks lack: it is set from `info`."""
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    if info.device.type == "cpu" and not torch_extension_built("deepspeed_shm_comm"):
        log.info("building DeepSpeed's communication operator (first run only, about a minute) ...")
    with library_output():
        import deepspeed

        deepspeed.init_distributed(dist_backend=info.backend)  # reuses our process group
    return deepspeed
