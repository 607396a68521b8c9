"""Secure aggregation by pairwise masks (Bonawitz et al., CCS 2017), reduced to its core.

Each client encodes its update in fixed point (f fraction bits) as integers modulo 2³². Every
pair of clients (i, j), i < j, shares a seed s_ij and expands it into a mask m_ij of uniformly
random 32-bit integers; client i adds m_ij, client j subtracts it. Alone, a masked vector is
uniformly random; in the sum every mask meets its negative, so

    Σ_i (x_i + Σ_{j>i} m_ij − Σ_{j<i} m_ji)  ≡  Σ_i x_i   (mod 2³²)

exactly. The tensors are int64 holding values in [0, 2³²): gloo's all-reduce refuses uint32
("Invalid scalar type", torch 2.14.1), and a sum of W values below 2³² fits in int64 for any
W < 2³¹, so reducing modulo 2³² after the all-reduce is exact.

Slot 0 of every vector carries the integer 1 (no fraction bits): the decoded slot is the
number of clients whose masks cancelled. A client that drops out after the others masked
leaves its partners' masks unmatched: slot 0 becomes a random 32-bit number, and the round is
refused. The recovery step here has each survivor remove the mask it shared with the dropped
client (in the protocol the server rebuilds the dropped client's seeds from Shamir shares of
them held by a threshold of survivors; the seeds here come from one shared number, which is
what key agreement replaces).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MOD = 1 << 32
HALF = 1 << 31


def encode(x: torch.Tensor, fraction_bits: int) -> torch.Tensor:
    """Round x·2^f to the nearest integer, as an int64 in [0, 2³²) (two's complement mod 2³²)."""
    return torch.remainder(torch.round(x.double() * (1 << fraction_bits)).to(torch.int64), MOD)


def decode(v: torch.Tensor, fraction_bits: int) -> torch.Tensor:
    """Back to float64: values ≥ 2³¹ are negative (valid while |Σx| < 2^(31−f))."""
    v = torch.remainder(v, MOD)
    return torch.where(v >= HALF, v - MOD, v).double() / (1 << fraction_bits)


def pair_seed(base_seed: int, round_: int, i: int, j: int) -> int:
    """The seed clients i and j share this round (i < j); key agreement gives it in practice."""
    i, j = min(i, j), max(i, j)
    return (((base_seed * 1_000_003 + round_) * 65_537 + i) * 65_537 + j) % (1 << 63)


def pair_mask(seed: int, numel: int) -> torch.Tensor:
    return torch.randint(0, MOD, (numel,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int64)


def mask_for(rank: int, world: int, numel: int, base_seed: int, round_: int,
             pairwise: bool = True) -> torch.Tensor:
    """Σ_{j>rank} m_{rank,j} − Σ_{j<rank} m_{j,rank} mod 2³². `pairwise=False` is the negative
    control: each client draws its own mask from its own seed, and nothing cancels."""
    total = torch.zeros(numel, dtype=torch.int64)
    for j in range(world):
        if j == rank:
            continue
        seed = pair_seed(base_seed, round_, rank, j) if pairwise else pair_seed(base_seed, round_, rank, rank)
        m = pair_mask(seed, numel)
        total += m if (rank < j or not pairwise) else -m
    return torch.remainder(total, MOD)


def payload(update: torch.Tensor, fraction_bits: int) -> torch.Tensor:
    """[1, encode(update)]: slot 0 counts the clients."""
    return torch.cat([torch.ones(1, dtype=torch.int64), encode(update, fraction_bits)])


class CountingAllReduce:
    """`dist.all_reduce` (sum) that counts its calls and the bytes it was handed."""

    def __init__(self):
        self.calls = 0
        self.bytes = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.bytes += t.numel() * t.element_size()
        dist.all_reduce(t)
        return t


def secure_sum(update: torch.Tensor, rank: int, world: int, base_seed: int, round_: int,
               fraction_bits: int, all_reduce, device: torch.device, dropped: int | None = None,
               recover: bool = False, pairwise: bool = True) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The masked sum of every client's `update`: (decoded float64 sum, clients counted in slot 0,
    the raw integer sum mod 2³²). Client `dropped` masks nothing and sends zeros (what a server
    that never heard from it sums); with `recover`, a second all-reduce carries each survivor's
    correction for the mask it shared with the dropped client."""
    n = update.numel() + 1
    if rank == dropped:
        vec = torch.zeros(n, dtype=torch.int64)
    else:
        vec = torch.remainder(payload(update, fraction_bits)
                              + mask_for(rank, world, n, base_seed, round_, pairwise), MOD)
    total = all_reduce(vec.to(device)).cpu()
    if dropped is not None and recover:
        fix = torch.zeros(n, dtype=torch.int64)
        if rank != dropped:
            m = pair_mask(pair_seed(base_seed, round_, rank, dropped), n)
            fix = torch.remainder(-m if rank < dropped else m, MOD)
        total = total + all_reduce(fix.to(device)).cpu()
    total = torch.remainder(total, MOD)
    count = int(decode(total[:1], 0).item())
    return decode(total[1:], fraction_bits), count, total


def plain_sum(update: torch.Tensor, fraction_bits: int, device: torch.device,
              include: bool = True) -> torch.Tensor:
    """The same payloads summed without masks (a diagnostic all-reduce, outside the rounds'
    count): what secure_sum must equal exactly."""
    vec = payload(update, fraction_bits) if include else torch.zeros(update.numel() + 1, dtype=torch.int64)
    t = vec.to(device)
    dist.all_reduce(t)
    return torch.remainder(t.cpu(), MOD)


def clip_and_noise(delta: torch.Tensor, clip: float, noise_multiplier: float, world: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Clip the update's L2 norm to `clip`, then add N(0, (z·C)²/W) per client, so the sum carries
    N(0, (z·C)²): the Gaussian mechanism on a sum whose sensitivity to one client is C."""
    if clip > 0:
        delta = delta * min(1.0, clip / (delta.norm().item() + 1e-12))
    if noise_multiplier > 0:
        std = noise_multiplier * clip / world ** 0.5
        delta = delta + std * torch.randn(delta.shape, generator=generator, dtype=delta.dtype)
    return delta
