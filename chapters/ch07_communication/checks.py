"""The proofs chapter 07's run records: every hand-written collective equals the library's, and
sends the bytes the formulas say.

`check_parity` compares each hand collective with torch.distributed on lengths that leave empty
and uneven chunks (integers exactly, floats within `sum_tolerance`); `check_bytes` gathers every
rank's `P2P` counters around one call (`counted`) and compares them with `expected_bytes_sent`
and `expected_hierarchical_bytes`, per rank, per level and off-node. `rank_data`,
`sum_tolerance` and `max_abs_diff` are reused by chapter 22's checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chapters.ch07_communication.collectives import (
    P2P,
    Levels,
    expected_bytes_sent,
    expected_hierarchical_bytes,
    hand_all_reduces,
    hierarchical_all_reduce,
    library_all_gather,
    library_reduce_scatter,
    off_node_bytes,
    ring_all_gather,
    ring_reduce_scatter,
)
from common.config import RunConfig
from common.distributed import gather_numbers, reduce_number
from common.results import RunRecorder

CHECK_LENGTHS = (1, 5, 12, 1001)  # 1 and 5 leave empty / uneven chunks on 2–4 ranks
COUNT_LENGTHS = (12 * 1024, 12 * 1024 + 1)  # 12288 divides by 2, 3, 4, 8, 16; 12289 by none


def rank_data(numel: int, dtype: torch.dtype, rank: int, seed: int, device) -> torch.Tensor:
    """Each rank's own deterministic input: integers (exact sums) or float64 normals."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=dtype).to(device)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype).to(device)


def sum_tolerance(n: int, dtype: torch.dtype, max_abs: float) -> float:
    """How far apart two orders of summing n numbers of magnitude ≤ max_abs may end: each is
    within (n−1)·u·Σ|x| of the exact sum (u = eps/2, the unit roundoff), so the two are within
    2(n−1)·u·n·max_abs. Zero for integers, which add exactly."""
    if not dtype.is_floating_point or n < 2:
        return 0.0
    return 2 * (n - 1) * (torch.finfo(dtype).eps / 2) * n * max_abs


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a − b| (0 for empty tensors; inf if the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    return (a - b).abs().max().item() if a.numel() else 0.0


def hand_vs_library(comm: P2P, levels: Levels, numel: int, dtype: torch.dtype, seed: int,
                    device) -> tuple[dict, float]:
    """(|hand − library| for every hand collective on one length, max over elements;
    the largest |input| on this rank, for the float tolerance)."""
    n, r = comm.world_size, comm.rank
    x = rank_data(numel, dtype, r, seed, device)
    lib = x.clone()
    dist.all_reduce(lib)
    diffs = {f"{name} all-reduce": max_abs_diff(fn(x), lib)
             for name, fn in hand_all_reduces(comm, levels).items()}
    # every rank calls every collective, even one whose chunk is empty: skipping it hangs the ring
    diffs["ring reduce-scatter"] = max_abs_diff(ring_reduce_scatter(x, comm), lib.tensor_split(n)[r])
    # all-gather of uneven shards: the library needs equal ones, so pad to the longest and cut
    sizes = [len(c) for c in x.tensor_split(n)]
    shard = x.tensor_split(n)[r]
    padded = torch.zeros(max(sizes), dtype=dtype, device=device)
    padded[: len(shard)] = shard
    gathered = torch.empty(n * max(sizes), dtype=dtype, device=device)
    library_all_gather(gathered, padded)
    lib_ag = torch.cat([g[:s] for g, s in zip(gathered.view(n, -1), sizes)])
    diffs["ring all-gather"] = max_abs_diff(ring_all_gather(shard, comm, sizes), lib_ag)
    if numel % n == 0:  # the library's own reduce-scatter needs equal chunks
        out = torch.empty(numel // n, dtype=dtype, device=device)
        library_reduce_scatter(out, x.clone())
        diffs["ring reduce-scatter"] = max(diffs["ring reduce-scatter"],
                                           max_abs_diff(ring_reduce_scatter(x, comm), out))
    max_abs = x.abs().max().item() if x.is_floating_point() and x.numel() else 0.0
    return diffs, max_abs


def counted(comm: P2P, fn) -> tuple[list[int], list[int], int]:
    """(bytes, messages) every rank's counter `comm` saw while fn() ran, gathered in rank order,
    and the bytes this rank sent to ranks of other nodes meanwhile (a dict of destinations)."""
    b0, m0, to0 = comm.bytes_sent, comm.messages, dict(comm.bytes_to)
    fn()
    sent_to = {d: b - to0.get(d, 0) for d, b in comm.bytes_to.items()}
    return gather_numbers(comm.bytes_sent - b0), gather_numbers(comm.messages - m0), sent_to


def check_parity(rec: RunRecorder, comm: P2P, levels: Levels, cfg: RunConfig, device) -> None:
    """1. Every hand collective equals the library's: integers exactly, floats within the
    summation-order bound of `sum_tolerance`."""
    n = comm.world_size
    for dtype in (torch.int64, torch.float64):
        worst: dict[str, float] = {}
        max_abs = 0.0
        for numel in CHECK_LENGTHS:
            diffs, m = hand_vs_library(comm, levels, numel, dtype, cfg.seed, device)
            max_abs = max(max_abs, m)
            for name, d in diffs.items():
                worst[name] = max(worst.get(name, 0.0), d)
        tol = sum_tolerance(n, dtype, reduce_number(max_abs, "max"))
        for name, d in worst.items():
            rec.check(f"{name} == torch ({str(dtype)[6:]})", "parity", reduce_number(d, "max"), 0.0, tol)


def check_bytes(rec: RunRecorder, comm: P2P, levels: Levels, device) -> None:
    """2. Bytes on the wire, counted on every rank, against the formulas; and where the
    algorithms differ: the busiest rank, and the bytes that leave a node."""
    n, g = comm.world_size, levels.ranks_per_node
    fns = hand_all_reduces(comm, levels)
    for numel in COUNT_LENGTHS:
        sent, _, _ = counted(comm, lambda k=numel: fns["ring"](torch.ones(k, device=device)))
        rec.check(f"ring all-reduce bytes sent per rank, {numel} float32", "count", sent,
                  [expected_bytes_sent("ring", numel, n, r, 4) for r in range(n)])
        if numel == COUNT_LENGTHS[0]:
            rec.figure(f"ring bytes per rank / S ({numel} float32)", sent[0] / (4 * numel),
                       expected=2 * (n - 1) / n)
    numel, size = COUNT_LENGTHS[0], 4 * COUNT_LENGTHS[0]
    x = torch.ones(numel, device=device)
    off_node = {}
    for algorithm in ("ring", "tree", "naive"):
        sent, messages, sent_to = counted(comm, lambda a=algorithm: fns[a](x))
        if algorithm != "ring":
            rec.check(f"{algorithm} all-reduce bytes sent per rank, {numel} float32", "count", sent,
                      [expected_bytes_sent(algorithm, numel, n, r, 4) for r in range(n)])
        rec.figure(f"{algorithm}: bytes sent by the busiest rank / S", max(sent) / size)
        rec.figure(f"{algorithm}: messages sent by the busiest rank", max(messages))
        off_node[algorithm] = reduce_number(off_node_bytes(sent_to, comm.rank, g), "max")
    levels.reset()
    hierarchical_all_reduce(x, levels)
    intra, inter = gather_numbers(levels.intra.bytes_sent), gather_numbers(levels.inter.bytes_sent)
    want = [expected_hierarchical_bytes(numel, n, g, r, 4) for r in range(n)]
    rec.check(f"hier all-reduce intra-node bytes per rank, {g} ranks per node", "count", intra,
              [w[0] for w in want])
    rec.check(f"hier all-reduce inter-node bytes per rank, {n // g} nodes", "count", inter,
              [w[1] for w in want])
    rec.figure("hier: bytes sent by the busiest rank / S", max(a + b for a, b in zip(intra, inter)) / size)
    # every byte the hierarchy sent, from both levels: a level wired across nodes by mistake shows
    hier_to = {d: levels.intra.bytes_to.get(d, 0) + levels.inter.bytes_to.get(d, 0)
               for d in {*levels.intra.bytes_to, *levels.inter.bytes_to}}
    off_node["hier"] = reduce_number(off_node_bytes(hier_to, comm.rank, g), "max")
    # The flat ring crosses a node border at every rank r whose right neighbour is on the next
    # node: that rank sends all its ring bytes off-node. The hierarchy sends only its inter bytes.
    borders = [r for r in range(n) if n // g > 1 and (r + 1) % g == 0]
    rec.check("most bytes one rank sends off-node, flat ring", "count", off_node["ring"],
              max([expected_bytes_sent("ring", numel, n, r, 4) for r in borders], default=0))
    rec.check("most bytes one rank sends off-node, hierarchical", "count", off_node["hier"],
              max(w[1] for w in want))
