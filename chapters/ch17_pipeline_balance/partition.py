"""Cutting a stack of layers into pipeline stages: uniform, cost-balanced, and two referees.

A pipeline runs at the pace of its slowest stage, so the partition that minimises the
largest stage cost is the one to use. Contiguous layers only (a stage sends its output to the
next stage), so this is the classic linear-partition problem: dynamic programming over
"first i layers in k stages" finds the optimum in O(k·n²). Two referees check it by other
means: `brute_force_partition` tries every set of cuts (small cases only: C(n−1, k−1) of them),
and `bisection_optimum` searches the stage-cost cap directly, for any size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def uniform_partition(n_layers: int, n_stages: int) -> list[int]:
    """Stage boundaries [0, b1, ..., n_layers] with layer counts as equal as possible."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {n_stages} non-empty stages")
    q, r = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + q + (1 if s < r else 0))
    return bounds


def stage_costs(costs: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Total cost of each stage's layers."""
    return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


def balanced_partition(costs: Sequence[float], n_stages: int) -> list[int]:
    """Boundaries of the contiguous partition with the smallest maximum stage cost.

    best[k][i] = the smallest possible max stage cost of the first i layers in k stages
               = min over j of max(best[k−1][j], cost of layers j..i−1).
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def brute_force_partition(costs: Sequence[float], n_stages: int) -> tuple[float, list[int]]:
    """Try every set of n_stages−1 cut points; return (best max stage cost, its boundaries)."""
    n = len(costs)
    best = (float("inf"), [])
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = [0, *cuts, n]
        best = min(best, (max(stage_costs(costs, bounds)), bounds))
    return best


def bisection_optimum(costs: Sequence[float], n_stages: int) -> float:
    """The smallest possible max stage cost, found without dynamic programming. The optimum is
    the cost of some run of contiguous layers; a cap is feasible if packing layers greedily (each
    stage takes layers until the next would exceed the cap) needs at most n_stages stages, and
    feasibility grows with the cap, so bisect over the sorted run costs. O(n² log n) sums."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} non-empty stages")

    def stages_needed(cap: float) -> int:
        if max(costs) > cap:
            return n + 1  # a layer alone exceeds the cap: no packing fits
        count, start = 1, 0
        for i in range(n):
            if sum(costs[start:i + 1]) > cap:  # the same sums as stage_costs: exact comparisons
                count, start = count + 1, i
        return count

    caps = sorted({sum(costs[a:b]) for a in range(n) for b in range(a + 1, n + 1)})
    lo, hi = 0, len(caps) - 1  # the whole model in one stage always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if stages_needed(caps[mid]) <= n_stages:
            hi = mid
        else:
            lo = mid + 1
    return caps[lo]
