"""Seeding and RNG state capture (for reproducible runs and bit-exact resume)."""

from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators (CPU and every CUDA device)."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def capture_rng_state() -> dict:
    """Every generator's state as tensors and plain lists, so `torch.load(weights_only=True)`
    accepts it (numpy's own state object is refused there)."""
    version, internal, gauss = random.getstate()
    state = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                      float(cached)]
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
