"""The cost planner's model: FLOPs → GPU-hours → money, the communication ÷ compute ratio of a
parallel layout, and what preemptions cost (Young 1974, Daly 2006).

Every formula the course already taught is imported, not re-derived: 6·N·D from chapter 01,
the datasheet peaks from `common.timing`, the ring all-reduce's α–β time from chapter 07, the
bytes a tensor-parallel rank sends per layer from chapter 05, ZeRO's per-step volume from
chapter 06, GPipe's bubble from chapter 04 and Young's interval from chapter 13.

Units: seconds for time (the lesson converts to hours), bytes, FLOPs, US dollars.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from chapters.ch01_overview.calculators import training_flops
from chapters.ch04_model_parallel.schedule import bubble_formula
from chapters.ch05_tensor_parallel.plots import ring_bytes_per_layer
from chapters.ch06_hybrid_zero.memory import paper_volume
from chapters.ch07_communication.cost_model import predicted_time
from chapters.ch13_fault_tolerance.train import young_daly_interval
from common.timing import datasheet_peak_flops

HOUR = 3600.0


@dataclass(frozen=True)
class Instance:
    """One rentable machine. Prices are examples that change (often monthly): check the
    provider's page before planning real money."""

    name: str
    gpu: str
    gpus: int
    nvlink_GBps: float
    """Per GPU, one direction, inside the machine (NVLink)."""
    network_GBps: float
    """Per GPU, one direction, between machines (the instance's network ÷ its GPUs)."""
    on_demand_per_h: float
    """US dollars per machine-hour."""
    spot_per_h: float | None
    """US dollars per machine-hour on spot/preemptible capacity; None where not offered."""
    source: str

    @property
    def peak_flops(self) -> float:
        """Dense bf16 peak of one GPU, from the datasheet table in `common.timing`."""
        return datasheet_peak_flops(self.gpu, torch.bfloat16)


SPOT_DISCOUNT = 0.6
"""Assumed spot discount off on-demand for the examples: Google's Spot VM page states 60–91 %
(cloud.google.com/spot-vms/pricing, read 2026); AWS spot prices float hourly. An assumption."""

INSTANCES = [
    Instance("aws-p5.48xlarge", "H100", 8, 450, 3200 / 8 / 8, 98.32, 98.32 * (1 - SPOT_DISCOUNT),
             "on-demand us-east-1 list price from 2023 until AWS's June 2025 cut, as quoted by "
             "nextplatform.com (2023-07-27); $55.04 in a price list read 2026-11-09; 3200 Gbit/s EFA; "
             "spot = on-demand × (1 − SPOT_DISCOUNT), assumed"),
    Instance("aws-p5-capacity-block", "H100", 8, 450, 3200 / 8 / 8, 39.33, None,
             "EC2 Capacity Blocks pricing page, US East (N. Virginia): effective instance hourly "
             "rate $39.33 ($4.916 per accelerator-hour), a reservation fee paid up front, the OS "
             "billed on top; prices announced to be updated on 2025-01-01 (reserved ahead, not "
             "preemptible; equal to the assumed spot price 0.4 x $98.32 only by coincidence)"),
    Instance("aws-p4d.24xlarge", "A100", 8, 300, 400 / 8 / 8, 32.77, 32.77 * (1 - SPOT_DISCOUNT),
             "on-demand us-east-1 before AWS's June 2025 cut, as listed 2023-2024 (not re-read; "
             "$21.96 = 0.67 × $32.77 in a price list read 2026-11-09); 400 Gbit/s EFA; spot assumed "
             "as above"),
    Instance("tier2-cloud-8xH100", "H100", 8, 450, 400 / 8, 8 * 2.49, None,
             "$2.49 per GPU-hour as quoted by computespec.pages.dev (2026); 400 Gbit/s per GPU "
             "assumed (InfiniBand NDR)"),
]
"""Examples only: prices change (the two AWS on-demand rows predate AWS's June 2025 price cut and
are kept so the lesson's worked numbers stay fixed); the network and NVLink figures are the instance's stated
aggregate divided by its GPUs (NVLink 4: 900 GB/s both directions = 450 GB/s one way;
NVLink 3: 600 = 300)."""


def instance(name: str) -> Instance:
    for inst in INSTANCES:
        if inst.name == name:
            return inst
    raise ValueError(f"unknown instance {name!r}; choose one of {[i.name for i in INSTANCES]}")


# --- FLOPs → GPU-hours → money ------------------------------------------------------------------

def attention_flops(n_layers: int, d_model: int, seq_len: int, n_tokens: float) -> float:
    """Training FLOPs of attention's two T×T products (PaLM, Chowdhery et al. 2022, appendix B):
    12·L·d·T per token (forward 2 × 2·T·d per layer, backward twice that), the full square."""
    return 12 * n_layers * d_model * seq_len * n_tokens


def total_flops(n_params: float, n_tokens: float, n_layers: int = 0, d_model: int = 0,
                seq_len: int = 0) -> float:
    """6·N·D (chapter 01's `training_flops`), plus the attention term when the shape is given."""
    extra = attention_flops(n_layers, d_model, seq_len, n_tokens) if n_layers else 0.0
    return training_flops(n_params, n_tokens) + extra


def gpu_hours(flops: float, peak_flops: float, mfu: float) -> float:
    """GPU-hours = FLOPs / (peak FLOP/s × MFU) / 3600."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return flops / (peak_flops * mfu) / HOUR


def implied_mfu(flops: float, peak_flops: float, reported_gpu_hours: float) -> float:
    """The MFU a reported GPU-hour total implies: FLOPs / (peak × GPU-seconds)."""
    return flops / (peak_flops * reported_gpu_hours * HOUR)


def run_cost(flops: float, inst: Instance, mfu: float, n_gpus: int, spot: bool = False,
             overhead: float = 0.0) -> dict:
    """GPU-hours, wall-clock hours on n_gpus, and dollars on `inst` (whole machines, billed per
    machine-hour). `overhead` is the fraction of extra wall time (checkpoints, lost work,
    restarts: `expected_overhead`) that is paid for too."""
    price = inst.spot_per_h if spot else inst.on_demand_per_h
    if price is None:
        raise ValueError(f"{inst.name} has no spot price")
    machines = math.ceil(n_gpus / inst.gpus)
    hours = gpu_hours(flops, inst.peak_flops, mfu) / (machines * inst.gpus) * (1 + overhead)
    return {"gpu_hours": hours * machines * inst.gpus, "wall_hours": hours,
            "machines": machines, "dollars": hours * machines * price}


# --- parallel layouts: communication ÷ compute --------------------------------------------------

@dataclass(frozen=True)
class Model:
    n_params: float
    n_layers: int
    d_model: int
    seq_len: int


def axis_bandwidth(inst: Instance, stride: int, size: int) -> float:
    """Bytes per second one GPU sends on an axis whose group is `size` ranks `stride` apart:
    NVLink while the group stays inside one machine, the network otherwise."""
    return (inst.nvlink_GBps if stride * size <= inst.gpus else inst.network_GBps) * 1e9


def layout_times(model: Model, inst: Instance, dp: int, tp: int, pp: int, micro_batch: int,
                 global_batch: int, mfu: float, alpha: float = 10e-6, elem: int = 2) -> dict:
    """Seconds per optimizer step of one GPU's compute and of each axis's communication, none
    overlapped (an upper bound on what is exposed). Ranks: tp innermost, then dp, then pp.

    The global batch (sequences) is fixed, so each data-parallel rank runs
    n_micro = global_batch / (dp · micro_batch) micro-batches per step.
    compute: 6·N·tokens / (dp·tp·pp GPUs · peak · MFU), tokens = global_batch·T.
    tp: per micro-batch and layer 4 ring all-reduces of b·T·d activations (chapter 05), on the
        layers this stage holds (L/pp), via chapter 07's α–β ring time.
    dp: one ring all-reduce of the stage's gradients, N/(tp·pp) × elem bytes (chapter 06's 2Ψ).
    pp: per micro-batch one activation to the next stage and one gradient back, b·T·d·elem;
        the bubble (p−1)/(m+p−1) of chapter 04 is idle time, reported apart.
    """
    if global_batch % (dp * micro_batch):
        raise ValueError(f"dp {dp} × micro-batch {micro_batch} does not divide the global batch "
                         f"{global_batch}")
    n_micro = global_batch // (dp * micro_batch)
    tokens = global_batch * model.seq_len
    world = dp * tp * pp
    compute = 6 * model.n_params * tokens / (world * inst.peak_flops * mfu)
    act = micro_batch * model.seq_len * model.d_model * elem
    beta_tp = 1 / axis_bandwidth(inst, 1, tp)
    tp_s = n_micro * (model.n_layers / pp) * 4 * predicted_time("ring", act, tp, alpha, beta_tp)
    grads = model.n_params / (tp * pp) * elem
    beta_dp = 1 / axis_bandwidth(inst, tp, dp)
    # chapter 06: data parallelism moves paper_volume(0) = 2Ψ per rank per step (ring limit),
    # (n−1)/n of it on a ring of n: the bandwidth term of chapter 07's ring all-reduce
    dp_s = (2 * (dp - 1) * alpha + paper_volume(0) * (dp - 1) / dp * grads * beta_dp) if dp > 1 else 0.0
    beta_pp = 1 / axis_bandwidth(inst, tp * dp, pp)
    pp_s = 2 * n_micro * (alpha + act * beta_pp) if pp > 1 else 0.0
    comm = tp_s + dp_s + pp_s
    return {"n_micro": n_micro, "compute_s": compute, "tp_s": tp_s, "dp_s": dp_s, "pp_s": pp_s, "comm_s": comm,
            "ratio": comm / compute, "bubble": float(bubble_formula(pp, n_micro)),
            "tp_bytes_per_layer": ring_bytes_per_layer(tp, micro_batch, model.seq_len,
                                                       model.d_model, elem) * n_micro}


# --- preemptions: checkpoint interval and expected waste -----------------------------------------

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


def spot_break_even(on_demand_per_h: float, spot_per_h: float, overhead_spot: float,
                    overhead_on_demand: float = 0.0) -> dict:
    """Spot pays when price_spot·(1 + waste_spot) < price_od·(1 + waste_od): the cost ratio and
    the largest waste fraction at which spot still breaks even."""
    ratio = spot_per_h * (1 + overhead_spot) / (on_demand_per_h * (1 + overhead_on_demand))
    return {"cost_ratio": ratio,
            "break_even_overhead": on_demand_per_h * (1 + overhead_on_demand) / spot_per_h - 1}


def job_mtbf(instance_mtbf_s: float, n_instances: int) -> float:
    """The job stops when any machine does: M = M₁/N (chapter 13)."""
    return instance_mtbf_s / n_instances
