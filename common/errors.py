"""The faults a run's files can raise, and how a run ends on one: in one line, not a traceback.

`CheckpointError` (a checkpoint missing, damaged, another run's, or unwritable) and
`FolderInUseError` (another run holds the folder) are raised by `common.files`,
`common.manifest`, `common.checkpoint` and `common.checkpoint_dcp`; `error_line` says any
error in one line, naming the file; `one_line_errors`, which `parse_config` installs for a real
run, ends the run with that line. Nothing here imports another module of the course.
"""

from __future__ import annotations

import errno
import os
import sys


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, another run's, or cannot be written.

    `collective=True`: every rank raised the same error from the same verdict, so only rank 0
    needs to say it (see `one_line_errors`)."""

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


class FolderInUseError(RuntimeError):
    """Another run holds the folder's lock (`collective` as for `CheckpointError`)."""

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def dcp_error_line(e: BaseException) -> str:
    """DCP's `CheckpointException` carries every failing rank's exception and traceback; the
    first rank's exception, in one line, with the ranks that failed."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    ranks = sorted(failures)
    first = failures[ranks[0]]
    inner = first[0] if isinstance(first, tuple) else first
    return f"failed on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {error_line(inner)}"


def error_line(e: BaseException) -> str:
    """One line saying what went wrong, with the file when the error names one."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        return dcp_error_line(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def one_line_errors(prog: str) -> None:
    """Make the faults a learner can meet in a run's files end as one line, not a traceback:
    a checkpoint that is missing, damaged or another run's, a folder another run holds, a full
    disk or a read-only folder (naming the path), DCP's `CheckpointException` (whose message is
    every failing rank's traceback: its first exception, in one line). A `collective` error,
    raised on every rank from one agreed verdict, is said by global rank 0 alone. Anything else
    keeps Python's traceback: it is a bug to read. `parse_config` installs this for a real run."""
    default = sys.excepthook

    def hook(kind, error, tb) -> None:
        try:
            from torch.distributed.checkpoint.api import CheckpointException
        except ImportError:  # pragma: no cover - torch without distributed
            CheckpointException = CheckpointError
        if isinstance(error, (CheckpointError, FolderInUseError)):
            line = str(error)
        elif isinstance(error, CheckpointException) or (
                isinstance(error, OSError) and error.strerror and error.errno in _FILE_ERRNOS):
            line = error_line(error)
        else:
            return default(kind, error, tb)
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))  # torchrun's, or srun's
        # DCP gathers its failures to every rank: its exception is one verdict, like `collective`
        collective = getattr(error, "collective", False) or isinstance(error, CheckpointException)
        if collective and rank not in (None, "0"):
            return
        who = f" (rank {rank})" if rank not in (None, "0") else ""
        print(f"{prog}: error{who}: {line}", file=sys.stderr, flush=True)

    sys.excepthook = hook


# what a disk or a path does to a run
_FILE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO, errno.ENOTDIR,
                errno.EISDIR}
