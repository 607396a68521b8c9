"""The proofs a chapter 13 run records: the replicas agree at the end (`replica_spread`), a
faulted run resumed from the last committed checkpoint, and the cost of saving (its time, the
Young/Daly interval for it) against the cost of verifying before use (`verify_seconds`).
"""

import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from chapters.ch13_fault_tolerance.checkpoints import agreed, read_step, young_daly_interval
from chapters.ch13_fault_tolerance.elastic import restart_count
from common.distributed import reduce_number
from common.timing import Timer


def replica_spread(model) -> float:
    """Largest difference of any parameter between ranks (0 when the replicas agree)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).max().item()


def verify_seconds(folder: Path, info, repeats: int = 5) -> list[float]:
    """Seconds to verify checkpoint `folder` as a resume does (manifest hashes shared by the
    ranks, zip CRCs, `weights_only` loads, one verdict), the slowest rank's, `repeats` times."""
    verify = agreed(lambda f: read_step(f, info.rank, info.world_size))
    times = []
    for _ in range(repeats):
        with Timer(info.device) as t:
            verify(folder)
        times.append(reduce_number(t.elapsed, "max"))
    return times


def record_checks(rec, cfg, info, result: dict, ckpt_dir: Path) -> None:
    """The run's figures and checks, from what `train` returned."""
    restarts = restart_count()
    rec.figure("restarts (TORCHELASTIC_RESTART_COUNT)", restarts)
    rec.figure("resumed from step", result["start"])
    rec.figure("final loss (rank 0's shard)", result["losses"][-1] if result["losses"] else None)
    rec.check("replicas identical (max |dparam| across ranks)", "parity",
              replica_spread(result["model"]), 0.0)
    if cfg.fail_rank >= 0 and restarts > 0:
        # A step fault loses the steps since the last save; a save fault that save as well.
        last_ckpt = (cfg.fail_step - (cfg.fail_in == "save")) // cfg.ckpt_every * cfg.ckpt_every
        rec.check("resumed from the last committed checkpoint", "count", result["start"], last_ckpt)
    # How often to save: Young/Daly with this run's save time and a job MTBF of 24 h (1 000
    # nodes of MTBF 1 000 days). A formula output, not a measurement of anything failing.
    saves = [reduce_number(t, "max") for t in result["save_s"]]  # each save: its slowest rank
    save = statistics.median(saves) if saves else 0.0
    rec.figure("checkpoint save, median (slowest rank)", round(save * 1e3, 2), unit="ms",
               spread=(round(min(saves) * 1e3, 2), round(max(saves) * 1e3, 2)) if saves else None)
    rec.figure("Young/Daly interval for that save at M = 24 h (formula)",
               round(young_daly_interval(save, 24 * 3600), 1), unit="s")
    if saves:  # what verifying before use costs, against that save
        verify_times = verify_seconds(ckpt_dir / f"step{cfg.steps:06d}", info)
        rec.figure("checkpoint verify before use, median (slowest rank)",
                   round(statistics.median(verify_times) * 1e3, 2), unit="ms",
                   spread=(round(min(verify_times) * 1e3, 2), round(max(verify_times) * 1e3, 2)))
