"""The preemption notice and the agreement to stop: a SIGTERM handler (or chapter 24's spot
notice poller, `spot_notice.py`) only sets a flag (`Preemption`); at every step boundary the ranks
all-reduce it (`stop_agreed`), so every rank stops at the same step even if only one node was told.
Also the grace budget's two formulas: the worst case from the notice to a committed checkpoint,
and the largest checkpoint a node can write in the grace period.
"""

import signal
import threading
import time

import torch
import torch.distributed as dist

# --- the grace budget (formulas) ---------------------------------------------------------------

def seconds_to_commit(step_s: float, save_s: float, agree_s: float = 0.0) -> float:
    """Worst case from the notice to a committed checkpoint: the notice lands just after a step
    began, so that step finishes, then one agreement all-reduce, then the save."""
    return step_s + agree_s + save_s


def largest_checkpoint_bytes(grace_s: float, step_s: float, bytes_per_s: float,
                             margin_s: float = 0.0) -> float:
    """Bytes one node can write after the notice: (grace - step - margin) x its upload rate."""
    return max(0.0, grace_s - step_s - margin_s) * bytes_per_s


# --- the preemption notice --------------------------------------------------------------------

class Preemption:
    """The notice that the machine is going away: SIGTERM, or AWS's spot notice (`SpotNoticePoller`,
    from a thread). Either only sets a flag and notes the time; the loop looks at it between steps
    (a handler that saved by itself could run in the middle of an all-reduce and deadlock the job).
    `deadline` is when the platform stops waiting: `grace_s` after the notice, or the time the
    spot notice names, whichever comes first."""

    def __init__(self, grace_s: float = 30.0) -> None:
        self.grace_s = grace_s
        self.signal_time: float | None = None  # wall clock of the first notice (any source)
        self.source: str | None = None
        self.action_time: float | None = None  # wall clock the spot notice names, if any
        # Re-entrant: the SIGTERM handler runs in the main thread between two bytecodes, possibly
        # while the main thread is itself inside `notify` holding this lock (StopAtStep calls it
        # there); a plain Lock would then wait for itself forever. The poller's thread still
        # waits its turn (an RLock excludes other threads), and a nested call finds the notice
        # being recorded and may only overwrite it with a time a few bytecodes apart.
        self._lock = threading.RLock()

    def install(self) -> "Preemption":
        signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.notify("SIGTERM")

    def notify(self, source: str, action_time: float | None = None) -> None:
        """Record the first notice (later ones change nothing): its time, where it came from."""
        with self._lock:
            if self.signal_time is None:
                self.signal_time = time.time()  # wall clock: comparable with the sender's
                self.source, self.action_time = source, action_time

    def allowed_s(self) -> float | None:
        """Seconds from the notice to the deadline (None before a notice)."""
        if self.signal_time is None:
            return None
        if self.action_time is None:
            return self.grace_s
        return min(self.grace_s, self.action_time - self.signal_time)

    def deadline(self) -> float | None:
        return None if self.signal_time is None else self.signal_time + self.allowed_s()

    def requested(self, step: int) -> bool:
        return self.signal_time is not None


class StopAtStep(Preemption):
    """A notice that arrives before step `step` (in-process experiments and tests)."""

    def __init__(self, step: int, grace_s: float = 30.0) -> None:
        super().__init__(grace_s)
        self.step = step

    def requested(self, step: int) -> bool:
        if step >= self.step:
            self.notify(f"StopAtStep({self.step})")
        return self.signal_time is not None


def stop_agreed(notice: Preemption, step: int, device: torch.device) -> bool:
    """Does any rank want to stop? One MAX all-reduce of a flag on `device`, so every rank
    stops at the same step even when only one node received the signal."""
    flag = torch.tensor([1.0 if notice.requested(step) else 0.0], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)
