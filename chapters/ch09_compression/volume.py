"""Bytes each compression method sends and receives per step (chapter 09): the formulas the
lesson states, in code. The run checks what `wire.WireTap` counted against `expected_bytes`;
`received_bytes` and `break_even_world` say at which world size a gathered payload stops paying.
"""

import math

import torch

from chapters.ch09_compression.compressors import (
    FP16_VOTERS,
    INT8_VOTERS,
    powersgd_plan,
    topk_size,
    vote_dtype,
)
from chapters.ch09_compression.hooks import HookState


def expected_bytes(method: str, shapes: list[torch.Size], state: HookState, elem: int = 4,
                   world: int = 2) -> int:
    """Bytes one rank hands to collectives per step, for one bucket holding `shapes`, at
    `world` ranks (only the majority vote's depends on it: `vote_dtype`)."""
    n = sum(math.prod(s) for s in shapes)
    if method == "dense":
        return elem * n
    if method in ("fp16", "bf16"):
        return 2 * n
    if method.startswith("topk"):
        return topk_size(n, state.density) * (elem + 4)  # value + int32 index
    if method == "qsgd":
        chunks = math.ceil(n / state.chunk)
        return chunks * state.chunk * 1 + chunks * elem  # int8 levels (padded) + norms
    if method.startswith("signsgd"):
        return math.ceil(n / 8) + elem * len(shapes)  # packed bits + a scale per tensor
    if method == "majority_vote":
        votes = torch.empty((), dtype=vote_dtype(world)).element_size()
        return votes * n + elem * len(shapes)  # a vote per coordinate + a scale per tensor
    if method.startswith("powersgd"):
        total = 0
        for s, r in zip(shapes, powersgd_plan(shapes, state.rank)):
            rows, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
            total += elem * (r * (rows + cols) if r else rows * cols)
        return total
    raise ValueError(f"unknown method {method!r}")


GATHERED = ("topk", "qsgd", "signsgd")  # methods whose payloads are all-gathered, not reduced


def received_bytes(method: str, shapes: list[torch.Size], state: HookState, world: int) -> float:
    """Bytes one rank receives per step over a ring: an all-reduce of B bytes brings in
    2(W−1)/W·B (reduce-scatter, then all-gather), an all-gather of B-byte payloads (W−1)·B.
    A payload that each rank encodes in its own terms (Top-K's own indices, QSGD's own norms,
    packed sign bits with their own scales) cannot be summed on the way, so it is gathered: what
    a rank receives grows with W, while an all-reduce's stays below 2B. Integers on a scale all
    ranks share can be summed: the majority vote's signs are all-reduced."""
    sent = expected_bytes(method, shapes, state, world=world)
    if method.startswith(GATHERED):
        return (world - 1) * sent
    return 2 * (world - 1) / world * sent


def break_even_world(method: str, shapes: list[torch.Size], state: HookState,
                     max_world: int = 1 << 20) -> int | None:
    """The smallest world size at which `method` receives at least as many bytes per rank as
    the dense all-reduce does (None if it never does). The ratio of two all-reduces changes only
    where the vote's dtype widens (`vote_dtype`), so for them only those worlds are tried."""
    if method.startswith(GATHERED):
        worlds = range(2, max_world + 1)
    else:
        worlds = (2, INT8_VOTERS + 1, FP16_VOTERS + 1)
    for world in worlds:
        if received_bytes(method, shapes, state, world) >= received_bytes("dense", shapes, state, world):
            return world
    return None
