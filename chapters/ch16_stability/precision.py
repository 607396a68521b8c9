"""Where bf16 hurts: long sums and tiny updates, measured one rounding at a time.

bf16 keeps fp32's 8 exponent bits (so it does not overflow where fp32 does not) but only 8
significand bits, so its unit roundoff is u = 2⁻⁸ ≈ 0.0039. A running sum in bf16 stops growing
once each new term is below half a unit in the last place of the sum; so does a weight that
receives updates smaller than its half-ulp. The fixes (an fp32 accumulator, Kahan's compensated
sum, pairwise summation, fp32 master weights) are written out here and measured against the
textbook error bounds (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 4).

Sequential sums are emulated in Python with exact rounding helpers (`round_bf16`, `round_fp32`)
because torch's own reductions use wider accumulators and tree orders; a test checks the
emulation against torch's bf16 arithmetic.
"""

from __future__ import annotations

import math
import struct

import torch

from common.log import progress

U_BF16 = 2.0**-8   # unit roundoff: half the gap between 1 and the next bf16
U_FP32 = 2.0**-24
U_FP16 = 2.0**-11


def round_fp32(x: float) -> float:
    """Round a Python float to the nearest fp32 (what one fp32 operation does to its exact result)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def round_bf16(x: float) -> float:
    """Round to bf16 as torch's CPU bf16 arithmetic does: compute in fp32, then round the top 16
    bits to nearest, ties to even."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if (bits >> 23) & 0xFF == 0xFF:  # inf / nan pass through
        return round_fp32(x)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def half_ulp_bf16(w: float) -> float:
    """Half the gap between |w| and the next bf16 above it: smaller updates round away."""
    return 2.0 ** (math.floor(math.log2(abs(w))) - 8)


def naive_sum(values: list[float], rnd=round_bf16) -> float:
    """Left-to-right running sum, every addition rounded by `rnd` (bf16 by default)."""
    s = 0.0
    for v in values:
        s = rnd(s + v)
    return s


def kahan_sum(values: list[float], rnd=round_bf16, compensate: bool = True) -> float:
    """Kahan's compensated sum with every operation rounded by `rnd`: `c` carries the low-order
    bits each addition lost and feeds them back into the next term. compensate=False drops
    the carry (the negative control: it is the naive sum again)."""
    s = c = 0.0
    for v in values:
        y = rnd(v - c) if compensate else v
        t = rnd(s + y)
        c = rnd(rnd(t - s) - y) if compensate else 0.0
        s = t
    return s


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Tree (pairwise) sum in x's dtype: add neighbours, halve, repeat; a term meets only
    ⌈log₂ n⌉ roundings instead of up to n − 1."""
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        x = x[0::2] + x[1::2]
    return x.reshape(())


def gamma(k: int, u: float) -> float:
    """Higham's γ_k = k·u / (1 − k·u): the bound on the relative error of k roundings in a row
    (Lemma 3.1). Defined for k·u < 1; beyond that no bound exists (inf)."""
    return k * u / (1 - k * u) if k * u < 1 else math.inf


# One bf16 operation in torch (and in `round_bf16`) rounds the exact result to fp32, then to bf16:
# twice, so its relative error is at most u_bf16 + u_fp32 + u_bf16·u_fp32, a hair above u_bf16.
U_BF16_OP = U_BF16 + U_FP32 + U_BF16 * U_FP32


def error_bounds(n: int) -> dict[str, float]:
    """Worst-case bounds on |ŝ − s| / Σ|xᵢ| for n terms (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., §4.2-4.3): recursive summation γ_{n−1}, pairwise summation
    γ_{⌈log₂ n⌉}, compensated (Kahan) summation 2u + O(n·u²). inf where no bound exists.
    A bound ≥ 1 says nothing here (a sum of positive terms that stagnates is off by less than
    100 %): naive bf16 (γ undefined: (n−1)·u ≥ 1) and Kahan, whose n·u² term is 1.5 at n = 10⁵
    (Knuth and Higham leave its constant unstated; n·u² is its size)."""
    g32 = gamma(n - 1, U_FP32)
    return {
        "bf16 naive": gamma(n - 1, U_BF16_OP),
        "bf16 inputs, fp32 accumulator": g32 + U_BF16_OP * (1 + g32),  # then one rounding to bf16
        "bf16 Kahan": 2 * U_BF16_OP + n * U_BF16_OP**2,
        "bf16 pairwise": gamma(math.ceil(math.log2(n)), U_BF16_OP),
        "fp32 naive": g32,
    }


def bf16_inputs_fp32_accumulator(values: list[float]) -> float:
    """bf16 terms summed in an fp32 accumulator, the result rounded to bf16 once (what a GPU
    matmul or `tensor.sum(dtype=torch.float32)` then `.bfloat16()` does)."""
    return round_bf16(naive_sum(values, round_fp32))


# name -> (how it sums, which inputs: the bf16-rounded terms or the fp32 ones)
METHODS = {
    "bf16 naive": (naive_sum, "bf16"),
    "bf16 inputs, fp32 accumulator": (bf16_inputs_fp32_accumulator, "bf16"),
    "bf16 Kahan": (kahan_sum, "bf16"),
    "bf16 pairwise": (lambda v: pairwise_sum(torch.tensor(v, dtype=torch.bfloat16)).item(), "bf16"),
    "fp32 naive": (lambda v: naive_sum(v, round_fp32), "fp32"),
}


def accumulation_errors(n: int = 100_000, seed: int = 0, low: float = 0.0, high: float = 1e-3,
                        methods: dict | None = None, show_progress: bool = False) -> dict[str, dict[str, float]]:
    """Sum n uniform values in [low, high) five ways; the relative error |ŝ − s| / Σ|xᵢ| of each
    against the exact (math.fsum) sum of the same inputs, beside its worst-case bound.
    `methods` replaces some of `METHODS` (the tests pass broken ones). Summing element by element
    in Python takes seconds: `show_progress` reports each method as it finishes."""
    g = torch.Generator().manual_seed(seed)
    x32 = low + torch.rand(n, generator=g, dtype=torch.float32) * (high - low)
    inputs = {"bf16": x32.to(torch.bfloat16).float().tolist(), "fp32": x32.tolist()}
    bounds = error_bounds(n)
    out = {}
    todo = {**METHODS, **(methods or {})}
    for name, (fn, kind) in progress(todo.items(), len(todo), f"summing {n} numbers, methods",
                                     show_progress, 1):
        v = inputs[kind]
        s, exact, mass = fn(v), math.fsum(v), math.fsum(abs(x) for x in v)
        out[name] = {"sum": s, "exact": exact, "rel_error": abs(s - exact) / mass, "bound": bounds[name]}
    out["bf16 naive"]["stagnation"] = stagnation_point(max(inputs["bf16"]))
    return out


def stagnation_point(max_term: float) -> float:
    """Where a bf16 running sum of terms no larger than `max_term` stops growing: in the binade
    [2ᵉ, 2ᵉ⁺¹) half an ulp is 2ᵉ⁻⁸, so once 2ᵉ ≥ 2⁸·max_term every term rounds away. For a
    constant power of two v the sum sticks at exactly 2⁸·v (s + v is a tie, kept at the even s)."""
    return 2.0 ** math.ceil(math.log2(2.0**8 * max_term))


def kahan_stagnation_point(v: float) -> float:
    """Where Kahan's bf16 sum of a constant power of two v stops: 2¹⁶·v, the square of the naive
    sum's reach. The carry y = v − c grows by v per lost term until it reaches half an ulp of the
    sum; at s = 2¹⁶·v half an ulp is 2⁸·v, and y = 2⁸·v + v is no longer a bf16 number: it rounds
    to the tie 2⁸·v, which rounds away. This is the O(n·u²) term of Kahan's bound at work."""
    return 2.0**16 * v


def running_sums(v: float, n: int) -> tuple[list[float], list[float]]:
    """The running sum of n copies of v, in bf16 and in fp32, after every term (for plots)."""
    s16 = s32 = 0.0
    a16, a32 = [], []
    for _ in range(n):
        s16, s32 = round_bf16(s16 + v), round_fp32(s32 + v)
        a16.append(s16)
        a32.append(s32)
    return a16, a32


def master_weight_demo(w0: float = 1.0, update: float = 1e-3, steps: int = 1000) -> dict:
    """Add the same small update `steps` times to a bf16 weight and to an fp32 master copy
    (whose bf16 image is what the forward pass would use). An update below half_ulp_bf16(w0)
    vanishes on the bf16 weight; the fp32 master accumulates it."""
    w16 = torch.tensor(w0, dtype=torch.bfloat16)
    master = torch.tensor(w0, dtype=torch.float32)
    delta = torch.tensor(update, dtype=torch.float32)
    for _ in range(steps):
        w16 = w16 + delta.to(torch.bfloat16)
        master = master + delta
    return {"bf16 weight": w16.item(), "fp32 master": master.item(),
            "bf16 copy of master": master.to(torch.bfloat16).item(),
            "expected": w0 + steps * update, "half_ulp": half_ulp_bf16(w0)}


def fp16_range_demo(grad: float = 1e-8, scale: float = 2.0**16, big: float = 7e4) -> dict:
    """Mixed-precision overflow and underflow: fp16 flushes a 1e-8 gradient to zero unless the
    loss is scaled first, and overflows above 65504, where bf16 (fp32's exponent range) does not."""
    g = torch.tensor(grad)
    return {"fp16 grad": g.half().item(), "fp16 scaled grad / scale": (g * scale).half().float().item() / scale,
            "fp16 of big": torch.tensor(big).half().item(), "bf16 of big": torch.tensor(big).bfloat16().item(),
            "fp16 max": torch.finfo(torch.float16).max}
