"""Gradient compressors and the DDP communication hooks that send them (chapter 09).

Each compressor is a pair of small pure functions (compress, decompress) and a hook that
sends the compressed payload with a real collective: Top-K values and indices, QSGD int8
levels and norms, packed sign bits and a scale, PowerSGD's low-rank factors P and Q. The hooks
do not count their own bytes: `wire.WireTap` records what reaches the collectives, so the
compression ratio is measured from what was sent, not from what a hook says it sent. Error
feedback keeps, per parameter, what compression dropped and adds it back to the next step's
gradient: never per bucket or per position in the flat bucket, because DDP rebuilds its buckets
after step 0 in another order (`keyed_gradients`).

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
    """Error feedback: parameter -> what compression has not sent yet (`keyed_gradients`)."""
    warm_q: dict = field(default_factory=dict)
    """PowerSGD: parameter -> last step's Q, the warm start of this step's power iteration."""
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


def keyed_gradients(bucket: dist.GradBucket) -> tuple[list, list[torch.Tensor]]:
    """The bucket's gradients (views into its flat buffer, in its order) and the key each one's
    state is kept under: its parameter. Not `bucket.index()` and a position in the flat bucket:
    DDP rebuilds its buckets after step 0 in the order the gradients became ready (this MLP's
    layout `[0.w, 0.b, 2.w, 2.b, 4.w, 4.b]` at step 0 is `[4.b, 4.w, 2.b, 2.w, 0.b, 0.w]` from
    step 1), so state kept by position would land on another parameter's coordinates."""
    return bucket.parameters(), bucket.gradients()


def add_residual(state: HookState, keys: list, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Error feedback, first half: per key, the tensor to compress is gradient + its residual."""
    return [g + state.residuals[k] if state.error_feedback and k in state.residuals else g.clone()
            for k, g in zip(keys, grads)]


def keep_residual(state: HookState, keys: list, corrected, sent) -> None:
    """Error feedback, second half: per key, remember what this rank's compression dropped."""
    if state.error_feedback:
        for k, c, s in zip(keys, corrected, sent):
            state.residuals[k] = c - s


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
    keys, grads = keyed_gradients(bucket)
    corrected = torch.cat(add_residual(state, keys, [g.flatten() for g in grads]))
    values, indices = topk_compress(corrected, topk_size(n, state.density))
    sent = topk_decompress(values, indices, n)
    pieces = [g.numel() for g in grads]
    keep_residual(state, keys, corrected.split(pieces), sent.split(pieces))
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


def elias_omega_bits(n: int) -> int:
    """Length of Elias's omega (recursive) code of a positive integer: 1 -> "0" (1 bit),
    2 -> "100", 4 -> "10 100 0" (6 bits): the binary of n, led by the code of its length."""
    bits = 1
    while n > 1:
        bits += n.bit_length()
        n = n.bit_length() - 1
    return bits


def qsgd_code_bits(q: torch.Tensor) -> int:
    """Bits of QSGD's levels q (chunks × d) in a variable-length code after the paper's Elias
    coding: per chunk 32 for the norm, per non-zero level the Elias code of the gap since the
    previous one, a sign bit and the Elias code of |level|. Zeros cost nothing, so at s = 1
    (most levels 0) this is far below a fixed-length code's log₂3 ≈ 1.58 bits per level."""
    bits = 32 * q.shape[0]
    for row in q.tolist():
        last = -1
        for i, level in enumerate(row):
            if level:
                bits += elias_omega_bits(i - last) + 1 + elias_omega_bits(abs(level))
                last = i
    return bits


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
    keys, grads = keyed_gradients(bucket)
    n, sizes = buf.numel(), [g.numel() for g in bucket.gradients()]
    corrected = torch.cat(add_residual(state, keys, [g.flatten() for g in grads]))
    scales = torch.stack([part.abs().mean() for part in corrected.split(sizes)])
    packed = pack_signs(corrected)
    per_coord = scales.repeat_interleave(torch.tensor(sizes, device=buf.device), dim=-1)
    sent = per_coord * unpack_signs(packed, n, buf.dtype)
    pieces = [g.numel() for g in grads]  # the same as sizes: one gradient per key
    keep_residual(state, keys, corrected.split(pieces), sent.split(pieces))
    all_packed, all_scales = all_gather_payload(packed), all_gather_payload(scales)
    per_coord = all_scales.repeat_interleave(torch.tensor(sizes, device=buf.device), dim=-1)
    buf.copy_((per_coord * unpack_signs(all_packed, n, buf.dtype)).mean(0))
    return completed(buf)


INT8_VOTERS = 127  # the largest sum of ±1 votes that int8 holds
FP16_VOTERS = 2048  # fp16 holds every integer up to 2¹¹ exactly, so every partial sum too


def vote_dtype(world: int) -> torch.dtype:
    """The narrowest dtype whose sums of `world` votes of ±1 are exact, that both NCCL and gloo
    all-reduce: int8 up to 127 ranks (128 votes of +1 wrap to −128), fp16 up to 2048 (every
    partial sum is an integer of magnitude ≤ 2048, which fp16 represents exactly; 2049 does not
    exist in fp16), int32 beyond. Not int16: NCCL has no 16-bit integer type."""
    if world <= INT8_VOTERS:
        return torch.int8
    if world <= FP16_VOTERS:
        return torch.float16
    return torch.int32


def majority_vote_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """signSGD with majority vote (Bernstein et al., 2018 and 2019): every rank votes with the
    sign of each coordinate, ±1 in `vote_dtype(world)` (int8 up to 127 ranks), and an all-reduce
    *sums* the votes (a quantised payload that is reduced, not gathered: the ranks share the
    scale, 1); every rank applies sign(Σ votes), the majority's verdict (0 on a tie), times the
    ranks' mean of each tensor's ||g||₁/numel (fp32, all-reduced too). No error feedback, as in
    the papers: the vote itself is not a rank's own compression, so there is no residual of this
    rank's to keep."""
    buf = bucket.buffer()
    world, sizes = dist.get_world_size(), [g.numel() for g in bucket.gradients()]
    votes = all_reduce_sum(torch.where(buf >= 0, 1, -1).to(vote_dtype(world)))
    scales = all_reduce_sum(torch.stack([g.abs().mean() for g in buf.split(sizes)])) / world
    per_coord = scales.repeat_interleave(torch.tensor(sizes, device=buf.device))
    buf.copy_(per_coord * votes.sign().to(buf.dtype))
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
    all_keys, grads = keyed_gradients(bucket)  # views into the buffer: writing them writes it
    world = dist.get_world_size()
    plan = powersgd_plan([g.shape for g in grads], state.rank)
    plain = [g for g, r in zip(grads, plan) if r == 0]
    if plain:
        flat = all_reduce_sum(torch.cat([g.flatten() for g in plain])) / world
        for g, part in zip(plain, flat.split([g.numel() for g in plain])):
            g.copy_(part.view_as(g))
    todo = [i for i, r in enumerate(plan) if r]
    if not todo:
        return completed(bucket.buffer())
    keys = [all_keys[i] for i in todo]
    mats = add_residual(state, keys, [grads[i].view(grads[i].shape[0], -1) for i in todo])
    for k, m, i in zip(keys, mats, todo):
        if k not in state.warm_q:
            g = torch.Generator(m.device).manual_seed(state.seed)  # the same Q on every rank
            state.warm_q[k] = torch.randn(m.shape[1], plan[i], generator=g,
                                          device=m.device, dtype=m.dtype)
    ps = [m @ state.warm_q[k] for k, m in zip(keys, mats)]
    ps = all_reduce_sum(torch.cat([p.flatten() for p in ps])).split([p.numel() for p in ps])
    ps = [orthonormalise(p.view(m.shape[0], -1)) for p, m in zip(ps, mats)]
    qs = [m.T @ p for m, p in zip(mats, ps)]
    # this rank's own error, before Q is averaged (the paper's Algorithm 2)
    keep_residual(state, keys, mats, [p @ q.T for p, q in zip(ps, qs)])
    flat_q = all_reduce_sum(torch.cat([q.flatten() for q in qs])) / world
    for k, m, p, q, i in zip(keys, mats, ps, flat_q.split([q.numel() for q in qs]), todo):
        state.warm_q[k] = q.view(m.shape[1], -1)
        grads[i].copy_((p @ state.warm_q[k].T).view_as(grads[i]))
    return completed(bucket.buffer())


# --- Bytes each method should send per step (the formulas the lesson states) ----------

def expected_bytes(method: str, shapes: list[torch.Size], state: HookState, elem: int = 4,
                   world: int = 2) -> int:
    """Bytes one rank hands to collectives per step, for one bucket holding `shapes`, at
    `world` ranks (only the majority vote's depends on it: `vote_dtype`)."""
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
    if method == "majority_vote":
        votes = torch.empty((), dtype=vote_dtype(world)).element_size()
        return votes * n + elem * len(shapes)  # a vote per coordinate + a scale per tensor
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
    A payload that each rank encodes in its own terms (Top-K's own indices, QSGD's own norms,
    packed sign bits with their own scales) cannot be summed on the way, so it is gathered: what
    a rank receives grows with W, while an all-reduce's stays below 2B. Integers on a scale all
    ranks share can be summed: the majority vote's signs are all-reduced."""
    sent = expected_bytes(method, shapes, state, world=world)
    if method.startswith(GATHERED):
        return (world - 1) * sent
    return 2 * (world - 1) / world * sent


def break_even_world(method: str, shapes: list[torch.Size], state: HookState,
                     max_world: int = 1 << 20) -> int | None:
    """The smallest world size at which `method` receives at least as many bytes per rank as
    the dense all-reduce does (None if it never does). The ratio of two all-reduces changes only
    where the vote's dtype widens (`vote_dtype`), so for them only those worlds are tried."""
    if method.startswith(GATHERED):
        worlds = range(2, max_world + 1)
    else:
        worlds = (2, INT8_VOTERS + 1, FP16_VOTERS + 1)
    for world in worlds:
        if received_bytes(method, shapes, state, world) >= received_bytes("dense", shapes, state, world):
            return world
    return None
