"""Ring attention and Ulysses against full `scaled_dot_product_attention`: outputs, gradients of
q, k and v, the bytes each rank sent and the chunk products each rank computed.

Every rank draws the same whole-sequence q, k, v (one seed), computes full attention on them
itself (the reference), runs the distributed method on its own shard, and compares its shard of
the output and of dq, dk, dv with the same shard of the reference's. The worst relative error
over the ranks is the measured value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chapters.ch18_long_context import layouts, ring, ulysses
from common.distributed import gather_numbers, reduce_number
from common.log import log

# (name, method, layout, causal): ring non-causal needs one layout (every block is whole).
METHODS = [
    ("ring", "ring", "contiguous", False),
    ("ring contiguous, causal", "ring", "contiguous", True),
    ("ring zigzag, causal", "ring", "zigzag", True),
    ("Ulysses", "ulysses", "contiguous", False),
    ("Ulysses, causal", "ulysses", "contiguous", True),
]


def parity_tolerance(seq_len: int, head_dim: int, dtype: torch.dtype) -> float:
    """Relative bound: a few (8) unit roundoffs times the longest sums in the computation (T terms
    in a softmax and in P·V, D in a score), as in the γ_n bound of Higham's §3.1."""
    return 8 * (seq_len + head_dim) * torch.finfo(dtype).eps / 2


def make_qkv(cfg, device, dtype):
    """Whole-sequence q, k, v (B, H, T, D) and an output weight w (the loss is Σ out·w), the
    same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 18)
    shape = (cfg.batch_size, cfg.heads, cfg.seq_len, cfg.head_dim)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(4)]


def full_reference(q, k, v, w, causal: bool) -> dict:
    """One process, whole sequence: torch's own attention and autograd."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (out * w).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_method(method: str, layout: str, causal: bool, qkvw, rank: int, world: int,
               broken: str = "none", group=None) -> dict:
    """This rank's shard through ring attention or Ulysses, forward and backward."""
    q, k, v, w = (layouts.shard_sequence(t, rank, world, layout, dim=2) for t in qkvw)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if method == "ring":
        out = ring.ring_attention(q, k, v, layout, causal, group, broken)
    else:
        out = ulysses.ulysses_attention(q, k, v, causal, group, broken)
    (out * w).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def relative_error(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """max |mine − ref| / max |ref|; inf for a wrong shape or a NaN (never hidden)."""
    if mine.shape != ref.shape:
        return float("inf")
    err = ((mine - ref).abs().max() / ref.abs().max()).item()
    return err if err == err else float("inf")


def attention_parity(rec, cfg, info, dtype, broken: dict | None = None) -> dict:
    """Record, for every method, the parity of the output and of dq, dk, dv, the bytes sent and
    the chunk products; `broken` maps a method name to a deliberate bug (negative controls)."""
    broken = broken or {}
    rank, world = info.rank, info.world_size
    qkvw = make_qkv(cfg, info.device, dtype)
    tol = parity_tolerance(cfg.seq_len, cfg.head_dim, dtype)
    counted = {}
    for name, method, layout, causal in METHODS:
        ref = full_reference(*qkvw, causal)
        ring.COUNTER.reset()
        ulysses.COUNTER.reset()
        mine = run_method(method, layout, causal, qkvw, rank, world, broken.get(name, "none"))
        shard = {key: layouts.shard_sequence(t, rank, world, layout, dim=2) for key, t in ref.items()}
        out_err = reduce_number(relative_error(mine["out"], shard["out"]), "max")
        grad_err = reduce_number(max(relative_error(mine[g], shard[g]) for g in ("dq", "dk", "dv")), "max")
        rec.check(f"{name}: output = SDPA", "parity", out_err, tol, compare="<=")
        rec.check(f"{name}: dq, dk, dv = SDPA", "parity", grad_err, tol, compare="<=")
        counter = ring.COUNTER if method == "ring" else ulysses.COUNTER
        counted[name] = {"bytes": dict(counter.bytes), "products": ring.COUNTER.products,
                         "overlapped": {phase: ring.COUNTER.overlapped_hops(phase)
                                        for phase in ("forward", "backward")},
                         "seconds": {phase: ring.COUNTER.seconds_in(phase)
                                     for phase in ("forward", "backward")}}
    record_bytes(rec, counted, cfg, world, qkvw[0].element_size())
    record_products(rec, counted, world)
    hops = counted["ring zigzag, causal"]["overlapped"]
    clock = "CUDA events on the stream" if info.device.type == "cuda" else "host clock"
    for phase, spans in counted["ring zigzag, causal"]["seconds"].items():
        log.info("ring zigzag %s, rank %d (%s): %.3f ms in block products, %.3f ms waiting for "
                 "hops", phase, rank, clock, spans["products"] * 1e3, spans["waits"] * 1e3)
    rec.check("ring forward: hops in flight during a block product", "count",
              reduce_number(hops["forward"], "min"), world - 1)
    # backward: the N − 1 K/V hops, and N − 1 of the N dK/dV hops (the last has nothing to hide behind)
    rec.check("ring backward: hops in flight during a block product", "count",
              reduce_number(hops["backward"], "min"), 2 * (world - 1))
    return counted


def deepspeed_parity(rec, cfg, info, dtype, broken: str = "none") -> dict:
    """DeepSpeed's `DistributedAttention` (the production Ulysses) against full SDPA, causal and
    not; returns this rank's results (for the tests)."""
    from chapters.ch18_long_context.deepspeed_ulysses import deepspeed_ulysses_attention

    rank, world = info.rank, info.world_size
    qkvw = make_qkv(cfg, info.device, dtype)
    tol = parity_tolerance(cfg.seq_len, cfg.head_dim, dtype)
    results = {}
    for causal in (False, True):
        ref = full_reference(*qkvw, causal)
        q, k, v, w = (layouts.shard_sequence(t, rank, world, "contiguous", dim=2) for t in qkvw)
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = deepspeed_ulysses_attention(q, k, v, causal, broken=broken)
        (out * w.reshape(out.shape) if out.numel() == w.numel() else out).sum().backward()
        mine = results[causal] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        err = max(relative_error(mine[key], layouts.shard_sequence(t, rank, world, "contiguous", dim=2))
                  for key, t in ref.items())
        rec.check(f"DeepSpeed Ulysses{', causal' if causal else ''}: output, grads = SDPA", "parity",
                  reduce_number(err, "max"), tol, compare="<=")
    return results


def record_bytes(rec, counted: dict, cfg, world: int, elem: int) -> None:
    """Bytes this rank handed to send ops / sent in all-to-alls, against the formulas."""
    args = (cfg.batch_size, cfg.heads, cfg.seq_len // world, cfg.head_dim, elem, world)
    for name, formula in (("ring zigzag, causal", ring.ring_bytes_per_rank),
                          ("Ulysses, causal", ulysses.ulysses_bytes_per_rank)):
        expected = formula(*args)
        for phase in ("forward", "backward"):
            measured = reduce_number(counted[name]["bytes"][phase], "max")
            low = reduce_number(counted[name]["bytes"][phase], "min")  # every rank the same
            rec.check(f"{name.split(',')[0]}: bytes sent per rank, {phase}", "formula",
                      measured if low == measured else -1, expected[phase])


def record_products(rec, counted: dict, world: int) -> None:
    """Chunk products per rank under a causal mask: contiguous grows with the rank, zigzag is flat."""
    for layout in ("contiguous", "zigzag"):
        per_rank = gather_numbers(counted[f"ring {layout}, causal"]["products"])
        expected = ring.causal_products_per_rank(world, layout)
        rec.check(f"causal chunk products per rank, {layout}", "count", per_rank, expected)
        rec.figure(f"causal work imbalance (max/mean), {layout}",
                   round(max(per_rank) * world / sum(per_rank), 3),
                   round(max(expected) * world / sum(expected), 3))
