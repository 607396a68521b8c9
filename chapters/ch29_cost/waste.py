"""What preemptions cost: the checkpoint interval that minimises the waste they cause (Young
1974: `young_interval`, chapter 13's `young_daly_interval`; Daly 2006: `daly_interval`), Daly's
exact model of that waste (`expected_waste`), and the spot run simulated event by event that
checks it (`simulate_run`), with the tools to measure the best interval on the simulation
(`interval_grid`, `simulate_rate`, `fit_optimum`). The money side is in `cost.py`.

Units: seconds, as in `cost.py`.
"""

from __future__ import annotations

import math
import random

import torch

from chapters.ch13_fault_tolerance.checkpoints import young_daly_interval


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young (1974): τ = sqrt(2·δ·M), chapter 13's `young_daly_interval`."""
    return young_daly_interval(save_s, mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly (2006): τ = sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + (1/9)·(δ/2M)] − δ for δ < 2M,
    else M: the minimiser of `expected_wall_time` expanded to higher order."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    r = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - save_s


def first_order_overhead(tau: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Young's model, overhead per second of useful work: δ/τ (saving) + (τ/2 + R)/M (each
    failure, one per M seconds, loses half an interval and a restart). Minimum at sqrt(2δM)."""
    return save_s / tau + (tau / 2 + restart_s) / mtbf_s


def segment_time(length_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected wall time to finish `length_s` of uninterrupted work (compute + the save that
    ends it) when failures arrive at rate 1/M, also during restarts, and each failure costs a
    restart R before the segment starts over: M·e^{R/M}·(e^{t/M} − 1) (Daly 2006).

    Why: from a failure the job needs R + t without a failure; that costs (e^{(R+t)/M} − 1)·M
    (the expected time of a task of length R + t restarted from scratch). A fresh start spends
    E[min(X, t)] = M(1 − e^{−t/M}) and fails with probability 1 − e^{−t/M}, so the total is
    M(1 − e^{−t/M})·e^{(R+t)/M} = M·e^{R/M}·(e^{t/M} − 1)."""
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(length_s / mtbf_s)


def segments(work_s: float, tau: float) -> list[float]:
    """The work between saves: full intervals of τ and a shorter last one."""
    n = math.ceil(work_s / tau - 1e-12)
    return [tau] * (n - 1) + [work_s - (n - 1) * tau]


def expected_wall_time(work_s: float, tau: float, save_s: float, restart_s: float,
                       mtbf_s: float) -> float:
    """Daly's exact model: Σ over segments of `segment_time(w + δ)`."""
    return sum(segment_time(w + save_s, restart_s, mtbf_s) for w in segments(work_s, tau))


def expected_failures(work_s: float, tau: float, save_s: float, restart_s: float,
                      mtbf_s: float) -> float:
    """Expected preemptions over the run. They arrive at rate 1/M while the job's machines run
    (work, saves, restarts), so their expected number is the expected wall time of Daly's model
    divided by M (Wald's identity for a Poisson process stopped at the run's end)."""
    return expected_wall_time(work_s, tau, save_s, restart_s, mtbf_s) / mtbf_s


def expected_waste(work_s: float, tau: float, save_s: float, restart_s: float,
                   mtbf_s: float, wait_s: float = 0.0) -> float:
    """Wall time beyond the useful work: saves, lost work, restarts (Daly's model), and a wait D
    (`wait_s`) for capacity after each preemption. No machine of the job runs during the wait, so
    nothing can be preempted in it: it is not part of R (a restart can be interrupted, which is
    the e^{R/M} factor) but D × `expected_failures`."""
    wall = expected_wall_time(work_s, tau, save_s, restart_s, mtbf_s)
    return wall - work_s + wait_s * wall / mtbf_s


def per_work_rate(tau: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Wall seconds per useful second with segments of τ (no short last one): the function whose
    minimiser Daly's formula approximates."""
    return segment_time(tau + save_s, restart_s, mtbf_s) / tau


def golden_section(f, lo: float, hi: float, rel_tol: float = 1e-10) -> float:
    """Minimise a unimodal f on [lo, hi] (plain Python: no scipy needed)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > rel_tol * (abs(a) + abs(b)):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def simulate_run(work_s: float, tau: float, save_s: float, restart_s: float, mtbf_s: float,
                 seed: int, wait_s: float = 0.0) -> float:
    """One spot run, event by event: failures at exponential inter-arrival times of mean M
    (memoryless: a fresh draw after each), a save of δ after every τ of work (work is safe
    only once its save ends), after each failure a wait of D for capacity (`wait_s`: no machine
    runs, so no failure is drawn in it), then a restart of R (which can fail too).
    Returns the wall time."""
    rng = random.Random(seed)
    wall = 0.0
    for w in segments(work_s, tau):
        need, restarting = w + save_s, False
        while True:
            length = need + (restart_s if restarting else 0.0)
            x = rng.expovariate(1 / mtbf_s)
            if x >= length:
                wall += length
                break
            wall += x + wait_s
            restarting = True
    return wall


def simulate_waste(work_s: float, tau: float, save_s: float, restart_s: float, mtbf_s: float,
                   seeds, wait_s: float = 0.0) -> tuple[float, float, int, int]:
    """Σ waste, Σ waste², the count, and Σ of the seeds actually simulated (what ranks add up;
    the last proves each seed ran once)."""
    s = s2 = 0.0
    n = seed_sum = 0
    for seed in seeds:
        waste = simulate_run(work_s, tau, save_s, restart_s, mtbf_s, seed, wait_s) - work_s
        s, s2, n, seed_sum = s + waste, s2 + waste * waste, n + 1, seed_sum + seed
    return s, s2, n, seed_sum


def interval_grid(save_s: float, mtbf_s: float, per_doubling: int = 2) -> list[float]:
    """Checkpoint intervals from δ to M, log-spaced (`per_doubling` per factor 2): where the
    best interval lies whenever δ is well below M, chosen without any formula for it."""
    n = int(math.floor(per_doubling * math.log2(mtbf_s / save_s) + 1e-9))
    return [save_s * 2 ** (k / per_doubling) for k in range(n + 1)]


def simulate_rate(tau: float, save_s: float, restart_s: float, mtbf_s: float,
                  segments_per_run: int, seeds) -> tuple[float, float, int]:
    """Σ, Σ² and count of the waste per useful second of runs of `segments_per_run` whole
    intervals of τ (no short last segment: the long-run rate, which Young and Daly minimise),
    simulated event by event (`simulate_run`)."""
    work = segments_per_run * tau
    s = s2 = 0.0
    n = 0
    for seed in seeds:
        rate = (simulate_run(work, tau, save_s, restart_s, mtbf_s, seed) - work) / work
        s, s2, n = s + rate, s2 + rate * rate, n + 1
    return s, s2, n


def fit_optimum(taus: list[float], means: list[float], ses: list[float],
                half_width: int = 2) -> tuple[float, float]:
    """The measured optimum: around the smallest simulated mean (`half_width` grid points each
    side), the weighted least-squares curve a/τ + b·τ + c (saving costs a/τ, failures b·τ: the
    shape of any first-order model, with no δ, M or factor 2 in it) and its minimum sqrt(a/b),
    with a standard error from the fit's covariance (delta method). (nan, nan) if the fitted
    curve has no minimum."""
    i = min(range(len(means)), key=means.__getitem__)
    lo, hi = max(0, i - half_width), min(len(means), i + half_width + 1)
    t = torch.tensor(taus[lo:hi], dtype=torch.float64)
    X = torch.stack([1 / t, t, torch.ones_like(t)], dim=1)
    w = 1 / torch.tensor(ses[lo:hi], dtype=torch.float64) ** 2
    cov = torch.linalg.inv(X.T @ (w[:, None] * X))
    a, b, _ = (cov @ (X.T @ (w * torch.tensor(means[lo:hi], dtype=torch.float64)))).tolist()
    if a <= 0 or b <= 0:
        return math.nan, math.nan
    opt = math.sqrt(a / b)
    grad = torch.tensor([opt / (2 * a), -opt / (2 * b), 0.0], dtype=torch.float64)
    return opt, math.sqrt(float(grad @ cov @ grad))


def mean_and_se(s: float, s2: float, n: int) -> tuple[float, float]:
    """Sample mean and its standard error from sums."""
    mean = s / n
    var = max(s2 / n - mean * mean, 0.0) * n / (n - 1)
    return mean, math.sqrt(var / n)


def job_mtbf(instance_mtbf_s: float, n_instances: int) -> float:
    """The job stops when any machine does: M = M₁/N (chapter 13)."""
    return instance_mtbf_s / n_instances
