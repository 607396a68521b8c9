"""Floating-point formats of mixed precision: their range and precision, FP8 per-tensor
scaling, and the fp16 gradient underflow that loss scaling exists to prevent.

Helper module of chapter 10 (no main guard); `train.py` and the tests import it.
"""

from __future__ import annotations

import torch

# (exponent bits, mantissa bits) of each format; the sign takes the last bit.
FORMATS = {
    "fp32": (torch.float32, 8, 23),
    "bf16": (torch.bfloat16, 8, 7),
    "fp16": (torch.float16, 5, 10),
    "fp8 e5m2": (torch.float8_e5m2, 5, 2),
    "fp8 e4m3": (torch.float8_e4m3fn, 4, 3),
}


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


def fp8_roundtrip_error(x: torch.Tensor, dtype: torch.dtype, per_tensor_scale: bool) -> dict:
    """Cast x to FP8 and back, with or without the per-tensor scale amax → the format's max.

    Returns the mean relative error, the fraction flushed to zero and the scale used. The
    scale is what a float8 recipe stores beside each tensor (and recomputes from its amax).
    """
    scale = torch.finfo(dtype).max / x.abs().max().clamp(min=1e-12) if per_tensor_scale else torch.tensor(1.0)
    back = (x * scale).to(dtype).to(x.dtype) / scale
    rel = ((back - x).abs() / x.abs().clamp(min=1e-30)).mean().item()
    return {"rel_error": rel, "zeros": (back == 0).float().mean().item(), "scale": float(scale)}


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
