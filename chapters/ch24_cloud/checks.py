"""The proofs a chapter 24 run records: the replicas agree at the end (chapter 13's
`replica_spread`); after a notice, every rank stopped at the same step, and the checkpoint was
committed before the deadline (`notice_to_commit`, a timing check: reported, never fatal).
"""

from chapters.ch13_fault_tolerance.checks import replica_spread
from chapters.ch24_cloud.preemption import seconds_to_commit
from common.distributed import gather_numbers, reduce_number
from common.log import log


def notice_to_commit(result: dict) -> tuple[float, float] | None:
    """(seconds from the earliest notice any rank had to the committed checkpoint, seconds the
    platform allowed: the earliest deadline any rank had, from that notice)."""
    inf = float("inf")
    noticed = result["signal_time"] is not None
    times = gather_numbers(result["signal_time"] if noticed else inf)
    allowed = gather_numbers(result["allowed_s"] if noticed else inf)
    earliest = min(times)
    if result["committed_time"] is None or earliest == inf:
        return None
    # each rank's deadline counted from the earliest notice (exactly its allowance on that rank)
    return (result["committed_time"] - earliest,
            min(a + (t - earliest) for t, a in zip(times, allowed) if t != inf))


def record_checks(rec, cfg, result: dict, notice, poller=None) -> None:
    """The run's figures and checks, from what `train` returned; a preempted run's are the
    stop's, a finished run's its final loss."""
    rec.figure("resumed from step", result["start"])
    if poller is not None:
        rec.figure("spot notice: polls answered (this node's local rank 0)", poller.polls)
    rec.check("replicas identical (max |dparam| across ranks)", "parity",
              replica_spread(result["model"]), 0.0)
    if result["preempted_at"] is None:
        rec.figure("final loss (rank 0's shard)", result["losses"][-1] if result["losses"] else None)
        return
    stops = gather_numbers(result["preempted_at"])
    log.info("preempted: every rank stopped before step %d and saved it", stops[0])
    log.info("  the notice on this rank: %s", notice.source or "none, another rank's")
    rec.figure("preempted, checkpoint committed at step", stops[0])
    rec.check("every rank stopped at the same step (max - min)", "count",
              max(stops) - min(stops), 0)
    worst = seconds_to_commit(reduce_number(max(result["step_s"], default=0.0), "max"),
                              reduce_number(max(result["save_s"], default=0.0), "max"))
    rec.figure("bound: slowest step + slowest save (formula, this run's times)",
               round(worst, 3), unit="s")
    timing = notice_to_commit(result)
    if timing is not None:
        elapsed, allowed = timing
        rec.figure("notice -> checkpoint committed (expected: the time allowed)",
                   round(elapsed, 4), expected=allowed, unit="s")
        rec.check("notice -> checkpoint committed before the deadline (s)", "timing",
                  round(elapsed, 4), allowed, compare="<=")
        if elapsed > allowed:
            log.warning("committed %.3f s after the notice, past the %.4g s allowed "
                        "(--grace-s %g):", elapsed, allowed, cfg.grace_s)
            log.warning("  the platform would have killed this save; a restart would "
                        "resume from step %d", result["previous_commit"])
