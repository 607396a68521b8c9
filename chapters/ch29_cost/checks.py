"""The proofs a chapter 29 run records. The planner is arithmetic; its proof is a simulated spot
run (`waste.simulate_run`) repeated over many seeds that the ranks split (`simulate`), whose mean
waste must match Daly's model (`check_simulation`), and the best checkpoint interval measured on
the simulation with no formula for it (`measured_optimum`), which Daly's interval must hit
(`check_optimum`); Daly's formula against a numeric minimisation of the exact model
(`check_intervals`). Each check has a control that must fail (Young's formula, a factor 2 lost).
"""

import math

import torch
import torch.distributed as dist

from chapters.ch29_cost import waste as W
from chapters.ch29_cost.cost import HOUR as H
from common.distributed import reduce_number
from common.results import RunRecorder

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


def check_intervals(rec: RunRecorder, save: float, restart: float, mtbf: float) -> float:
    """Daly's formula against a numeric minimisation of the exact model (Young's as control)."""
    daly_err = young_err = 0.0
    for ratio in DALY_GRID:  # δ/M, with M = 1: the optimum scales with M
        exact = W.golden_section(lambda t, r=ratio: W.per_work_rate(t, r, 0.0, 1.0), 1e-8, 10.0)
        daly_err = max(daly_err, abs(W.daly_interval(ratio, 1.0) - exact) / exact)
        young_err = max(young_err, abs(W.young_interval(ratio, 1.0) - exact) / exact)
    rec.check("Daly = argmin of the exact model, worst over δ/M ≤ 0.1", "formula", daly_err,
              DALY_TOL, compare="<=")
    rec.check("control: Young against the exact model, worst over δ/M ≤ 0.1", "formula",
              young_err, DALY_TOL, compare=">")
    return W.daly_interval(save, mtbf)


def measured_optimum(cfg, info) -> dict | None:
    """The best checkpoint interval measured on the simulation, with no formula for it: the
    waste per useful second simulated at intervals from δ to M (`interval_grid`), this rank's
    share of the seeds at each, summed over the ranks in one all-reduce; then the minimum of the
    curve fitted around the smallest (`fit_optimum`)."""
    if cfg.opt_seeds == 0 or cfg.save_s > cfg.mtbf_h * H / 8:
        return None  # no interior minimum on the grid to measure
    taus = W.interval_grid(cfg.save_s, cfg.mtbf_h * H)
    base = cfg.seed * 10**7 + 5 * 10**6  # seeds apart from the waste simulation's
    mine = range(base + info.rank, base + cfg.opt_seeds, info.world_size)
    sums = torch.tensor([W.simulate_rate(t, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H,
                                         cfg.opt_segments, mine) for t in taus],
                        dtype=torch.float64, device=info.device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)  # on info.device: NCCL takes CUDA tensors only
    stats = [W.mean_and_se(s, s2, round(n)) for s, s2, n in sums.cpu().tolist()]
    opt, se = W.fit_optimum(taus, [m for m, _ in stats], [e for _, e in stats])
    return {"taus": taus, "means": [m for m, _ in stats], "ses": [e for _, e in stats],
            "optimum_s": opt, "se_s": se}


def check_optimum(rec: RunRecorder, cfg, measured: dict | None) -> None:
    """Daly's interval within OPT_BAND of the measured optimum; √(δM) outside it."""
    if measured is None:
        rec.figure("measured optimum (simulation)", "n/a: --opt-seeds 0 or δ > M/8", table=False)
        return
    opt, mtbf = measured["optimum_s"], cfg.mtbf_h * H
    rec.figure("measured optimum interval (simulation, fit) ± SE", [opt / H, measured["se_s"] / H],
               W.daly_interval(cfg.save_s, mtbf) / H, "h")
    rel = lambda tau: abs(tau - opt) / opt  # noqa: E731
    rec.check("Daly's τ vs the optimum measured on the simulation, relative", "formula",
              rel(W.daly_interval(cfg.save_s, mtbf)), OPT_BAND, compare="<=")
    rec.check("control: sqrt(δM) (a factor 2 lost) vs the measured optimum", "formula",
              rel(math.sqrt(cfg.save_s * mtbf)), OPT_BAND, compare=">")
    rec.figure("Young's τ vs the measured optimum, relative (not checked)",
               round((W.young_interval(cfg.save_s, mtbf) - opt) / opt, 4))


def simulate(cfg, info, tau: float) -> tuple[float, float, int, int]:
    """This rank's share of the seeds (every world_size-th), summed over all ranks; last, the
    sum of the seeds simulated, for the check that each seed ran once."""
    mine = range(cfg.seed * 10**7 + info.rank, cfg.seed * 10**7 + cfg.seeds, info.world_size)
    s, s2, n, seeds = W.simulate_waste(cfg.work_h * H, tau, cfg.save_s, cfg.restart_s,
                                       cfg.mtbf_h * H, mine)
    return reduce_number(s), reduce_number(s2), reduce_number(n), reduce_number(seeds)


def seed_sum(cfg) -> int:
    """Σ of the seeds s0, s0 + 1, ..., s0 + n − 1 (closed form): what the ranks must add up to."""
    s0, n = cfg.seed * 10**7, cfg.seeds
    return n * s0 + n * (n - 1) // 2


def check_simulation(rec: RunRecorder, cfg, tau: float, sums) -> dict:
    *sums, seeds_added = sums
    mean, se = W.mean_and_se(*sums)
    args = (cfg.work_h * H, tau, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H)
    model = W.expected_waste(*args)
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
    first = args[0] * W.first_order_overhead(tau, cfg.save_s, cfg.restart_s, args[4])
    rec.figure("simulated waste: mean, standard error", [mean / H, se / H], model / H, "h")
    rec.figure("Young's first-order waste at the same τ (formula)", first / H, unit="h")
    return {"mean_s": mean, "se_s": se, "model_s": model, "first_order_s": first}
