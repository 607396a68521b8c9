"""Memory per device under ZeRO: the formulas of Rajbhandari et al. (2020), table 1.

Mixed-precision Adam holds, per parameter, 2 bytes of fp16/bf16 weights, 2 bytes of gradients
and K = 12 bytes of optimizer states (fp32 master weights, momentum, variance): (2 + 2 + K)·Ψ.
ZeRO shards those three across the N_d data-parallel ranks, one more at each stage:

    stage 0 (DDP)      2Ψ + 2Ψ + KΨ
    stage 1 (P_os)     2Ψ + 2Ψ + KΨ/N_d
    stage 2 (P_os+g)   2Ψ + (2 + K)Ψ/N_d
    stage 3 (P_os+g+p) (2 + 2 + K)Ψ/N_d

`per_rank_bytes` states the same with any dtypes and with the padding a real flat layout
needs (each rank's slice is S = ⌈Ψ/N⌉ long), which is what the course's code measures.
"""

from __future__ import annotations

import math

STAGES = ("baseline", "P_os", "P_os+g", "P_os+g+p")


def per_rank_bytes(stage: int, psi: int, world_size: int, param_bytes: float = 2,
                   grad_bytes: float = 2, state_bytes: float = 12) -> dict[str, float]:
    """Bytes one rank holds for parameters, gradients and optimizer states at ZeRO `stage`.
    Stages 1 and 2 keep the parameters whole in a flat buffer padded to N·S."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage}")
    S = math.ceil(psi / world_size)
    params = {0: psi, 1: world_size * S, 2: world_size * S, 3: S}[stage] * param_bytes
    grads = (psi if stage <= 1 else S) * grad_bytes
    optim = (psi if stage == 0 else S) * state_bytes
    return {"params": params, "grads": grads, "optim": optim,
            "total": params + grads + optim}


def paper_table(psi: float = 7.5e9, n_d: int = 64, k: int = 12) -> dict[str, float]:
    """Per-device memory in GB (10⁹ bytes) at each stage: the paper's table 1 row."""
    return {name: per_rank_bytes(s, int(psi), n_d, 2, 2, k)["total"] / 1e9
            for s, name in enumerate(STAGES)}


def max_params_that_fit(device_gb: float, n_d: int, stage: int, k: int = 12) -> float:
    """The largest Ψ whose model states fit in `device_gb` (activations not counted)."""
    per_param = per_rank_bytes(stage, 10**12, n_d, 2, 2, k)["total"] / 10**12
    return device_gb * 1e9 / per_param


def zeropp_volume(stage3_psi: float, nodes_gpus: int = 8) -> dict[str, float]:
    """Communication per rank per step in units of Ψ parameters' bytes (fp16), ZeRO-3 vs
    ZeRO++: ZeRO-3 all-gathers weights twice (forward, backward) and reduce-scatters gradients
    once, 3Ψ; qwZ halves the forward all-gather (int8), hpZ keeps a secondary copy of the
    weights inside each node so the backward all-gather never leaves it, and qgZ sends int4
    gradients: 0.5Ψ + 0 + 0.25Ψ = 0.75Ψ across nodes (Wang et al., 2023)."""
    return {"ZeRO-3 cross-node": 3 * stage3_psi, "ZeRO++ cross-node": 0.75 * stage3_psi}
