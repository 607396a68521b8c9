"""Memory and communication per device under ZeRO: the formulas of Rajbhandari et al. (2020).

Mixed-precision Adam holds, per parameter, 2 bytes of fp16/bf16 weights, 2 bytes of gradients
and K = 12 bytes of optimizer states (fp32 master weights, momentum, variance): (2 + 2 + K)·Ψ.
ZeRO shards those three across the N_d data-parallel ranks, one more at each stage:

    stage 0 (DDP)      2Ψ + 2Ψ + KΨ
    stage 1 (P_os)     2Ψ + 2Ψ + KΨ/N_d
    stage 2 (P_os+g)   2Ψ + (2 + K)Ψ/N_d
    stage 3 (P_os+g+p) (2 + 2 + K)Ψ/N_d

`per_rank_bytes` states the same with any dtypes and with the padding a real flat layout
needs (each rank's slice is S = ⌈Ψ/N⌉ long), which is what the course's code measures;
`paper_volume` gives the bytes moved per step (2Ψ, 2Ψ, 2Ψ, 3Ψ). The second half states both
with this chapter's model and implementation (frozen and tied tensors, padding, what a step
materialises for a moment), which is what train.py checks its counts against.
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


def paper_volume(stage: int) -> int:
    """Communication per rank per step, in units of Ψ parameters' bytes, the paper's
    convention (section 7): DDP all-reduces the gradients (a reduce-scatter and an all-gather,
    2Ψ); stages 1 and 2 reduce-scatter the gradients and all-gather the updated parameters
    (2Ψ); stage 3 all-gathers the parameters before forward and again before backward and
    reduce-scatters the gradients (3Ψ). A ring sends (N−1)/N of this from each rank."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage}")
    return 3 if stage == 3 else 2


# --- the same formulas with this chapter's model and implementation: what train.py checks ---

def sizes(model) -> dict[str, int]:
    """Ψ (trainable numbers), b (bytes each), frozen bytes, trainable tensors, and in numbers
    the largest trainable tensor, the tied matrix and the largest module's own parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"psi": sum(p.numel() for p in trainable), "b": trainable[0].element_size(),
            "frozen": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad),
            "tensors": len(trainable), "largest": max(p.numel() for p in trainable),
            "tied": model.tok_emb.weight.numel(),
            "module": max(sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad)
                          for m in model.modules())}


def expected_rest(stage: int, z: dict, world_size: int) -> list[int]:
    """[params, grads, optim] bytes per rank after a step: the ZeRO formula with this model's
    numbers (Adam's two states of b bytes, K = 2b; one 4-byte step counter per tensor it
    updates, one for the wrappers' flat slice), frozen parameters whole on every rank."""
    b = z["b"]
    f = per_rank_bytes(stage, z["psi"], world_size, b, b, 2 * b)
    counters = z["tensors"] if stage == 0 else 1
    return [int(f["params"]) + z["frozen"], int(f["grads"]), int(f["optim"]) + 4 * counters]


def expected_peak(stage: int, z: dict, world_size: int) -> list[int]:
    """[params, grads, optim, buffers] bytes per rank at their highest during a step (DDP,
    ZeRO-1, ZeRO-2): at rest plus what the stage materialises for a moment. DDP and ZeRO-2: one
    whole fresh gradient (the largest tensor's) before DDP copies it into its bucket, or the
    ZeRO-2 hook reduce-scatters and frees it. ZeRO-1: the gradients stay whole until step(),
    which copies them into a flat buffer (N·S) and receives its slice (S): 2Ψ of gradients
    for a moment, the transient the paper's 2Ψ + 2Ψ + KΨ/N leaves out. ZeRO-2's all-gather sends
    a copy of the slice (S)."""
    params, grads, optim = expected_rest(stage, z, world_size)
    b, S = z["b"], math.ceil(z["psi"] / world_size)
    buffers = 0
    if stage in (0, 2):
        grads += z["largest"] * b
    if stage == 1:
        grads, buffers = grads + S * b, (world_size * S + S) * b  # + the slice's .grad at step()
    if stage == 2:
        buffers = S * b
    return [params, grads, optim, buffers]


def zero3_peak_bounds(z: dict, world_size: int) -> dict[str, list[int]]:
    """ZeRO-3's peak parameter bytes lie between the slice plus the largest module (it must be
    whole to run) and the slice plus the tied matrix (gathered from the head's backward until
    the embedding's) plus two modules (one freed as the next is gathered); its collective
    buffers hold at most N copies of one piece (all_to_all's input). Gathering the whole model
    at once breaks the upper bound."""
    b, S = z["b"], math.ceil(z["psi"] / world_size)
    rest = S * b + z["frozen"]
    return {"params": [rest + z["module"] * b, rest + (z["tied"] + 2 * z["module"]) * b],
            "buffers": [0, world_size * min(S, z["largest"]) * b]}


def _padded(p, world_size: int) -> int:
    """Numbers FSDP2 keeps for a tensor over all ranks: it shards along dim 0 into N chunks of
    ⌈rows/N⌉ rows, padding the last."""
    rows = p.shape[0]
    return math.ceil(rows / world_size) * world_size * (p.numel() // rows)


def fsdp2_traffic(model, world_size: int, gather_bytes: int | None = None,
                  reduce_bytes: int | None = None) -> dict[str, int]:
    """FSDP2's bytes to collectives in a step, by kind: every unit (each block, then the root)
    all-gathered in forward and again in backward except the root (FSDP2 keeps the root's
    parameters after forward), in `gather_bytes` per number (its MixedPrecisionPolicy's
    param_dtype); trainable gradients reduce-scattered in `reduce_bytes` (its reduce_dtype).
    Each tensor is padded to N·⌈rows/N⌉ rows. On one rank FSDP2 calls no collective at all."""
    b = model.tok_emb.weight.element_size()
    gather_bytes, reduce_bytes = gather_bytes or b, reduce_bytes or b
    if world_size == 1:
        return {"all-gather": 0, "reduce-scatter": 0}
    blocks = [p for blk in model.blocks for p in blk.parameters()]
    in_blocks = {id(p) for p in blocks}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    n = lambda ps: sum(_padded(p, world_size) for p in ps)  # noqa: E731
    return {"all-gather": (n(blocks + root) + n(blocks)) * gather_bytes,
            "reduce-scatter": n(p for p in blocks + root if p.requires_grad) * reduce_bytes}


def fsdp2_volume(model, world_size: int) -> int:
    """FSDP2's bytes to collectives in a step, all kinds together (`fsdp2_traffic`)."""
    return sum(fsdp2_traffic(model, world_size).values())


def fsdp2_rest_over_ranks(model, world_size: int, master_bytes: int = 4) -> list[int]:
    """[params, grads, optim] bytes held between steps, summed over the ranks, by FSDP2 whose
    sharded parameters and gradients are in the master dtype (`master_bytes` a number) whatever
    its MixedPrecisionPolicy, padded to N·⌈rows/N⌉ rows; Adam's two states in the same dtype on
    the unpadded rows, plus a 4-byte step per tensor on every rank. With fp32 master weights:
    4 + 4 + 8 bytes per parameter."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    params = sum(_padded(p, world_size) for p in model.parameters()) * master_bytes
    grads = sum(_padded(p, world_size) for p in trainable) * master_bytes
    optim = 2 * sum(p.numel() for p in trainable) * master_bytes + 4 * len(trainable) * world_size
    return [params, grads, optim]


def expected_traffic(name: str, z: dict, world_size: int, gather_bytes: int | None = None,
                     reduce_bytes: int | None = None) -> dict[str, int]:
    """The hand ZeRO-2/3's bytes to collectives in a step by kind, gathering in `gather_bytes`
    per number (the compute dtype) and reduce-scattering in `reduce_bytes` (the master dtype):
    ZeRO-2 all-gathers the flat buffer (N·S) once; ZeRO-3 gathers every tensor before forward
    and again before backward, the tied matrix once more (both its modules gather it)."""
    psi = z["psi"]
    gather_bytes, reduce_bytes = gather_bytes or z["b"], reduce_bytes or z["b"]
    NS = world_size * math.ceil(psi / world_size)
    gathered = {"ZeRO-2": NS, "ZeRO-3": 2 * psi + z["tied"]}[name]
    return {"all-gather": gathered * gather_bytes, "reduce-scatter": psi * reduce_bytes}


def expected_volume(name: str, z: dict, world_size: int) -> int:
    """Bytes handed to collectives in one step, the paper's convention (all-reduce 2Ψ,
    reduce-scatter or all-gather Ψ, broadcast Ψ), with this implementation's details: the flat
    buffer is padded to N·S; ZeRO-3 gathers the tied matrix in both modules that use it;
    ZeroRedundancyOptimizer broadcasts every parameter it was given, the frozen one too."""
    psi, b = z["psi"], z["b"]
    NS = world_size * math.ceil(psi / world_size)
    if name in ("ZeRO-2", "ZeRO-3"):
        return sum(expected_traffic(name, z, world_size).values())
    return {"DDP": 2 * psi * b,                                      # all-reduce of the gradients
            "ZeRO-1": 2 * NS * b,                                    # reduce-scatter + all-gather, flat
            "ZeroRedundancyOptimizer": 3 * psi * b + z["frozen"]}[name]  # all-reduce + broadcast
