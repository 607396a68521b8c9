"""The checks of chapter 17's run that are not parity: the balanced cut against an independent
optimum, the 1F1B step of each cut against its closed form, the activations each schedule holds
(counted in the stages' real calls) and the bubbles of the simulated timelines against their
formulas; and `save_grads`, every rank's gradients gathered into one file the tests compare. (The
schedules' parity with the unsplit model is checked where they run, in `train.main`.)

Expected values come from formulas and from another algorithm, never from the code under test.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from chapters.ch04_model_parallel.schedule import (
    bubble_fraction,
    gpipe_order,
    one_f_one_b_order,
    simulate,
)
from chapters.ch17_pipeline_balance.partition import (
    balanced_partition,
    bisection_optimum,
    stage_costs,
)
from chapters.ch17_pipeline_balance.schedules import (
    interleaved_bubble_formula,
    interleaved_order,
    interleaved_peak,
    one_f_one_b_peak,
    one_f_one_b_step,
    peak_in_flight,
)
from common.checkpoint import save_checkpoint


def count_live_activations(stage: PipelineStage, state: dict) -> None:
    """Wrap the stage's forward and backward of one micro-batch to count, in `state`, the
    micro-batches whose forward has run and whose backward has not: the activations this rank
    holds. (Not a module hook: the stage's shape-inference forward would count too.)"""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def counted_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        state["live"] += 1
        state["peak"] = max(state["peak"], state["live"])
        return out

    def counted_backward(*args, **kwargs):
        state["live"] -= 1
        return backward(*args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = counted_forward, counted_backward


def record_partition(rec, measured: list[float], flops: list[float], uniform: list[int],
                     balanced: list[int], p: int, m: int) -> None:
    """The balanced cut of the measured costs against the optimum found by bisection; the slowest
    stage of each cut beside the ideal share; the simulated 1F1B step of each cut against its
    closed form."""
    # the referee is another algorithm (brute force would try C(4p-1, p-1) cuts: 10^14 at
    # p = 16); the DP adds prefix differences, the referee sums slices: a few ulps apart at most
    rec.check("balanced partition == optimum by bisection (measured costs)", "parity",
              max(stage_costs(measured, balanced)), bisection_optimum(measured, p), 1e-12)
    # the slowest stage beside the ideal share sum/p: in FLOPs (counted from the widths) and in
    # ms (measured block costs)
    for name, unit, costs in (("FLOPs, counted", "FLOPs", flops), ("ms, measured", "ms", measured)):
        for label, bounds in (("uniform", uniform), ("balanced", balanced_partition(costs, p))):
            rec.figure(f"slowest stage, {label} ({name})", max(stage_costs(costs, bounds)),
                       expected=sum(costs) / p, unit=unit)
    # the 1F1B step each cut gives on a simulated timeline, against its closed form (exact when
    # the slowest stage is the last, as in the default model; a bound otherwise)
    for label, b in (("uniform", uniform), ("balanced", balanced_partition(flops, p))):
        c = stage_costs(flops, b)
        span = max(e.end for e in simulate(one_f_one_b_order(p, m), c, [2 * x for x in c]))
        formula, exact = one_f_one_b_step(c, m)
        rec.check(f"simulated 1F1B step, {label} (FLOPs) == 3((m-1) max C + sum C)", "formula",
                  span, formula, compare="==" if exact else "<=")


def record_counted(rec, peaks: dict, orders: dict, p: int, m: int, v: int) -> dict:
    """Live activations per rank (counted in the runs) and the bubbles of the simulated timelines,
    against their formulas. Returns each schedule's counted bubble."""
    rec.check("GPipe: live activations per rank == m", "count", peaks["GPipe"], [m] * p)
    rec.check("1F1B: live activations per rank == min(p-r, m)", "count", peaks["1F1B"],
              [one_f_one_b_peak(p, m, r) for r in range(p)])
    rec.check("Interleaved1F1B: live activations per rank == (2(p-r-1)+(v-1)p+1)/v", "count",
              peaks["Interleaved1F1B"], [interleaved_peak(p, m, v, r) for r in range(p)])
    timelines = {"GPipe": simulate(gpipe_order(p, m)), "1F1B": simulate(one_f_one_b_order(p, m)),
                 "Interleaved1F1B": simulate(interleaved_order(p, m, v))}
    bubbles = {kind: bubble_fraction(events, p) for kind, events in timelines.items()}
    b1, bi = bubbles["1F1B"], bubbles["Interleaved1F1B"]
    # GPipe's bubble equals 1F1B's, so the value alone cannot tell the timelines apart; the
    # activations held on the same timeline can (m per rank, all forwards first)
    rec.check("GPipe timeline: live activations per rank == m", "count",
              [peak_in_flight(timelines["GPipe"], r) for r in range(p)], [m] * p)
    rec.check("GPipe bubble (counted) == (p-1)/(m+p-1)", "formula", float(bubbles["GPipe"]),
              (p - 1) / (m + p - 1), 1e-12)
    rec.check("1F1B bubble (counted) == (p-1)/(m+p-1)", "formula", float(b1), (p - 1) / (m + p - 1), 1e-12)
    rec.check(f"interleaved v={v} bubble (counted) == (p-1)/(vm+p-1)", "formula", float(bi),
              float(interleaved_bubble_formula(p, m, v)), 1e-12)
    rec.check("interleaved bubble < 1F1B bubble (counted)", "count", float(bi), float(b1), compare="<")
    if "Interleaved1F1B" in orders:
        bt = bubble_fraction(simulate(orders["Interleaved1F1B"]), p)
        rec.check("torch's interleaved order: bubble (counted) == (p-1)/(vm+p-1)", "formula", float(bt),
                  float(interleaved_bubble_formula(p, m, v)), 1e-12)
    return bubbles


def save_grads(rec, grads: dict, info) -> None:
    """Every rank's gradients of every run, gathered into one file the tests compare with their
    own unsplit model."""
    p = info.world_size
    gathered = [None] * p
    dist.all_gather_object(gathered, grads)  # CPU tensors: pickled, whatever the backend
    if info.is_main:
        save_checkpoint(rec.out / "grads.pt", {k: {n: g for d in gathered for n, g in d[k].items()}
                                               for k in grads})
