"""The checks of chapter 19's layer: the expert-parallel MoE layer against one process holding
every expert (outputs and gradients), and its counts, drops, balancing loss and bytes against the
capacity rule and the lesson's formulas. (The MoE TinyGPT's training checks, which train, are
`train.training_check`.)

`layer_check` takes a recorder (`common.results.RunRecorder`, or anything with the same `check`
and `figure` methods: the tests pass a collector and run it on broken variants). Expected values
come from the one-process layer's routing decisions and the formulas, never from the
expert-parallel run itself.
"""

from __future__ import annotations

import torch

from chapters.ch19_moe.moe import (
    AllToAllTap,
    ExpertParallelMoE,
    MoELayer,
    capacity,
    shard_moe_state,
)
from common.distributed import reduce_number
from common.results import RunRecorder

# float64 parity budget: sums of at most max(d_ff, tokens) ≈ 256 terms of size ≤ M = 8, a few
# layers and steps: 256 · 2⁻⁵³ · 8 · 4 ≈ 9e-13 (the lesson derives it); float32: the same × 2²⁹.
TOLERANCE = {"float64": 1e-11, "float32": 5e-4}
# Parity is always checked in float64: there a rounding difference (~1e-16 relative) is far too
# small to flip a near-tied top-k choice, which in float32 (~6e-8) it can at the 8-GPU sizes, and
# then the two runs route differently and disagree for a legitimate reason. float32 is for timing.
PARITY_DTYPE = "float64"


def kept_per_group(experts: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """(E,) choices an expert keeps in one group, by the rule: first choices of all tokens, then
    second choices, first come first served, at most `cap` each. Counted with a loop, apart
    from `route`'s cumulative sums."""
    taken = [0] * n_experts
    for choice in range(experts.shape[1]):
        for e in experts[:, choice].tolist():
            taken[e] += 1
    return torch.tensor([min(t, cap) for t in taken])


def layer_check(rec: RunRecorder, cfg, info, k: int, broken: str = "none") -> None:
    """The expert-parallel layer against the one-process layer (every expert, one routing group
    per rank) on the same tokens: outputs, gradients, counts, drops, losses and bytes (read where
    torch's all_to_all_single receives them). `broken` names a negative control (the tests check
    that these checks reject it): "wrong_combine_order" (rows returned to the wrong slots),
    "send_dropped" (dropped choices dispatched too, their outputs thrown away: same numbers)."""
    rank, world, dev, dtype = info.rank, info.world_size, info.device, getattr(torch, PARITY_DTYPE)
    E, n, tol, cf = cfg.experts_per_rank * world, cfg.layer_tokens, TOLERANCE[PARITY_DTYPE], cfg.layer_capacity_factor
    torch.manual_seed(cfg.seed + k)
    ref = MoELayer(cfg.d_model, cfg.d_ff, E, k, cf, groups=world).to(dev, dtype)
    ep = ExpertParallelMoE(cfg.d_model, cfg.d_ff, E, k, cf, rank, world).to(dev, dtype)
    ep.load_state_dict(shard_moe_state(ref.state_dict(), rank, world, E))
    ep.wrong_combine_order, ep.send_dropped = broken == "wrong_combine_order", broken == "send_dropped"
    g = torch.Generator().manual_seed(cfg.seed + 10 + k)
    X = torch.randn(world * n, cfg.d_model, generator=g, dtype=torch.float64).to(dev, dtype)
    G = torch.randn(world * n, cfg.d_model, generator=g, dtype=torch.float64).to(dev, dtype)
    X_ref, x = X.clone().requires_grad_(), X[rank * n:(rank + 1) * n].clone().requires_grad_()
    y_ref = ref(X_ref)
    (y_ref * G).sum().add(world * (cfg.aux_weight * ref.aux_loss + cfg.z_weight * ref.z_loss)).backward()
    with AllToAllTap() as tap:
        y = ep(x)
        (y * G[rank * n:(rank + 1) * n]).sum().add(cfg.aux_weight * ep.aux_loss + cfg.z_weight * ep.z_loss).backward()
    torch.distributed.all_reduce(ep.router.weight.grad)  # the router is replicated
    experts = [p.grad for name, p in ref.named_parameters() if name.startswith("experts.")]
    per = len(experts) // E
    mine = experts[rank * cfg.experts_per_rank * per:(rank + 1) * cfg.experts_per_rank * per]
    diffs = {"output": (y - y_ref[rank * n:(rank + 1) * n]).abs().max(),
             "input gradient": (x.grad - X_ref.grad[rank * n:(rank + 1) * n]).abs().max(),
             "router gradient": (ep.router.weight.grad - ref.router.weight.grad).abs().max(),
             "expert gradients": max((p.grad - q).abs().max() for p, q in zip(ep.experts.parameters(), mine))}
    tag = f"top-{k} layer"
    for what, d in diffs.items():
        rec.check(f"{tag}: EP {what} == one process", "parity", reduce_number(d, "max"), 0.0, tolerance=tol)
    # counts and drops by the capacity rule, from the one-process routing decisions
    cap = capacity(n, E, k, cf)
    kept = torch.stack([kept_per_group(r.experts, E, cap) for r in ref.stats.routings])  # (groups, E)
    local = list(range(rank * cfg.experts_per_rank, (rank + 1) * cfg.experts_per_rank))
    rec.check(f"{tag}: tokens each local expert processed = Σ_g min(routed, C)", "count",
              ep.received.tolist(), kept[:, local].sum(0).tolist())
    dropped = world * n * k - int(kept.sum())
    rec.check(f"{tag}: choices dropped over all ranks = kN - Σ kept (C = {cap})", "count",
              reduce_number(int((~ep.stats.routings[0].keep).sum())), dropped)
    p = ref.stats.routings[rank].probs.detach()
    f = torch.bincount(p.argmax(1), minlength=E).to(p.dtype) / n
    rec.check(f"{tag}: balancing loss == E Σ_e f_e P_e", "formula", ep.aux_loss.item(),
              (E * (f * p.mean(0)).sum()).item(), tolerance=tol)
    b, d = x.element_size(), cfg.d_model
    K_r, R_r = int(kept[rank].sum()), int(kept[:, local].sum())
    rec.check(f"{tag}: bytes handed to all_to_all, fwd+bwd = 2(K_r + R_r)·d·b", "formula",
              tap.total("nbytes"), 2 * (K_r + R_r) * d * b)
    off = int(kept[rank].sum() - kept[rank, local].sum()) + int(kept[:, local].sum() - kept[rank, local].sum())
    rec.check(f"{tag}: bytes leaving this rank, fwd+bwd = 2(rows to and from other ranks)·d·b",
              "formula", tap.total("off_rank"), 2 * off * d * b)
    rec.figure(f"{tag}: bytes of the counts exchange (E int64s, fixed by the code)",
               tap.total("nbytes", floating=False), unit="B")
    rec.figure(f"{tag}: capacity C per expert per rank", cap, expected=None, unit="tokens")
    rec.figure(f"{tag}: dropped fraction (all ranks)", round(dropped / (world * n * k), 4))
