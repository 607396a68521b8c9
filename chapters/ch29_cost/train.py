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

import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chapters.ch29_cost import cost as C
from common.config import RunConfig, parse_config
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder

H = C.HOUR
SIM_SIGMAS = 4.0
"""The simulated mean must lie within 4 standard errors of the model: a correct model fails
this by chance with probability 6·10⁻⁵ (normal tails; the mean of 20 000 runs is close to normal)."""
OPT_BAND = 0.10
"""Relative: the interval the formula gives against the optimum measured on the simulation. The
fitted optimum's standard error is about 1 % (0.006 of 0.597 h; 4 SE: 4 %) with the default seeds,
and the fitted curve's shape puts it about 1 % below the exact model's minimum; √(δM), a factor 2 lost, is 29 %
below √(2δM) for any δ and M, so the band rejects it."""
DALY_TOL = 1e-3
"""Relative: Daly's formula truncates a series in sqrt(δ/2M); over δ/M ≤ 0.1 the worst error
found is 4·10⁻⁴ (printed by every run), Young's is 17 %."""
DALY_GRID = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1]


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


def check_intervals(rec: RunRecorder, save: float, restart: float, mtbf: float) -> float:
    """Daly's formula against a numeric minimisation of the exact model (Young's as control)."""
    daly_err = young_err = 0.0
    for ratio in DALY_GRID:  # δ/M, with M = 1: the optimum scales with M
        exact = C.golden_section(lambda t, r=ratio: C.per_work_rate(t, r, 0.0, 1.0), 1e-8, 10.0)
        daly_err = max(daly_err, abs(C.daly_interval(ratio, 1.0) - exact) / exact)
        young_err = max(young_err, abs(C.young_interval(ratio, 1.0) - exact) / exact)
    rec.check("Daly = argmin of the exact model, worst over δ/M ≤ 0.1", "formula", daly_err,
              DALY_TOL, compare="<=")
    rec.check("control: Young against the exact model, worst over δ/M ≤ 0.1", "formula",
              young_err, DALY_TOL, compare=">")
    return C.daly_interval(save, mtbf)


def measured_optimum(cfg: Config, info) -> dict | None:
    """The best checkpoint interval measured on the simulation, with no formula for it: the
    waste per useful second simulated at intervals from δ to M (`interval_grid`), this rank's
    share of the seeds at each, summed over the ranks in one all-reduce; then the minimum of the
    curve fitted around the smallest (`fit_optimum`)."""
    if cfg.opt_seeds == 0 or cfg.save_s > cfg.mtbf_h * H / 8:
        return None  # no interior minimum on the grid to measure
    taus = C.interval_grid(cfg.save_s, cfg.mtbf_h * H)
    base = cfg.seed * 10**7 + 5 * 10**6  # seeds apart from the waste simulation's
    mine = range(base + info.rank, base + cfg.opt_seeds, info.world_size)
    sums = torch.tensor([C.simulate_rate(t, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H,
                                         cfg.opt_segments, mine) for t in taus],
                        dtype=torch.float64, device=info.device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)  # on info.device: NCCL takes CUDA tensors only
    stats = [C.mean_and_se(s, s2, round(n)) for s, s2, n in sums.cpu().tolist()]
    opt, se = C.fit_optimum(taus, [m for m, _ in stats], [e for _, e in stats])
    return {"taus": taus, "means": [m for m, _ in stats], "ses": [e for _, e in stats],
            "optimum_s": opt, "se_s": se}


def check_optimum(rec: RunRecorder, cfg: Config, measured: dict | None) -> None:
    """Daly's interval within OPT_BAND of the measured optimum; √(δM) outside it."""
    if measured is None:
        rec.figure("measured optimum (simulation)", "n/a: --opt-seeds 0 or δ > M/8", table=False)
        return
    opt, mtbf = measured["optimum_s"], cfg.mtbf_h * H
    rec.figure("measured optimum interval (simulation, fit) ± SE", [opt / H, measured["se_s"] / H],
               C.daly_interval(cfg.save_s, mtbf) / H, "h")
    rel = lambda tau: abs(tau - opt) / opt  # noqa: E731
    rec.check("Daly's τ vs the optimum measured on the simulation, relative", "formula",
              rel(C.daly_interval(cfg.save_s, mtbf)), OPT_BAND, compare="<=")
    rec.check("control: sqrt(δM) (a factor 2 lost) vs the measured optimum", "formula",
              rel(math.sqrt(cfg.save_s * mtbf)), OPT_BAND, compare=">")
    rec.figure("Young's τ vs the measured optimum, relative (not checked)",
               round((C.young_interval(cfg.save_s, mtbf) - opt) / opt, 4))


def simulate(cfg: Config, info, tau: float) -> tuple[float, float, int, int]:
    """This rank's share of the seeds (every world_size-th), summed over all ranks; last, the
    sum of the seeds simulated, for the check that each seed ran once."""
    mine = range(cfg.seed * 10**7 + info.rank, cfg.seed * 10**7 + cfg.seeds, info.world_size)
    s, s2, n, seeds = C.simulate_waste(cfg.work_h * H, tau, cfg.save_s, cfg.restart_s,
                                       cfg.mtbf_h * H, mine)
    return reduce_number(s), reduce_number(s2), reduce_number(n), reduce_number(seeds)


def seed_sum(cfg: Config) -> int:
    """Σ of the seeds s0, s0 + 1, ..., s0 + n − 1 (closed form): what the ranks must add up to."""
    s0, n = cfg.seed * 10**7, cfg.seeds
    return n * s0 + n * (n - 1) // 2


def check_simulation(rec: RunRecorder, cfg: Config, tau: float, sums) -> dict:
    *sums, seeds_added = sums
    mean, se = C.mean_and_se(*sums)
    args = (cfg.work_h * H, tau, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H)
    model = C.expected_waste(*args)
    bound = SIM_SIGMAS * se
    rec.figure("runs simulated over all ranks", sums[2])
    rec.check("Σ seeds simulated over all ranks = n·s0 + n(n−1)/2 (each seed once)", "count",
              seeds_added, seed_sum(cfg))
    rec.check("simulated mean waste = Daly's model (h, ± 4 SE)", "formula", mean / H, model / H,
              bound / H)
    # control: charge a whole interval per failure instead of half (the factor 2 again)
    wrong = args[0] * (cfg.save_s / tau + (tau + cfg.restart_s) / args[4])
    rec.check("control: waste with a whole τ lost per failure, |model − sim| (h)", "formula",
              abs(wrong - mean) / H, bound / H, compare=">")
    first = args[0] * C.first_order_overhead(tau, cfg.save_s, cfg.restart_s, args[4])
    rec.figure("simulated waste: mean, standard error", [mean / H, se / H], model / H, "h")
    rec.figure("Young's first-order waste at the same τ (formula)", first / H, unit="h")
    return {"mean_s": mean, "se_s": se, "model_s": model, "first_order_s": first}


def spot_or_not(rec: RunRecorder, cfg: Config, flops: float, tau: float) -> None:
    """Spot's discount against the waste its preemptions cost, at the Daly interval, over the
    planned run's own length (its useful hours on n_gpus), not the simulated 24 h run's."""
    inst = C.instance(cfg.instance)
    if inst.spot_per_h is None:
        log.info("%s has no spot price: no spot comparison", inst.name)
        return
    od = C.run_cost(flops, inst, cfg.mfu, cfg.n_gpus)
    work = od["wall_hours"] * H
    overhead = C.expected_waste(work, tau, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H) / work
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
                 C.young_interval(cfg.save_s, cfg.mtbf_h * H) / H, tau / H, cfg.save_s, cfg.mtbf_h)
        log.info("simulating %d spot runs of %g useful hours on %d rank(s)", cfg.seeds, cfg.work_h,
                 info.world_size)
        sim = check_simulation(rec, cfg, tau, simulate(cfg, info, tau))
        log.info("measuring the best interval on the simulation: %d runs at each of %d "
                 "intervals from δ to M", cfg.opt_seeds, len(C.interval_grid(cfg.save_s, cfg.mtbf_h * H)))
        check_optimum(rec, cfg, measured_optimum(cfg, info))
        spot_or_not(rec, cfg, flops, tau)
        rec.figure("training FLOPs (formula)", flops, unit="FLOP")
        rec.figure("GPU-hours at the MFU (formula)", rows[0]["gpu_hours"], unit="GPU-h")
        rec.figure("Daly interval (formula)", tau / H, unit="h")
        rec.figure("Young interval (formula)", C.young_interval(cfg.save_s, cfg.mtbf_h * H) / H, unit="h")
        rec.figure("money table", rows, table=False)
        rec.figure("layouts", lay, table=False)
        rec.figure("simulation sums (waste s, waste² s², runs)", list(sim.values()), table=False)
        rec.metrics(0, loss=None, lr=None, mean_waste_h=sim["mean_s"] / H)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
