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


def predicted_time(algorithm: str, size: float, n: int, alpha: float, beta: float,
                   tree_efficiency: float = 1.0) -> float:
    """α–β time of one all-reduce of `size` bytes on n ranks (seconds; β in s/byte).

    ring: 2(n−1) steps, each a message of S/n.  tree: a binary tree, reduce up and broadcast
    down, every hop the whole tensor (not pipelined), a parent taking its two children one after
    the other at every level: exact for a complete tree (n = 2^k − 1), an upper bound otherwise
    (at n = 4 the critical path is 5 transfers of S; the formula counts 8).  double_tree: NCCL's two complementary
    pipelined trees, half the data each: every rank sends and receives 2S in all, so
    2⌈log2 n⌉α + 2Sβ; `tree_efficiency` < 1 divides its bandwidth (NCCL's own tuner rates the
    tree's all-reduce bandwidth at most 0.92 of the link's).  naive: the root receives and sends
    n−1 whole tensors one after another.  in_network: the switch adds (SHARP, NVLS): every rank
    sends S up and receives S back, 2α + Sβ (a model only; this course cannot measure it).
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
        return 2 * math.ceil(math.log2(n)) * alpha + 2 * size * beta / tree_efficiency
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + size * beta)
    if algorithm == "in_network":
        return 2 * alpha + size * beta
    raise ValueError(f"unknown algorithm {algorithm!r}")


def ring_tree_crossover(n: int, alpha: float, beta: float, tree_efficiency: float = 1.0) -> float:
    """The size in bytes above which the ring all-reduce beats the double tree in this model.

    ring − double_tree = 2(n−1−⌈log2 n⌉)·α − 2S·β·(1/η − (n−1)/n), zero at
    S* = (n−1−⌈log2 n⌉)·α / (β·(1/η − (n−1)/n)); with η = 1 that is n·(n−1−⌈log2 n⌉)·α/β.
    Infinite when the ring never wins (n ≤ 2: it has no more latency steps than the tree).
    """
    steps = n - 1 - math.ceil(math.log2(n))
    per_byte = 1 / tree_efficiency - (n - 1) / n
    if steps <= 0 or per_byte <= 0:
        return math.inf
    return steps * alpha / (beta * per_byte)


def hierarchical_time(size: float, ranks_per_node: int, nodes: int, alpha_intra: float,
                      beta_intra: float, alpha_inter: float, beta_inter: float) -> float:
    """α–β time of the hierarchical all-reduce: ring reduce-scatter and all-gather inside a
    node of g ranks on S, ring all-reduce across the m nodes on S/g."""
    g, m = ranks_per_node, nodes
    intra = 2 * (g - 1) * alpha_intra + 2 * (g - 1) / g * size * beta_intra
    inter = 2 * (m - 1) * alpha_inter + 2 * (m - 1) / m * (size / g) * beta_inter
    return intra + inter


def fit_latency_bandwidth(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Fit t = a + b·S by least squares on *relative* errors (weights 1/t), so the small
    messages set the latency a and the large ones the inverse bandwidth b. Neither may be
    negative (noisy timings can tilt an unconstrained line below zero): if one comes out
    negative it is set to 0 and the other refitted alone. Returns (a, b)."""
    w2 = [1 / t**2 for t in times]
    # minimise Σ w²(a + b S − t)²: the 2×2 normal equations
    s00 = sum(w2)
    s01 = sum(w * s for w, s in zip(w2, sizes))
    s11 = sum(w * s * s for w, s in zip(w2, sizes))
    r0 = sum(w * t for w, t in zip(w2, times))
    r1 = sum(w * s * t for w, s, t in zip(w2, sizes, times))
    det = s00 * s11 - s01 * s01
    a = (r0 * s11 - r1 * s01) / det
    b = (s00 * r1 - s01 * r0) / det
    if b < 0:
        return r0 / s00, 0.0
    if a < 0:
        return 0.0, r1 / s11
    return a, b


def ring_alpha_beta(a: float, b: float, n: int) -> tuple[float, float]:
    """Read a fitted line t = a + b·S as a ring all-reduce: a = 2(n−1)α, b = 2(n−1)/n·β."""
    return a / (2 * (n - 1)), b / (2 * (n - 1) / n)
