"""Back-of-the-envelope calculators for chapter 01: how much memory a model's training state
needs, how many FLOPs training takes, and how long that is on N devices.

All sizes are in bytes; `gb` means decimal gigabytes (1 GB = 1e9 bytes), the unit GPU
datasheets use ("80 GB"). `gib` (1 GiB = 2**30 bytes) is what `nvidia-smi` and
`torch.cuda.memory_allocated` print; 80 GB = 74.5 GiB.

    >>> training_state_bytes(7e9, "mixed_adam") / GB     # 7B model, mixed-precision Adam
    112.0
    >>> training_flops(7e9, 1e12)                          # 7B parameters, 1T tokens
    4.2e+22

The formulas count only the *model state* (weights, gradients, optimizer moments). Activations
come on top and depend on batch size and sequence length (chapter 20); the 6·N·D rule ignores
attention's T² term, which is small while the context is short next to the model width.
"""

from __future__ import annotations

import math

GB = 1e9
"""One decimal gigabyte in bytes (datasheet unit)."""
GIB = 2**30
"""One gibibyte in bytes (what memory tools print)."""
SECONDS_PER_DAY = 86_400

RECIPES: dict[str, dict[str, int]] = {
    "fp32_adam": {"fp32 weights": 4, "fp32 gradients": 4, "Adam m (fp32)": 4, "Adam v (fp32)": 4},
    "mixed_adam": {"bf16 weights": 2, "bf16 gradients": 2, "fp32 master weights": 4,
                   "Adam m (fp32)": 4, "Adam v (fp32)": 4},
    "bf16_inference": {"bf16 weights": 2},
}
"""Bytes per parameter of each part of the state, per recipe:

fp32_adam       plain fp32 training with Adam: 4 + 4 + 4 + 4 = 16 B/param
mixed_adam      bf16 compute copy of weights and gradients, fp32 master weights and moments
                (the ZeRO paper's "2 + 2 + 12"): 2 + 2 + 4 + 4 + 4 = 16 B/param
bf16_inference  bf16 weights only, no gradients or optimizer: 2 B/param
"""


def _positive(name: str, value: float) -> None:
    if not value > 0:  # also rejects NaN
        raise ValueError(f"{name} must be positive, got {value}")


def recipe_breakdown(recipe: str) -> dict[str, int]:
    """Bytes per parameter of each part of the state for `recipe` (a copy of RECIPES[recipe])."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: choose one of {', '.join(RECIPES)}")
    return dict(RECIPES[recipe])


def bytes_per_param(recipe: str) -> int:
    """Total bytes per parameter of `recipe`: 16 for fp32_adam and mixed_adam, 2 for bf16_inference."""
    return sum(recipe_breakdown(recipe).values())


def training_state_bytes(n_params: float, recipe: str = "mixed_adam") -> float:
    """Bytes to hold the model state (weights, gradients, optimizer) of `n_params` parameters."""
    _positive("n_params", n_params)
    return n_params * bytes_per_param(recipe)


def state_breakdown_gb(n_params: float, recipe: str = "mixed_adam") -> dict[str, float]:
    """Decimal GB held by each part of the state: {'bf16 weights': 14.0, ...} for 7e9 params."""
    _positive("n_params", n_params)
    return {part: n_params * b / GB for part, b in recipe_breakdown(recipe).items()}


def to_gb(n_bytes: float) -> float:
    """Bytes to decimal gigabytes (1e9)."""
    return n_bytes / GB


def to_gib(n_bytes: float) -> float:
    """Bytes to gibibytes (2**30)."""
    return n_bytes / GIB


def devices_to_hold(n_params: float, device_memory_gb: float, recipe: str = "mixed_adam") -> int:
    """The fewest devices whose memory together holds the model state, if the state were split
    evenly across them (ZeRO-3 / FSDP) and nothing else used memory: a lower bound, since
    activations, buffers and fragmentation come on top."""
    _positive("device_memory_gb", device_memory_gb)
    return math.ceil(training_state_bytes(n_params, recipe) / (device_memory_gb * GB))


def training_flops(n_params: float, n_tokens: float) -> float:
    """Training FLOPs ≈ 6·N·D: per token, 2·N for the forward pass (a multiply and an add per
    weight) and 4·N for the backward pass (gradients for the inputs and for the weights)."""
    _positive("n_params", n_params)
    _positive("n_tokens", n_tokens)
    return 6 * n_params * n_tokens


def time_to_train_s(n_params: float, n_tokens: float, n_devices: int, peak_flops: float,
                    mfu: float = 1.0) -> float:
    """Seconds to train: 6·N·D / (devices · peak FLOP/s per device · MFU).

    `mfu` (model FLOPs utilisation) is the fraction of peak the job achieves; well-tuned large
    runs reach 0.35–0.55. Pass a measured FLOP/s as `peak_flops` with mfu=1.0 to project at a
    rate you measured."""
    if n_devices < 1:
        raise ValueError(f"n_devices must be at least 1, got {n_devices}")
    _positive("peak_flops", peak_flops)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return training_flops(n_params, n_tokens) / (n_devices * peak_flops * mfu)


def days(seconds: float) -> float:
    """Seconds to days."""
    return seconds / SECONDS_PER_DAY
