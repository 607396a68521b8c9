"""Chapter 04's schedule simulator, extended: interleaved (virtual-stage) 1F1B, activation
counting, and the orders `torch.distributed.pipelining` itself computes.

With v model chunks per rank, rank r holds stages r, r+p, ..., r+(v−1)p, each 1/v of its
layers. A micro-batch visits every rank v times, so the pipeline fills and drains in steps of
1/v the size: the bubble shrinks from (p−1)/(m+p−1) to (p−1)/(v·m+p−1), for v times more
point-to-point messages.
"""

from __future__ import annotations

from fractions import Fraction

from chapters.ch04_model_parallel.schedule import Event, Op


def interleaved_order(n_ranks: int, n_micro: int, n_chunks: int) -> list[list[Op]]:
    """Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM): micro-batches go through the
    local chunks in groups of p; warm-up of 2(p−r−1) + (v−1)p forwards, then 1F1B. (When m = p,
    Megatron's code runs every forward first instead; this order, like torch's, keeps the
    formula's warm-up there too.)"""
    p, v, m = n_ranks, n_chunks, n_micro
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) to be a multiple of ranks ({p})")

    def op(kind: str, k: int, rank: int) -> Op:
        chunk = (k // p) % v
        if kind == "B":
            chunk = v - 1 - chunk
        return Op(kind, (k // (p * v)) * p + k % p, chunk * p + rank)

    orders = []
    total = m * v
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        ops = [op("F", k, r) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [op("F", warmup + i, r), op("B", i, r)]
        ops += [op("B", k, r) for k in range(total - warmup, total)]
        orders.append(ops)
    return orders


def interleaved_bubble_formula(n_ranks: int, n_micro: int, n_chunks: int) -> Fraction:
    """(p−1)/(v·m+p−1), as a Fraction."""
    return Fraction(n_ranks - 1, n_chunks * n_micro + n_ranks - 1)


def one_f_one_b_step(stage_costs: list[float], n_micro: int) -> tuple[float, bool]:
    """The 1F1B step in closed form, stage s costing C_s forward and 2C_s backward, free messages:
    3((m−1)·max C + ΣC), exact when the slowest stage is the last (it paces the m−1 steady-state
    steps and every other stage only adds its fill and drain), an upper bound otherwise.
    Returns (the formula, whether it is exact)."""
    return 3 * ((n_micro - 1) * max(stage_costs) + sum(stage_costs)), stage_costs[-1] == max(stage_costs)


def one_f_one_b_peak(n_ranks: int, n_micro: int, rank: int) -> int:
    """Micro-batches whose activations rank r holds at most under 1F1B: its p−r−1 warm-up
    forwards plus the one whose backward comes next, p−r (never more than m)."""
    return min(n_ranks - rank, n_micro)


def interleaved_peak(n_ranks: int, n_micro: int, n_chunks: int, rank: int) -> float:
    """The same under interleaved 1F1B, in whole stages (a chunk is 1/v of one): the warm-up of
    2(p−r−1) + (v−1)p chunk forwards plus one, at most all m·v, over v. Rank 0 holds
    p + (p−1)/v micro-batches' worth once m ≥ 2p (1F1B: p)."""
    p, v = n_ranks, n_chunks
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, n_micro * v) / v


def peak_in_flight(events: list[Event], rank: int, n_chunks: int = 1) -> float:
    """Most micro-batches whose activations `rank` holds at once: +1 when a forward ends,
    −1 when its backward ends; a chunk counts 1/v of a rank's layers."""
    changes = sorted((e.end, 0 if e.kind == "B" else 1, e.kind) for e in events if e.rank == rank)
    live = peak = 0
    for _, _, kind in changes:  # at equal times, frees come before new activations
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak / n_chunks


def torch_order(schedule, n_ranks: int) -> list[list[Op]]:
    """The forward/backward order `torch.distributed.pipelining` computed for every rank
    (its `pipeline_order`; idle slots and communication actions dropped)."""
    orders = []
    for r in range(n_ranks):
        ops = []
        for action in schedule.pipeline_order[r]:
            if action is None:
                continue
            # FULL_BACKWARD since torch 2.5 (zero-bubble schedules split it into two halves)
            kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD": "B"}.get(action.computation_type.name)
            if kind:
                ops.append(Op(kind, action.microbatch_index, action.stage_index))
        orders.append(ops)
    return orders
