"""A peer that stops responding becomes a timeout error naming it, not a hang.

One rank sleeps before a collective (a deadlock, a stuck data loader, a wedged GPU); the others
wait for their all-reduce with `work.wait(timeout)`, which fails after `--timeout`, and
`monitored_barrier` then says which rank is missing, so the run ends with one clear line and
torchrun stops the sleeping rank. Under NCCL a collective returns at launch: only the wait (with
TORCH_NCCL_BLOCKING_WAIT=1, set here, so the watchdog does not abort the process first) turns the
hang into an exception this code can handle.

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch13_fault_tolerance/hang.py --timeout 5
    torchrun --standalone --nproc_per_node=3 chapters/ch13_fault_tolerance/hang.py --hang-rank 2
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 \\
        chapters/ch13_fault_tolerance/hang.py                                  # more detail
    torchrun --standalone --nproc_per_node=8 chapters/ch13_fault_tolerance/hang.py   # 8 GPUs, NCCL
    python chapters/ch13_fault_tolerance/hang.py      # refused: a hung peer needs 2 ranks or more
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch13_fault_tolerance/hang.py                                  # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch13_fault_tolerance/hang.py   # Slurm
While it hangs, `py-spy dump --pid PID` on any rank shows the line it waits on.
"""

import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common.config import RunConfig, parse_config
from common.distributed import setup_distributed, teardown_distributed
from common.log import library_output, log, setup_logging
from common.results import RunRecorder, check_ok


@dataclass
class Config(RunConfig):
    timeout: float = 5.0
    """Seconds a collective may wait for a peer before the run fails with an error."""
    hang_rank: int = 1
    """The rank that stops responding before the collective."""
    hang_seconds: float = 3600.0
    """How long that rank sleeps ('forever': torchrun stops it when the others fail)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hang_rank < 1:
            raise ValueError("--hang-rank must be at least 1: rank 0 reports what the others see")


def validate(cfg: Config, world_size: int) -> None:
    """A hung peer needs a peer: the hanging rank and rank 0, which reports."""
    if cfg.hang_rank >= world_size:
        raise ValueError(f"--hang-rank {cfg.hang_rank} needs at least {cfg.hang_rank + 1} ranks "
                         "(one hangs, rank 0 reports): torchrun --standalone --nproc_per_node=2 "
                         "chapters/ch13_fault_tolerance/hang.py")


def timed_collective(fn) -> tuple[float, str]:
    """Run a collective that should fail; return (seconds until it failed, its error's first line)."""
    start = time.perf_counter()
    try:
        fn()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        return time.perf_counter() - start, re.sub(r"^\[[^\]]*\.cc:\d+\] ", "", first)
    return time.perf_counter() - start, ""


def all_reduce_and_wait(x: torch.Tensor, timeout_s: float, group=None) -> None:
    """All-reduce, then block this thread until it completes or `timeout_s` passes (an error).
    NCCL's all_reduce returns at launch, so timing or catching it needs the wait; gloo's runs in
    its own threads and fails after the group timeout, which the wait also reports."""
    work = dist.all_reduce(x, group=group, async_op=True)
    work.wait(timeout=timedelta(seconds=timeout_s))


def missing_ranks(message: str) -> list[int]:
    """The ranks a monitored_barrier error names: '... Ranks 1, 3 failed to pass ...' -> [1, 3]."""
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return [int(r) for r in m.group(1).replace(",", " ").split()] if m else []


def launch_only(x: torch.Tensor) -> float:
    """The broken measurement: seconds until an all-reduce *returns* (what a host clock around an
    NCCL collective measures); then it waits for the result. Run while every rank is alive."""
    start = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    launched = time.perf_counter() - start
    work.wait()
    return launched


def healthy_rank(cfg: Config, info, barrier_group) -> dict:
    """What a live rank sees: the all-reduce times out, then monitored_barrier names the missing rank."""
    x = torch.ones(1, device=info.device)
    ar_s, ar_err = timed_collective(lambda: all_reduce_and_wait(x, cfg.timeout))
    log.info("all_reduce failed after %.1f s: %s", ar_s, ar_err)
    # monitored_barrier needs gloo (it is built from send/recv); it has its own group because
    # the default one may be unusable after a timeout.
    with library_output():  # gloo's own C++ error lines say what the next line says
        mb_s, mb_err = timed_collective(lambda: dist.monitored_barrier(
            group=barrier_group, timeout=timedelta(seconds=cfg.timeout), wait_all_ranks=True))
    log.info("monitored_barrier failed after %.1f s: %s", mb_s, mb_err)
    return {"ar_s": ar_s, "ar_err": ar_err, "mb_s": mb_s, "mb_err": mb_err}


def main(cfg: Config) -> int:
    # NCCL: make wait() raise on a timeout instead of a watchdog thread aborting the process
    # (no watchdog is created in this mode). Read when the group is created; gloo ignores it.
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        barrier_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout))
        ones = torch.ones(1, device=info.device)
        launch_s = launch_only(ones)  # everyone is alive here
        log.info("world %d alive (all_reduce = %d); rank %d now stops responding for %g s",
                 info.world_size, ones.item(), cfg.hang_rank, cfg.hang_seconds)
        if info.rank == cfg.hang_rank:
            time.sleep(cfg.hang_seconds)  # never reaches the collective below
            return 0
        seen = healthy_rank(cfg, info, barrier_group)
        rec.figure("seconds until all_reduce failed", seen["ar_s"], expected=cfg.timeout, unit="s")
        rec.figure("seconds until monitored_barrier failed", seen["mb_s"], expected=cfg.timeout, unit="s")
        rec.figure("all_reduce error", seen["ar_err"])
        rec.figure("monitored_barrier error", seen["mb_err"])
        rec.check("all_reduce raised a timeout error", "count",
                  int("timed out" in seen["ar_err"].lower() or "timeout" in seen["ar_err"].lower()), 1)
        if info.is_main:  # only rank 0 collects the missing ranks' names
            rec.check("monitored_barrier names the hung rank", "count",
                      missing_ranks(seen["mb_err"]), [cfg.hang_rank])
        # The failure comes after the timeout (its deadline starts inside the call) and not much
        # later; a measurement that returns at once (the launch, not the wait) fails the band.
        band = [cfg.timeout, 2 * cfg.timeout]
        rec.check("all_reduce failed after T, within 2T", "timing", seen["ar_s"], band, compare="between")
        rec.figure("launch-only timing of an all-reduce (no wait)", launch_s, unit="s")
        rec.check("launch-only timing inside [T, 2T] (must not)", "count",
                  int(check_ok(launch_s, band, compare="between")), 0)
        # finish() would gather every rank's checks over the default group: the hung rank never
        # answers (another full timeout), and after a timed-out wait the group is not reliable
        # (NCCL may have aborted it). Leave the groups first: the summary is this rank's view.
        teardown_distributed()
        status = rec.finish()
        raise SystemExit(f"error: rank {cfg.hang_rank} stopped responding: all_reduce timed out "
                         f"after {seen['ar_s']:.1f} s (checks {'passed' if status == 0 else 'FAILED'})")
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
