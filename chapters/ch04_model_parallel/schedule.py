"""A pipeline schedule simulator: who computes what, when, with steps of fixed cost.

A schedule is one ordered list of operations per rank: forward `F` or backward `B` of a
micro-batch through a model stage. `simulate` starts every operation as soon as its rank is
free and its inputs exist (the previous stage's forward, the next stage's backward), so the
timeline it returns is what an ideal pipeline does: no communication cost, no noise. Counting
the idle slots of that timeline proves the bubble formula (p−1)/(m+p−1) without a clock.
Chapter 17 imports this module and adds interleaved (virtual-stage) schedules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Op:
    """One unit of pipeline work: forward ("F") or backward ("B") of micro-batch `mb` on `stage`."""

    kind: str
    mb: int
    stage: int


@dataclass(frozen=True)
class Event:
    """An operation placed on the timeline of `rank`, from `start` to `end`."""

    rank: int
    kind: str
    mb: int
    stage: int
    start: float
    end: float


def gpipe_order(n_stages: int, n_micro: int) -> list[list[Op]]:
    """GPipe: every rank runs all m forwards, then all m backwards (stage s on rank s)."""
    return [[Op("F", i, s) for i in range(n_micro)] + [Op("B", i, s) for i in range(n_micro)]
            for s in range(n_stages)]


def one_f_one_b_order(n_stages: int, n_micro: int) -> list[list[Op]]:
    """1F1B (PipeDream-Flush): stage s runs p−s−1 warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards."""
    orders = []
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, n_micro)
        ops = [Op("F", i, s) for i in range(warmup)]
        for i in range(n_micro - warmup):
            ops += [Op("F", warmup + i, s), Op("B", i, s)]
        ops += [Op("B", i, s) for i in range(n_micro - warmup, n_micro)]
        orders.append(ops)
    return orders


def _cost(cost: float | Sequence[float], stage: int) -> float:
    return cost[stage] if isinstance(cost, Sequence) else cost


def dependencies(op: Op, n_stages: int) -> list[tuple[str, int, int]]:
    """What must be finished before `op` may start: its input activation (the previous
    stage's forward) or its output gradient (the next stage's backward, or for the last
    stage its own forward, where the loss is computed)."""
    if op.kind == "F":
        return [("F", op.mb, op.stage - 1)] if op.stage > 0 else []
    if op.stage == n_stages - 1:
        return [("F", op.mb, op.stage)]
    return [("B", op.mb, op.stage + 1), ("F", op.mb, op.stage)]


def simulate(orders: list[list[Op]], f_cost: float | Sequence[float] = 1,
             b_cost: float | Sequence[float] = 1, comm: float = 0) -> list[Event]:
    """Place every operation at the earliest time its rank is free and its dependencies are
    done. Costs are per operation, one number or one per stage; `comm` is the delay of a
    message (a dependency on another rank's operation), 0 by default: free communication.
    Raises ValueError if the orders deadlock (a rank waits for work queued behind its own)."""
    n_stages = 1 + max(op.stage for ops in orders for op in ops)
    rank_of = {op.stage: rank for rank, ops in enumerate(orders) for op in ops}
    done: dict[tuple[str, int, int], float] = {}
    events: list[Event] = []
    nxt, free = [0] * len(orders), [0.0] * len(orders)
    while len(events) < sum(map(len, orders)):
        progressed = False
        for rank, ops in enumerate(orders):
            while nxt[rank] < len(ops):
                op = ops[nxt[rank]]
                deps = dependencies(op, n_stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[rank]] + [done[d] + (comm if rank_of[d[2]] != rank else 0) for d in deps])
                cost = _cost(f_cost if op.kind == "F" else b_cost, op.stage)
                events.append(Event(rank, op.kind, op.mb, op.stage, start, start + cost))
                done[(op.kind, op.mb, op.stage)] = free[rank] = start + cost
                nxt[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: a rank waits for an operation that never runs")
    return events


def grid(events: list[Event], n_ranks: int) -> list[list[str]]:
    """The timeline as unit time slots per rank ("F3", "B0", or "." when idle); needs integer costs."""
    makespan = int(max(e.end for e in events))
    rows = [["."] * makespan for _ in range(n_ranks)]
    for e in events:
        for t in range(int(e.start), int(e.end)):
            rows[e.rank][t] = f"{e.kind}{e.mb}"
    return rows


def bubble_fraction(events: list[Event], n_ranks: int) -> Fraction:
    """Idle slots over all slots: 1 − busy time / (ranks × makespan), exact for integer costs."""
    makespan = Fraction(max(e.end for e in events))
    busy = sum(Fraction(e.end) - Fraction(e.start) for e in events)
    return 1 - busy / (n_ranks * makespan)


def bubble_formula(n_stages: int, n_micro: int) -> Fraction:
    """GPipe's bubble with equal stages: (p−1)/(m+p−1)."""
    return Fraction(n_stages - 1, n_micro + n_stages - 1)
