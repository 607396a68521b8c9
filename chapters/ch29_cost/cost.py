"""The cost planner's model: FLOPs → GPU-hours → money, the communication ÷ compute ratio of a
parallel layout, and whether spot pays. What preemptions cost (Young 1974, Daly 2006) is in
`waste.py`.

Every formula the course already taught is imported, not re-derived: 6·N·D from chapter 01,
the datasheet peaks from `common.timing`, the ring all-reduce's α–β time from chapter 07, the
bytes a tensor-parallel rank sends per layer from chapter 05, ZeRO's per-step volume from
chapter 06 and GPipe's bubble from chapter 04 (Young's interval from chapter 13: `waste.py`).

Units: seconds for time (the lesson converts to hours), bytes, FLOPs, US dollars.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from chapters.ch01_overview.calculators import training_flops
from chapters.ch04_model_parallel.schedule import bubble_formula
from chapters.ch05_tensor_parallel.plots import ring_bytes_per_layer
from chapters.ch06_hybrid_zero.memory import paper_volume
from chapters.ch07_communication.cost_model import predicted_time
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


# --- spot or on demand ---------------------------------------------------------------------------

def spot_break_even(on_demand_per_h: float, spot_per_h: float, overhead_spot: float,
                    overhead_on_demand: float = 0.0) -> dict:
    """Spot pays when price_spot·(1 + waste_spot) < price_od·(1 + waste_od): the cost ratio and
    the largest waste fraction at which spot still breaks even."""
    ratio = spot_per_h * (1 + overhead_spot) / (on_demand_per_h * (1 + overhead_on_demand))
    return {"cost_ratio": ratio,
            "break_even_overhead": on_demand_per_h * (1 + overhead_on_demand) / spot_per_h - 1}
