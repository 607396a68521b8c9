"""Gradient compressors as small pure functions (chapter 09): compress, decompress, and what
a payload costs. The DDP hooks that send them with real collectives are in hooks.py.

Top-K: values and int32 indices. QSGD: int8 levels and a norm per chunk, with the exact variance
of one quantisation and the bits the paper's Elias coding would take. SignSGD: signs packed
eight to a byte; the majority vote's dtype. PowerSGD: which tensors to factorise, and the
orthonormalisation of P. Every decoder works on one rank's payload or on a stack of all ranks'.
"""

import math

import torch

# --- Top-K sparsification -------------------------------------------------------------

def topk_size(n: int, density: float) -> int:
    """K, fixed per bucket (so every rank sends equally many values)."""
    return max(1, math.ceil(density * n))


def topk_compress(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest magnitude: (values, int32 indices)."""
    idx = v.abs().topk(k, sorted=False).indices
    return v[idx], idx.to(torch.int32)


def topk_decompress(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of the sparse vectors (values, indices) of one rank, or of all ranks stacked
    (world, K), as a dense vector of n.

    One rank at a time, in rank order: a rank's K indices are distinct, so each write is a plain
    scatter and every element is added in the same order on every rank and in every run.
    (`index_add_` of all ranks at once adds repeated indices with atomics on CUDA, in an order
    that varies: the replicas would receive gradients that differ in the last bits.)"""
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    k = values.shape[-1]
    for v, i in zip(values.reshape(-1, k), indices.reshape(-1, k)):
        out[i.long()] += v
    return out


# --- QSGD -----------------------------------------------------------------------------

def qsgd_quantize(v: torch.Tensor, levels: int, chunk: int, generator=None,
                  stochastic: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """QSGD (Alistarh et al., 2017): per chunk of `chunk` coordinates, send the norm and for
    each coordinate a signed level l in [-s, s] with E[l]·norm/s = v_i (stochastic rounding).
    `stochastic=False` rounds to nearest instead: cheaper, and biased."""
    n_chunks = math.ceil(v.numel() / chunk)
    x = torch.nn.functional.pad(v.flatten(), (0, n_chunks * chunk - v.numel())).view(n_chunks, chunk)
    norms = x.norm(dim=1)
    scaled = x.abs() / norms.clamp_min(torch.finfo(x.dtype).tiny).unsqueeze(1) * levels
    if stochastic:
        lower = scaled.floor()
        up = torch.rand(scaled.shape, generator=generator, device=x.device, dtype=x.dtype)
        level = lower + (up < scaled - lower).to(x.dtype)
    else:
        level = scaled.round()
    return (level * x.sign()).to(torch.int8), norms


def qsgd_variance(v: torch.Tensor, levels: int, chunk: int) -> float:
    """E||Q(v) − v||² of one stochastic quantisation, exactly: a coordinate with r = s|x_i|/||x||
    gets level ⌊r⌋ + Bernoulli(p), p = r − ⌊r⌋, so its decoded value has variance
    (||x||/s)²·p(1 − p). Never above Lemma 3.1's min(d/s², √d/s)·||v||², often well below."""
    n_chunks = math.ceil(v.numel() / chunk)
    x = torch.nn.functional.pad(v.flatten().double(), (0, n_chunks * chunk - v.numel())).view(n_chunks, chunk)
    norms = x.norm(dim=1, keepdim=True)
    r = x.abs() / norms.clamp_min(torch.finfo(x.dtype).tiny) * levels
    p = r - r.floor()
    return ((norms / levels) ** 2 * p * (1 - p)).sum().item()


def qsgd_dequantize(q: torch.Tensor, norms: torch.Tensor, levels: int, n: int) -> torch.Tensor:
    """Levels × norm / s, flattened, first n coordinates (works on a stack of ranks too)."""
    v = q.to(norms.dtype) * norms.unsqueeze(-1) / levels
    return v.reshape(*q.shape[:-2], -1)[..., :n]


def elias_omega_bits(n: int) -> int:
    """Length of Elias's omega (recursive) code of a positive integer: 1 -> "0" (1 bit),
    2 -> "100", 4 -> "10 100 0" (6 bits): the binary of n, led by the code of its length."""
    bits = 1
    while n > 1:
        bits += n.bit_length()
        n = n.bit_length() - 1
    return bits


def qsgd_code_bits(q: torch.Tensor) -> int:
    """Bits of QSGD's levels q (chunks × d) in a variable-length code after the paper's Elias
    coding: per chunk 32 for the norm, per non-zero level the Elias code of the gap since the
    previous one, a sign bit and the Elias code of |level|. Zeros cost nothing, so at s = 1
    (most levels 0) this is far below a fixed-length code's log₂3 ≈ 1.58 bits per level."""
    bits = 32 * q.shape[0]
    for row in q.tolist():
        last = -1
        for i, level in enumerate(row):
            if level:
                bits += elias_omega_bits(i - last) + 1 + elias_omega_bits(abs(level))
                last = i
    return bits


# --- SignSGD / 1-bit SGD --------------------------------------------------------------

BIT_WEIGHTS = [128, 64, 32, 16, 8, 4, 2, 1]


def pack_signs(v: torch.Tensor) -> torch.Tensor:
    """One bit per coordinate (1 = non-negative), eight to a uint8."""
    bits = (v.flatten() >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).view(-1, 8)
    weights = torch.tensor(BIT_WEIGHTS, dtype=torch.uint8, device=v.device)
    return (bits * weights).sum(1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """±1 per coordinate from packed bits (works on a stack of ranks too)."""
    weights = torch.tensor(BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) & weights) > 0
    return (bits.to(dtype) * 2 - 1).flatten(-2)[..., :n]


INT8_VOTERS = 127  # the largest sum of ±1 votes that int8 holds
FP16_VOTERS = 2048  # fp16 holds every integer up to 2¹¹ exactly, so every partial sum too


def vote_dtype(world: int) -> torch.dtype:
    """The narrowest dtype whose sums of `world` votes of ±1 are exact, that both NCCL and gloo
    all-reduce: int8 up to 127 ranks (128 votes of +1 wrap to −128), fp16 up to 2048 (every
    partial sum is an integer of magnitude ≤ 2048, which fp16 represents exactly; 2049 does not
    exist in fp16), int32 beyond. Not int16: NCCL has no 16-bit integer type."""
    if world <= INT8_VOTERS:
        return torch.int8
    if world <= FP16_VOTERS:
        return torch.float16
    return torch.int32


# --- PowerSGD -------------------------------------------------------------------------

def powersgd_plan(shapes: list[torch.Size], rank: int, min_rate: float = 2.0) -> list[int]:
    """Per gradient tensor, seen as a (shape[0], rest) matrix: the rank to compress it with,
    or 0 to send it uncompressed (when r·(rows+cols)·min_rate is not below rows·cols,
    the rule of torch's powerSGD_hook)."""
    plan = []
    for s in shapes:
        rows, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
        r = min(rows, cols, rank)
        plan.append(r if (rows + cols) * r * min_rate < rows * cols else 0)
    return plan


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning P (reduced QR)."""
    return torch.linalg.qr(p).Q
