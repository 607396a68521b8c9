"""A cost planner for a training run: FLOPs → GPU-hours → money over instance types, the
communication ÷ compute ratio of parallel layouts, spot against on-demand, and the checkpoint
interval that minimises the waste preemptions cause (Young 1974, Daly 2006).

The planner is arithmetic; its proof is a simulated spot run: random preemptions (exponential
inter-arrival times, seeded), a save every τ, a restart after each failure, repeated over many
seeds whose mean waste must match the model. The ranks split the seeds and all-reduce their
sums, so any world size gives the same answer as one process (only faster).

Run:
    python chapters/ch29_cost/train.py
    torchrun --standalone --nproc_per_node=2 chapters/ch29_cost/train.py
    python chapters/ch29_cost/train.py --n-params 70e9 --tokens 2e12 --n-layers 80 --d-model 8192
    python chapters/ch29_cost/train.py --save-s 60 --mtbf-h 2 --instance aws-p4d.24xlarge
    torchrun --standalone --nproc_per_node=8 chapters/ch29_cost/train.py --seeds 200000   # 8 GPUs
    srun --ntasks=4 python chapters/ch29_cost/train.py
"""

# The money side of the model is in cost.py, the checkpoint interval and the waste preemptions
# cause in waste.py, the proofs the run records (the simulation against the model) in checks.py.
# This file: the config, the planner's tables and main().

import sys
from dataclasses import dataclass

from chapters.ch29_cost import cost as C
from chapters.ch29_cost import waste as W
from chapters.ch29_cost.checks import (
    check_intervals,
    check_optimum,
    check_simulation,
    measured_optimum,
    simulate,
)
from common.config import RunConfig, parse_config
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder

H = C.HOUR


@dataclass
class Config(RunConfig):
    steps: int = 1
    """Unused: the planner has no training loop (kept as every script's option)."""
    n_params: float = 7e9
    """Model parameters N (non-embedding)."""
    tokens: float = 1e12
    """Training tokens D."""
    n_layers: int = 32
    """Transformer layers L (attention FLOPs and tensor-parallel traffic)."""
    d_model: int = 4096
    """Hidden size d."""
    seq_len: int = 4096
    """Sequence length T."""
    attention: bool = False
    """Add attention's 12·L·d·T FLOPs per token to 6·N·D (PaLM's count)."""
    mfu: float = 0.4
    """Model FLOPs utilisation assumed for the money table."""
    n_gpus: int = 64
    """GPUs the run uses (whole machines are rented)."""
    instance: str = "aws-p5.48xlarge"
    """Instance type for the layouts and the spot comparison (see cost.INSTANCES)."""
    global_batch: int = 1024
    """Sequences per optimizer step (fixed across layouts)."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    save_s: float = 180.0
    """Seconds a checkpoint stalls training (δ)."""
    restart_s: float = 600.0
    """Seconds to get going again after a preemption (R): new machines, rendezvous, load."""
    mtbf_h: float = 4.0
    """Mean hours between preemptions of the whole spot job (M)."""
    work_h: float = 24.0
    """Useful hours of the simulated run."""
    seeds: int = 20000
    """Simulated runs, split over the ranks."""
    opt_seeds: int = 2000
    """Simulated runs per checkpoint interval for the measured optimum (0: skip it)."""
    opt_segments: int = 20
    """Whole intervals per run of the measured optimum (the waste rate of a long run)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_params", "tokens", "save_s", "mtbf_h", "work_h"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {self.mfu}")
        if self.restart_s < 0:
            raise ValueError("--restart-s must be at least 0")
        for name in ("n_layers", "d_model", "seq_len", "n_gpus", "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.seeds < 2:
            raise ValueError("--seeds must be at least 2 (a standard error needs two runs)")
        if self.opt_seeds == 1 or self.opt_seeds < 0 or self.opt_segments < 1:
            raise ValueError("--opt-seeds must be 0 or at least 2, --opt-segments at least 1")
        C.instance(self.instance)


def validate(cfg: Config, world_size: int) -> None:
    """Any world works: the ranks split the seeds (a rank may get none only if seeds < world)."""
    if cfg.seeds < world_size:
        raise ValueError(f"--seeds {cfg.seeds} is fewer than the {world_size} ranks")


def money_table(cfg: Config, flops: float) -> list[dict]:
    """One row per instance and pricing: GPU-hours, days on n_gpus, dollars."""
    rows = []
    for inst in C.INSTANCES:
        for spot in (False, True):
            if spot and inst.spot_per_h is None:
                continue
            r = C.run_cost(flops, inst, cfg.mfu, cfg.n_gpus, spot=spot)
            rows.append({"instance": inst.name + (" spot" if spot else ""), **r})
    return rows


def layouts(cfg: Config) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp·tp·pp = n_gpus, tp within a machine, dp dividing the batch."""
    inst = C.instance(cfg.instance)
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            dp, rest = divmod(cfg.n_gpus, tp * pp)
            if (not rest and tp <= inst.gpus and cfg.global_batch % (dp * cfg.micro_batch) == 0
                    and cfg.n_layers % pp == 0):
                out.append((dp, tp, pp))
    return out


def log_money(rows: list[dict], cfg: Config) -> None:
    log.info("%-30s %12s %10s %14s", "instance (example prices)", "GPU-hours", "days", "US$")
    for r in rows:
        log.info("%-30s %12.0f %10.1f %14.0f", r["instance"], r["gpu_hours"],
                 r["wall_hours"] / 24, r["dollars"])


def log_layouts(cfg: Config, model: C.Model) -> list[dict]:
    inst = C.instance(cfg.instance)
    log.info("")
    log.info("layouts on %d x %s (no overlap, memory not modelled), per step:", cfg.n_gpus, inst.name)
    log.info("%4s %4s %4s %10s %9s %9s %9s %8s %7s", "dp", "tp", "pp", "compute s", "tp s",
             "dp s", "pp s", "comm/cp", "bubble")
    rows = []
    for dp, tp, pp in layouts(cfg):
        r = C.layout_times(model, inst, dp, tp, pp, cfg.micro_batch, cfg.global_batch, cfg.mfu)
        rows.append({"dp": dp, "tp": tp, "pp": pp, **r})
        log.info("%4d %4d %4d %10.3f %9.3f %9.3f %9.3f %8.3f %7.3f", dp, tp, pp, r["compute_s"],
                 r["tp_s"], r["dp_s"], r["pp_s"], r["ratio"], r["bubble"])
    return rows


def spot_or_not(rec: RunRecorder, cfg: Config, flops: float, tau: float) -> None:
    """Spot's discount against the waste its preemptions cost, at the Daly interval, over the
    planned run's own length (its useful hours on n_gpus), not the simulated 24 h run's."""
    inst = C.instance(cfg.instance)
    if inst.spot_per_h is None:
        log.info("%s has no spot price: no spot comparison", inst.name)
        return
    od = C.run_cost(flops, inst, cfg.mfu, cfg.n_gpus)
    work = od["wall_hours"] * H
    overhead = W.expected_waste(work, tau, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H) / work
    spot = C.run_cost(flops, inst, cfg.mfu, cfg.n_gpus, spot=True, overhead=overhead)
    be = C.spot_break_even(inst.on_demand_per_h, inst.spot_per_h, overhead)
    rec.figure("spot waste of the planned run, fraction (model)", overhead)
    rec.figure("spot / on-demand cost (model)", be["cost_ratio"])
    rec.figure("waste at which spot breaks even (model)", be["break_even_overhead"])
    log.info("")
    log.info("spot on %s: waste %.1f %% of the %.0f h run at τ = %.2f h (model)", inst.name,
             100 * overhead, work / H, tau / H)
    log.info("  $%.0f against $%.0f on demand (%.2f x); spot breaks even at %.0f %% waste",
             spot["dollars"], od["dollars"], be["cost_ratio"], 100 * be["break_even_overhead"])


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        model = C.Model(cfg.n_params, cfg.n_layers, cfg.d_model, cfg.seq_len)
        flops = C.total_flops(cfg.n_params, cfg.tokens, *((cfg.n_layers, cfg.d_model, cfg.seq_len)
                                                          if cfg.attention else ()))
        log.info("N = %.3g parameters, D = %.3g tokens: %.3g FLOPs%s at MFU %.2f on %d GPUs",
                 cfg.n_params, cfg.tokens, flops, " (with attention)" if cfg.attention else
                 " (6·N·D)", cfg.mfu, cfg.n_gpus)
        rows = money_table(cfg, flops)
        log_money(rows, cfg)
        lay = log_layouts(cfg, model)
        tau = check_intervals(rec, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H)
        log.info("")
        log.info("checkpoint interval: Young %.3f h, Daly %.3f h (δ = %g s, M = %g h)",
                 W.young_interval(cfg.save_s, cfg.mtbf_h * H) / H, tau / H, cfg.save_s, cfg.mtbf_h)
        log.info("simulating %d spot runs of %g useful hours on %d rank(s)", cfg.seeds, cfg.work_h,
                 info.world_size)
        sim = check_simulation(rec, cfg, tau, simulate(cfg, info, tau))
        log.info("measuring the best interval on the simulation: %d runs at each of %d "
                 "intervals from δ to M", cfg.opt_seeds, len(W.interval_grid(cfg.save_s, cfg.mtbf_h * H)))
        check_optimum(rec, cfg, measured_optimum(cfg, info))
        spot_or_not(rec, cfg, flops, tau)
        rec.figure("training FLOPs (formula)", flops, unit="FLOP")
        rec.figure("GPU-hours at the MFU (formula)", rows[0]["gpu_hours"], unit="GPU-h")
        rec.figure("Daly interval (formula)", tau / H, unit="h")
        rec.figure("Young interval (formula)", W.young_interval(cfg.save_s, cfg.mtbf_h * H) / H, unit="h")
        rec.figure("money table", rows, table=False)
        rec.figure("layouts", lay, table=False)
        rec.figure("simulation sums (waste s, waste² s², runs)", list(sim.values()), table=False)
        rec.metrics(0, loss=None, lr=None, mean_waste_h=sim["mean_s"] / H)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
