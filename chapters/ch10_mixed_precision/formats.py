"""Floating-point formats of mixed precision: their range and precision, FP8 per-tensor
scaling, the fp16 gradient underflow that loss scaling exists to prevent, the updates a
low-precision weight cannot take (why master weights), and the error of a low-precision sum.

Helper module of chapter 10 (no main guard); `train.py`, `checks.py` and the tests import it.
"""

from __future__ import annotations

import math

import torch

# (exponent bits, mantissa bits) of each format; the sign takes the last bit.
FORMATS = {
    "fp32": (torch.float32, 8, 23),
    "bf16": (torch.bfloat16, 8, 7),
    "fp16": (torch.float16, 5, 10),
    "fp8 e5m2": (torch.float8_e5m2, 5, 2),
    "fp8 e4m3": (torch.float8_e4m3fn, 4, 3),
}
# The compute dtypes a run trains in, by name (fp32: no autocast, no low dtype).
LOW = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def format_formula(exp_bits: int, man_bits: int, ieee: bool = True) -> dict:
    """max, eps and smallest normal from the bit layout alone.

    IEEE-like formats reserve the top exponent for inf/NaN: max = (2 - 2^-m) · 2^bias with
    bias = 2^(e-1) - 1. e4m3fn ("fn": finite, no inf) keeps the top exponent for numbers and
    only its all-ones mantissa for NaN: max = (2 - 2^(1-m)) · 2^(bias+1) = 448.
    """
    bias = 2 ** (exp_bits - 1) - 1
    top = (2 - 2.0 ** -man_bits) * 2.0 ** bias if ieee else (2 - 2.0 ** (1 - man_bits)) * 2.0 ** (bias + 1)
    return {"max": top, "eps": 2.0 ** -man_bits, "tiny": 2.0 ** (1 - bias)}


def format_table() -> list[dict]:
    """Per format: torch.finfo's max/eps/tiny beside the formula's."""
    rows = []
    for name, (dtype, e, m) in FORMATS.items():
        fi = torch.finfo(dtype)
        rows.append({"name": name, "bits": fi.bits, "exp_bits": e, "man_bits": m,
                     "max": fi.max, "eps": fi.eps, "tiny": fi.tiny,
                     "formula": format_formula(e, m, ieee=dtype != torch.float8_e4m3fn)})
    return rows


MAN_BITS = {dtype: m for dtype, _, m in FORMATS.values()}


def mean_rounding_error(dtype: torch.dtype) -> float:
    """Expected relative error of rounding to nearest in `dtype` for values whose significands
    are log-uniform (Benford; Gaussian data is close): with x = f·2^k, f in [1, 2), the error is
    uniform on ±ulp/2, ulp = eps·2^k, so E|δ| = eps·2^k/4, and E[1/f] = 1/(2 ln 2), so
    E|δ|/|x| = (eps/4)·1/(2 ln 2) = eps/(8 ln 2)."""
    return torch.finfo(dtype).eps / (8 * math.log(2))


def fp8_roundtrip_error(x: torch.Tensor, dtype: torch.dtype, per_tensor_scale: bool) -> dict:
    """Cast x to FP8 and back, with or without the per-tensor scale amax → the format's max.

    Rounding to nearest keeps every element within a relative error u = eps/2 **only if** its
    scaled value is a normal number of the format: |x|·scale ≥ smallest normal, i.e.
    amax/|x| ≤ max/smallest normal (448/2⁻⁶ = 28672 for e4m3, 57344/2⁻¹⁴ ≈ 9.4e8 for e5m2).
    Below that the element is a subnormal (fewer significant bits) or flushed to zero.

    Returns the mean relative error, the largest relative error among the elements inside that
    range and among those outside it (nan when there are none), the fraction inside, the
    fraction flushed to zero and the scale used (what a float8 recipe stores beside each
    tensor and recomputes from its amax).
    """
    fi = torch.finfo(dtype)
    scale = fi.max / x.abs().max().clamp(min=1e-12) if per_tensor_scale else torch.tensor(1.0)
    back = (x * scale).to(dtype).to(x.dtype) / scale
    rel = (back - x).abs() / x.abs().clamp(min=1e-30)
    inside = ((x * scale).abs() >= fi.tiny) & ((x * scale).abs() <= fi.max)
    return {"rel_error": rel.mean().item(),
            "max_rel_in_range": rel[inside].max().item() if inside.any() else float("nan"),
            "max_rel_out_of_range": rel[~inside].max().item() if (~inside).any() else float("nan"),
            "in_range": inside.float().mean().item(),
            "zeros": (back == 0).float().mean().item(), "scale": float(scale)}


def underflow_grads(loss_scale: float, device: torch.device, half: bool = True) -> torch.Tensor:
    """The weight gradient of a constructed fp16 case: activations and their gradients live in
    fp16 (as under fp16 autocast), the loss is tiny, so dL/dy ≈ 1e-8 < fp16's smallest
    subnormal 6e-8 and rounds to zero unless the loss is multiplied by `loss_scale` first.

    The matmul is run on fp16 tensors by casting, the same arithmetic autocast runs on a GPU,
    so the demo does not depend on the CPU's autocast kernels. Returns the unscaled fp32 grad.
    """
    low = torch.float16 if half else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g).to(device)
    w = (torch.randn(16, 8, generator=g) * 0.1).to(device).requires_grad_()  # fp32 master weight
    y = x.to(low) @ w.to(low)                                  # forward in the low dtype
    loss = 1e-8 * (y.float() ** 2).sum() / 2                   # a loss whose gradient is tiny
    (loss * loss_scale).backward()                             # dL/dy is cast back to fp16 here
    return w.grad / loss_scale                                 # unscale in fp32


def half_spacing(w: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Half the spacing of w's format next to w, in the update's direction (float64): with
    |w| = m·2^e (m in [0.5, 1)) the spacing above is 2^(e-1-mantissa bits), and it halves below
    an exact power of two. For bf16 (7 mantissa bits) it lies between 2⁻⁹ and 2⁻⁸ of |w|."""
    wf, uf = w.double(), update.double()
    m, e = torch.frexp(wf)
    spacing = torch.ldexp(torch.ones_like(wf), e - 1 - MAN_BITS[w.dtype])
    shrinking = (m.abs() == 0.5) & (torch.sign(uf) == -torch.sign(wf))
    return torch.where(shrinking, spacing / 2, spacing) / 2


def rounds_back(w: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Which elements of `w + update` round back to `w` in w's dtype (the update is lost).

    Rounding to nearest loses an update smaller than `half_spacing`: in bf16, updates under
    0.2–0.4 % of a weight vanish. An update of exactly half the spacing is a tie, which rounds to
    the neighbour with an even last significand bit: it is lost when w's last bit is even
    (always the case for a power of two). Zero weights and zero updates are never counted as
    lost (normal w assumed). `update` is the exact update, in float64 (`exact_update`).
    """
    wf, uf = w.double(), update.double()
    half = half_spacing(w, update)
    m, _ = torch.frexp(wf)
    significand = torch.ldexp(m.abs(), torch.full_like(m, MAN_BITS[w.dtype] + 1, dtype=torch.int32))
    even = torch.remainder(significand, 2) == 0  # the significand is an integer here
    below = (uf.abs() < half) | ((uf.abs() == half) & even)
    return below & (uf != 0) & (wf != 0)


UNDECIDED = 2.0**-7  # relative band around the threshold where the kernel's rounding decides


def near_threshold(w: torch.Tensor, update: torch.Tensor, band: float = UNDECIDED) -> torch.Tensor:
    """Updates within a relative `band` of `half_spacing`, where the rule cannot tell in advance:
    the outcome there depends on how the optimizer's kernel rounds lr·g. torch's CPU kernel
    rounds lr to the weight's dtype (0.02 becomes 0.0200195 for bf16 weights, 2⁻⁹ relative),
    a CUDA kernel keeps it in fp32; a fused multiply-add adds the exact product, an unfused one
    its rounding; and ties go to even. Outside the band none of this changes the outcome."""
    ratio = update.double().abs() / half_spacing(w, update)
    return (ratio - 1).abs() <= band


def exact_update(lr: float, grad: torch.Tensor) -> torch.Tensor:
    """SGD's update −lr·g in float64, lr as an fp32 number (the product is exact there)."""
    return torch.tensor(-lr, dtype=torch.float32).double() * grad.double()


def low_precision_sum_error(world: int, dtype: torch.dtype = torch.bfloat16, n: int = 4096,
                            seed: int = 0) -> float:
    """Relative error (norm) of summing `world` gradient-like vectors one after the other in
    `dtype`, as a ring reduction does, against the exact sum: each addition rounds, so the
    error grows with the number of ranks (worst case (W-1)·u, typically ~√W·u)."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(world, n, generator=g, dtype=torch.float64)
    exact = parts.sum(0)
    acc = parts[0].to(dtype)
    for part in parts[1:]:
        acc = acc + part.to(dtype)
    return ((acc.double() - exact).norm() / exact.norm()).item()
