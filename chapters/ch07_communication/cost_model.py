"""Algorithm and bus bandwidth as nccl-tests reports them, and the α–β cost model.

algbw = S / t, with S the collective's data size (nccl-tests' "size" column). busbw multiplies
algbw by the fraction of S that each rank's link must carry in the optimal (ring) algorithm, so
that busbw is comparable across collectives and world sizes and can be held against the link's
peak bandwidth. α–β: a message of m bytes costs α + m·β (α latency, 1/β bandwidth).
"""

from __future__ import annotations

import math


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw (PERFORMANCE.md of nccl-tests)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def alg_bandwidth(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes per second, as nccl-tests prints)."""
    return size_bytes / seconds / 1e9


def bus_bandwidth(op: str, size_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s: algbw × bus_factor(op, n)."""
    return alg_bandwidth(size_bytes, seconds) * bus_factor(op, n)


def predicted_time(algorithm: str, size: float, n: int, alpha: float, beta: float) -> float:
    """α–β time of one all-reduce of `size` bytes on n ranks (seconds; β in s/byte).

    ring: 2(n−1) steps, each a message of S/n.  tree: a binary tree, reduce up and broadcast
    down, every hop the whole tensor (not pipelined).  double_tree: NCCL's two complementary
    pipelined trees, half the data each: log-depth latency, ≈ the ring's bandwidth term.
    naive: the root receives and sends n−1 whole tensors one after another.
    """
    if n == 1:
        return 0.0
    depth = math.ceil(math.log2(n + 1)) - 1  # edges from rank 0 to the deepest rank
    if algorithm == "ring":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size * beta
    if algorithm == "tree":
        children = min(2, n - 1)  # a parent receives (and sends) one whole tensor per child
        return 2 * depth * (alpha + children * size * beta)
    if algorithm == "double_tree":
        return 2 * math.ceil(math.log2(n)) * alpha + 2 * size * beta
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + size * beta)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def fit_latency_bandwidth(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Fit t = a + b·S by least squares on *relative* errors (weights 1/t), so the small
    messages set the latency a and the large ones the inverse bandwidth b. Returns (a, b)."""
    w = [1 / t for t in times]
    # minimise Σ w²(a + b S − t)²: the 2×2 normal equations
    s00 = sum(wi * wi for wi in w)
    s01 = sum(wi * wi * s for wi, s in zip(w, sizes))
    s11 = sum(wi * wi * s * s for wi, s in zip(w, sizes))
    r0 = sum(wi * wi * t for wi, t in zip(w, times))
    r1 = sum(wi * wi * s * t for wi, s, t in zip(w, sizes, times))
    det = s00 * s11 - s01 * s01
    a = (r0 * s11 - r1 * s01) / det
    b = (s00 * r1 - s01 * r0) / det
    return a, b


def ring_alpha_beta(a: float, b: float, n: int) -> tuple[float, float]:
    """Read a fitted line t = a + b·S as a ring all-reduce: a = 2(n−1)α, b = 2(n−1)/n·β."""
    return a / (2 * (n - 1)), b / (2 * (n - 1) / n)
