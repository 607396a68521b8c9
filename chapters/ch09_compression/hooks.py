"""The DDP communication hooks that send compressed gradients (chapter 09).

Each compressor is a pair of small pure functions (compress, decompress: compressors.py) and a
hook here that sends the compressed payload with a real collective: Top-K values and indices,
QSGD int8 levels and norms, packed sign bits and a scale, PowerSGD's low-rank factors P and Q. The hooks
do not count their own bytes: `wire.WireTap` records what reaches the collectives, so the
compression ratio is measured from what was sent, not from what a hook says it sent. Error
feedback keeps, per parameter, what compression dropped and adds it back to the next step's
gradient: never per bucket or per position in the flat bucket, because DDP rebuilds its buckets
after step 0 in another order (`keyed_gradients`).

Every rank decodes the same gathered payloads with the same deterministic operations, so the
replicas receive the same averaged gradient bit for bit (no atomics: see
`compressors.topk_decompress`).

No `from __future__ import annotations` here: DDP inspects a hook's annotations when it is
registered and rejects the strings that import would turn them into.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from chapters.ch09_compression.compressors import (
    orthonormalise,
    pack_signs,
    powersgd_plan,
    qsgd_dequantize,
    qsgd_quantize,
    topk_compress,
    topk_decompress,
    topk_size,
    unpack_signs,
    vote_dtype,
)


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
