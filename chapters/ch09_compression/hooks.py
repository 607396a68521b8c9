"""Gradient compressors and the DDP communication hooks that send them (chapter 09).

Each compressor is a pair of small pure functions (compress, decompress) and a hook that
sends the compressed payload with a real collective: Top-K values and indices, QSGD int8
levels and norms, packed sign bits and a scale, PowerSGD's low-rank factors P and Q. The hooks
do not count their own bytes: `wire.WireTap` records what reaches the collectives, so the
compression ratio is measured from what was sent, not from what a hook says it sent. Error
feedback keeps, per bucket, what compression dropped and adds it back to the next step's
gradient.

Every rank decodes the same gathered payloads with the same deterministic operations, so the
replicas receive the same averaged gradient bit for bit (no atomics: see `topk_decompress`).

No `from __future__ import annotations` here: DDP inspects a hook's annotations when it is
registered and rejects the strings that import would turn them into.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


@dataclass
class HookState:
    """What a hook keeps between steps: its settings and residuals."""

    density: float = 0.01
    """Top-K: fraction of each bucket's coordinates sent."""
    levels: int = 16
    """QSGD: quantisation levels s (at most 127 so a signed level fits in int8)."""
    chunk: int = 256
    """QSGD: coordinates that share one norm."""
    rank: int = 1
    """PowerSGD: rank of the approximation."""
    error_feedback: bool = True
    """Add back what the previous compression dropped."""
    seed: int = 0
    """Seeds QSGD's rounding (with the rank) and PowerSGD's shared initial Q."""
    residuals: dict = field(default_factory=dict)
    warm_q: dict = field(default_factory=dict)
    generator: torch.Generator | None = None


def completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that already holds its value: our hooks communicate synchronously."""
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def all_gather_payload(tensor: torch.Tensor) -> torch.Tensor:
    """all_gather this rank's payload into (world_size, *shape), rank 0 first.
    gloo cannot gather tensors of unequal sizes: every payload here has a fixed size."""
    out = tensor.new_empty(dist.get_world_size() * tensor.numel())
    # common.distributed.all_gather_single names the same function (all_gather_into_tensor
    # before torch 2.14); looked up on `dist` at call time so that wire.WireTap sees the call.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor.contiguous().flatten())  # the ranks' payloads, concatenated
    return out.view(-1, *tensor.shape)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place."""
    dist.all_reduce(tensor)
    return tensor


def add_residual(state: HookState, key, grad: torch.Tensor) -> torch.Tensor:
    """Error feedback, first half: the vector to compress is gradient + last residual."""
    if state.error_feedback and key in state.residuals:
        return grad + state.residuals[key]
    return grad.clone()


def keep_residual(state: HookState, key, corrected: torch.Tensor, sent: torch.Tensor) -> None:
    """Error feedback, second half: remember what this rank's compression dropped."""
    if state.error_feedback:
        state.residuals[key] = corrected - sent


def dense_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The uncompressed baseline: all-reduce the fp32 bucket and average."""
    buf = bucket.buffer()
    all_reduce_sum(buf).div_(dist.get_world_size())
    return completed(buf)


def fp16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `fp16_compress_hook`: the bucket cast to fp16 and divided by the world size
    (before the sum, so that it cannot overflow), all-reduced, cast back."""
    return default_hooks.fp16_compress_hook(None, bucket)


def bf16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` (bf16 keeps fp32's exponent range, with 8 bits of precision)."""
    return default_hooks.bf16_compress_hook(None, bucket)


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


def topk_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-K with error feedback: all_gather K values and K indices from every rank."""
    buf = bucket.buffer()
    n = buf.numel()
    corrected = add_residual(state, bucket.index(), buf)
    values, indices = topk_compress(corrected, topk_size(n, state.density))
    keep_residual(state, bucket.index(), corrected, topk_decompress(values, indices, n))
    all_values = all_gather_payload(values)
    all_indices = all_gather_payload(indices)
    buf.copy_(topk_decompress(all_values, all_indices, n) / dist.get_world_size())
    return completed(buf)


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


def qsgd_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """QSGD: all_gather int8 levels and fp32 norms. Unbiased, so no error feedback needed."""
    buf = bucket.buffer()
    if state.generator is None:
        state.generator = torch.Generator(buf.device).manual_seed(state.seed + dist.get_rank())
    q, norms = qsgd_quantize(buf, state.levels, state.chunk, state.generator)
    all_q, all_norms = all_gather_payload(q), all_gather_payload(norms)
    buf.copy_(qsgd_dequantize(all_q, all_norms, state.levels, buf.numel()).mean(0))
    return completed(buf)


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


def signsgd_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Scaled sign with error feedback (EF-SignSGD, Karimireddy et al., 2019; 1-bit SGD,
    Seide et al., 2014): send one bit per coordinate and, per gradient tensor, one scale
    ||p||₁/numel; decode scale·sign. Per-tensor scales: layers' gradients differ in size."""
    buf = bucket.buffer()
    n, sizes = buf.numel(), [g.numel() for g in bucket.gradients()]
    corrected = add_residual(state, bucket.index(), buf)
    scales = torch.stack([part.abs().mean() for part in corrected.split(sizes)])
    packed = pack_signs(corrected)
    per_coord = scales.repeat_interleave(torch.tensor(sizes, device=buf.device), dim=-1)
    keep_residual(state, bucket.index(), corrected, per_coord * unpack_signs(packed, n, buf.dtype))
    all_packed, all_scales = all_gather_payload(packed), all_gather_payload(scales)
    per_coord = all_scales.repeat_interleave(torch.tensor(sizes, device=buf.device), dim=-1)
    buf.copy_((per_coord * unpack_signs(all_packed, n, buf.dtype)).mean(0))
    return completed(buf)


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


def powersgd_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD (Vogels et al., 2019), one power iteration per step with warm start and error
    feedback: M ≈ P̂ Qᵀ with P = M Q summed over ranks, P̂ orthonormal, Q = mean Mᵀ P̂."""
    grads = bucket.gradients()  # views into bucket.buffer(): writing them writes the bucket
    world = dist.get_world_size()
    plan = powersgd_plan([g.shape for g in grads], state.rank)
    plain = [g for g, r in zip(grads, plan) if r == 0]
    if plain:
        flat = all_reduce_sum(torch.cat([g.flatten() for g in plain])) / world
        for g, part in zip(plain, flat.split([g.numel() for g in plain])):
            g.copy_(part.view_as(g))
    keys = [(bucket.index(), i) for i, r in enumerate(plan) if r]
    mats = [add_residual(state, k, grads[k[1]].view(grads[k[1]].shape[0], -1)) for k in keys]
    for k, m in zip(keys, mats):
        if k not in state.warm_q or state.warm_q[k].shape[0] != m.shape[1]:
            g = torch.Generator(m.device).manual_seed(state.seed)  # the same Q on every rank
            state.warm_q[k] = torch.randn(m.shape[1], plan[k[1]], generator=g,
                                          device=m.device, dtype=m.dtype)
    if not keys:
        return completed(bucket.buffer())
    ps = [m @ state.warm_q[k] for k, m in zip(keys, mats)]
    ps = all_reduce_sum(torch.cat([p.flatten() for p in ps])).split([p.numel() for p in ps])
    ps = [orthonormalise(p.view(m.shape[0], -1)) for p, m in zip(ps, mats)]
    qs = [m.T @ p for m, p in zip(mats, ps)]
    for k, m, p, q in zip(keys, mats, ps, qs):
        keep_residual(state, k, m, p @ q.T)  # this rank's own error, before Q is averaged
    flat_q = all_reduce_sum(torch.cat([q.flatten() for q in qs])) / world
    for k, m, p, q in zip(keys, mats, ps, flat_q.split([q.numel() for q in qs])):
        state.warm_q[k] = q.view(m.shape[1], -1)
        grads[k[1]].copy_((p @ state.warm_q[k].T).view_as(grads[k[1]]))
    return completed(bucket.buffer())


# --- Bytes each method should send per step (the formulas the lesson states) ----------

def expected_bytes(method: str, shapes: list[torch.Size], state: HookState, elem: int = 4) -> int:
    """Bytes one rank hands to collectives per step, for one bucket holding `shapes`."""
    n = sum(math.prod(s) for s in shapes)
    if method == "dense":
        return elem * n
    if method in ("fp16", "bf16"):
        return 2 * n
    if method.startswith("topk"):
        return topk_size(n, state.density) * (elem + 4)  # value + int32 index
    if method == "qsgd":
        chunks = math.ceil(n / state.chunk)
        return chunks * state.chunk * 1 + chunks * elem  # int8 levels (padded) + norms
    if method.startswith("signsgd"):
        return math.ceil(n / 8) + elem * len(shapes)  # packed bits + a scale per tensor
    if method.startswith("powersgd"):
        total = 0
        for s, r in zip(shapes, powersgd_plan(shapes, state.rank)):
            rows, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
            total += elem * (r * (rows + cols) if r else rows * cols)
        return total
    raise ValueError(f"unknown method {method!r}")


GATHERED = ("topk", "qsgd", "signsgd")  # methods whose payloads are all-gathered, not reduced


def received_bytes(method: str, shapes: list[torch.Size], state: HookState, world: int) -> float:
    """Bytes one rank receives per step over a ring: an all-reduce of B bytes brings in
    2(W−1)/W·B (reduce-scatter, then all-gather), an all-gather of B-byte payloads (W−1)·B.
    Sparse and quantised payloads cannot be summed on the way, so they are gathered: what a
    rank receives grows with W, while an all-reduce's stays below 2B."""
    sent = expected_bytes(method, shapes, state)
    if method.startswith(GATHERED):
        return (world - 1) * sent
    return 2 * (world - 1) / world * sent


def break_even_world(method: str, shapes: list[torch.Size], state: HookState,
                     max_world: int = 1 << 20) -> int | None:
    """The smallest world size at which `method` receives at least as many bytes per rank as
    the dense all-reduce does (None if it never does, as for the all-reduced methods)."""
    for world in range(2, max_world + 1):
        if received_bytes(method, shapes, state, world) >= received_bytes("dense", shapes, state, world):
            return world
        if not method.startswith(GATHERED):
            return None  # the ratio of two all-reduces does not depend on W
    return None
