"""Ring attention by hand: blockwise attention with the online-softmax merge, K/V blocks
passed around a ring of ranks, and the backward written by hand (autograd cannot pass
through send/recv).

Every rank holds one shard of the sequence for q, k and v, shaped (B, H, T/N, D): two of the
sequence's 2N chunks of c = T/(2N) tokens, chosen by a *layout* ("contiguous" or "zigzag",
see layouts.py, which balances the causal work).

In N steps each rank meets every K/V block: at step s it holds the block of rank (r − s) mod N,
computes its queries against it while the next block is already travelling (`batch_isend_irecv`),
and merges the partial result with the log-sum-exp rule (Milakov & Gimelshein 2018; Dao et al.
2022, FlashAttention):  lse = log(e^lse₁ + e^lse₂),  out = out₁·e^(lse₁−lse) + out₂·e^(lse₂−lse).
No rank ever holds a T × T score matrix, nor all of K and V.

Backward recomputes each block's probabilities from the saved lse (FlashAttention's backward),
sends K/V around the ring again, and sends each block's gradient accumulators dK, dV with it, one
hop behind, so that after N hops they arrive, complete, at the rank that owns the block. Both
travel while the next block's gradients compute; only the last dK/dV hop has nothing left to
hide behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from chapters.ch18_long_context.layouts import chunk_ids
from chapters.ch18_long_context.timeline import RingCounter

BROKEN_RING = ("none", "no_rescale", "dkv_not_returned", "wrong_layout", "serial")

COUNTER = RingCounter()


def _causal_mask(q_id: int, k_ids: list[int], c: int, device) -> torch.Tensor | None:
    """Allowed (query, key) pairs of one query chunk against the selected key chunks: all of an
    earlier chunk, the lower triangle of the same chunk. None when nothing is masked."""
    if q_id not in k_ids:
        return None
    tri = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    full = torch.ones(c, c, dtype=torch.bool, device=device)
    return torch.cat([tri if k == q_id else full for k in k_ids], dim=1)


def _selected(q_id: int, k_ids: list[int], causal: bool) -> list[int]:
    """Key chunks a query chunk attends to: all, or (causal) those not entirely in its future."""
    return [b for b, k in enumerate(k_ids) if not causal or k <= q_id]


def _scores(qq, kk, scale, mask):
    s = qq @ kk.transpose(-2, -1) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward(q, k, v, q_ids, k_ids, scale: float, causal: bool):
    """Attention of this rank's queries against one K/V block, chunk by chunk, skipping chunk
    pairs the causal mask removes entirely. Returns (out, lse, chunk products computed)."""
    c = q.shape[-2] // len(q_ids)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    products = 0
    for a, q_id in enumerate(q_ids):
        sel = _selected(q_id, k_ids, causal)
        if not sel:
            continue
        kk = torch.cat([k[..., b * c:(b + 1) * c, :] for b in sel], dim=-2)
        vv = torch.cat([v[..., b * c:(b + 1) * c, :] for b in sel], dim=-2)
        mask = _causal_mask(q_id, [k_ids[b] for b in sel], c, q.device) if causal else None
        s = _scores(q[..., a * c:(a + 1) * c, :], kk, scale, mask)
        lse_a = torch.logsumexp(s, dim=-1)
        out[..., a * c:(a + 1) * c, :] = torch.exp(s - lse_a[..., None]) @ vv
        lse[..., a * c:(a + 1) * c] = lse_a
        products += len(sel)
    return out, lse, products


def block_backward(dout, q, k, v, lse, delta, q_ids, k_ids, scale: float, causal: bool):
    """Gradients of one block: dq (this rank's queries), dk and dv (the block's keys, to be sent
    on to their owner). P is recomputed from the saved lse; dS = P ∘ (dP − rowsum(dO ∘ O))."""
    c = q.shape[-2] // len(q_ids)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, q_id in enumerate(q_ids):
        sel = _selected(q_id, k_ids, causal)
        if not sel:
            continue
        rows = slice(a * c, (a + 1) * c)
        kk = torch.cat([k[..., b * c:(b + 1) * c, :] for b in sel], dim=-2)
        vv = torch.cat([v[..., b * c:(b + 1) * c, :] for b in sel], dim=-2)
        mask = _causal_mask(q_id, [k_ids[b] for b in sel], c, q.device) if causal else None
        qq, do = q[..., rows, :], dout[..., rows, :]
        p = torch.exp(_scores(qq, kk, scale, mask) - lse[..., rows, None])
        ds = p * (do @ vv.transpose(-2, -1) - delta[..., rows, None])
        dq[..., rows, :] += ds @ kk * scale
        dk_sel, dv_sel = ds.transpose(-2, -1) @ qq * scale, p.transpose(-2, -1) @ do
        for i, b in enumerate(sel):
            dk[..., b * c:(b + 1) * c, :] += dk_sel[..., i * c:(i + 1) * c, :]
            dv[..., b * c:(b + 1) * c, :] += dv_sel[..., i * c:(i + 1) * c, :]
    return dq, dk, dv


@dataclass
class Hop:
    """One ring exchange in flight: its requests and its place in the counter's event log."""

    reqs: list
    phase: str
    id: int
    device: torch.device = torch.device("cpu")


def ring_exchange(t: torch.Tensor, group, phase: str, tag: int = 0) -> tuple[torch.Tensor, Hop]:
    """Start sending `t` to the next rank and receiving the previous rank's into a new buffer;
    return (buffer, hop). The caller computes meanwhile, then `_wait(hop)`. Two exchanges of the
    same size may be in flight at once in backward (K/V and dK/dV): their tags keep gloo from
    matching one's send with the other's receive (NCCL keeps the order of its P2P ops)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    recv = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, peer((rank + 1) % world), group, tag),
           dist.P2POp(dist.irecv, recv, peer((rank - 1) % world), group, tag)]
    COUNTER.bytes[phase] += t.numel() * t.element_size()  # what is handed to the send
    COUNTER.sends += 1
    COUNTER.mark(phase, "send", COUNTER.sends, t.device)
    return recv, Hop(dist.batch_isend_irecv(ops), phase, COUNTER.sends, t.device)


def _wait(hop: Hop) -> None:
    COUNTER.mark(hop.phase, "wait_start", hop.id, hop.device)
    for req in hop.reqs:
        req.wait()
    COUNTER.mark(hop.phase, "wait", hop.id, hop.device)


class RingAttention(torch.autograd.Function):
    """`RingAttention.apply(q, k, v, layout, causal, group, broken)`: this rank's rows of
    softmax(QKᵀ/√D)·V over the whole sequence. `broken` names a deliberate bug (a negative
    control): "no_rescale" (partial results added without the log-sum-exp weights),
    "dkv_not_returned" (the last hop of dK/dV skipped), "wrong_layout" (masks built for the
    contiguous layout while the data is zigzag), "serial" (each transfer waited for before the
    block computes: right numbers, no overlap)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: str, causal: bool, group=None, broken: str = "none"):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if q.shape[-2] % 2 or k.shape != q.shape or v.shape != q.shape:  # before any send: no hang
            raise ValueError(f"ring attention needs q, k, v of one shape with two equal chunks per "
                             f"rank; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        mask_layout = "contiguous" if broken == "wrong_layout" else layout
        scale = q.shape[-1] ** -0.5
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        q_ids = chunk_ids(rank, world, mask_layout)
        for step in range(world):
            if step < world - 1:
                nxt, hop = ring_exchange(kv, group, "forward")  # travels while we compute
                if broken == "serial":
                    _wait(hop)
            src = (rank - step) % world
            COUNTER.mark("forward", "begin", None, q.device)
            blk_out, blk_lse, n = block_forward(q, kv[0], kv[1], q_ids,
                                                chunk_ids(src, world, mask_layout), scale, causal)
            COUNTER.mark("forward", "compute", None, q.device)
            COUNTER.products += n
            if broken == "no_rescale":
                out, lse = out + blk_out, torch.logaddexp(lse, blk_lse)
            else:
                new = torch.logaddexp(lse, blk_lse)
                out = out * torch.exp(lse - new)[..., None] + blk_out * torch.exp(blk_lse - new)[..., None]
                lse = new
            if step < world - 1:
                if broken != "serial":
                    _wait(hop)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, mask_layout, causal, group, broken)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, mask_layout, causal, group, broken = ctx.args
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        scale = q.shape[-1] ** -0.5
        delta = (dout * out).sum(-1)
        q_ids = chunk_ids(rank, world, mask_layout)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv_in, dkv_hop = None, None  # the held block's accumulator, from the previous rank
        for step in range(world):
            if step < world - 1:
                nxt, kv_hop = ring_exchange(kv, group, "backward")
                if broken == "serial":
                    _wait(kv_hop)
            src = (rank - step) % world
            COUNTER.mark("backward", "begin", None, q.device)
            dq_b, dk_b, dv_b = block_backward(dout, q, kv[0], kv[1], lse, delta, q_ids,
                                              chunk_ids(src, world, mask_layout), scale, causal)
            COUNTER.mark("backward", "compute", None, q.device)
            dq += dq_b
            dkv = torch.stack([dk_b, dv_b])  # this rank's share of the held block's dK, dV
            if dkv_hop is not None:  # it travelled while the product above computed
                _wait(dkv_hop)
            if dkv_in is not None:
                dkv = dkv_in + dkv
            if step < world - 1:
                if broken != "serial":
                    _wait(kv_hop)
                kv = nxt
            last = step == world - 1
            dkv_in, dkv_hop = None, None
            if world > 1 and not (last and broken == "dkv_not_returned"):
                dkv_in, dkv_hop = ring_exchange(dkv, group, "backward", tag=1)  # one hop behind K/V
                if last or broken == "serial":  # the last hop has nothing left to hide behind
                    _wait(dkv_hop)
                    dkv_hop = None
        if dkv_in is not None:  # the owner's complete accumulator came home
            dkv = dkv_in
        return dq, dkv[0], dkv[1], None, None, None, None


def ring_attention(q, k, v, layout: str = "zigzag", causal: bool = True, group=None,
                   broken: str = "none") -> torch.Tensor:
    """Ring attention on this rank's shard (B, H, T/N, D) of q, k, v; see `RingAttention`."""
    return RingAttention.apply(q, k, v, layout, causal, group, broken)


def ring_bytes_per_rank(batch: int, heads: int, local_len: int, head_dim: int, elem: int,
                        world: int) -> dict:
    """What each rank sends: forward N−1 hops of K and V; backward N−1 hops of K and V plus N
    hops of dK and dV (none on one rank: they are already home). One block of K (or V) is
    B·H·(T/N)·D elements."""
    block = batch * heads * local_len * head_dim * elem
    dkv_hops = world if world > 1 else 0
    return {"forward": 2 * (world - 1) * block, "backward": (2 * (world - 1) + 2 * dkv_hops) * block}


# Score blocks (B·H·c·2c·e, `score_block_bytes`) alive at once in causal ring attention under the
# zigzag split (what the TinyGPT runs): a measured upper bound. `block_forward` peaks at three
# (scores, scores − lse, exp). `block_backward` peaks while dP − δ is made: P, dP and dP − δ (one
# block each) plus the previous query chunk's dS, still bound to `ds` until the next one replaces
# it (half a block: under zigzag a chunk before a whole one covers one key chunk, not two), plus
# the mask and the small tensors. A live-tensor count in the tests measures 3.2 blocks forward
# and 3.8 backward at T/N = 512 on 2 and 4 ranks (3.18 and 3.76 on one) and checks
# TRANSIENT_BLOCKS − 1 < backward ≤ TRANSIENT_BLOCKS. Without a mask, or under the contiguous
# split, the previous chunk's P and dS can both be whole blocks, alive while the next scores are
# made: 4.35 blocks on 2 and 4 ranks (measured by the same count, not checked), above this bound.
TRANSIENT_BLOCKS = 4


def score_block_bytes(batch: int, heads: int, seq_len: int, world: int, elem: int) -> int:
    """The largest temporary of a ring step: one query chunk (c = T/(2N) rows) against the two key
    chunks of a block, B·H·c·2c·e bytes. It grows as (T/N)², and it is freed before the next
    step: never saved, but it must fit beside the saved activations."""
    c = seq_len // (2 * world)
    return batch * heads * c * 2 * c * elem


def causal_products_per_rank(world: int, layout: str) -> list[int]:
    """Chunk products each rank computes under a causal mask, by the formula: contiguous rank r
    holds chunks 2r, 2r+1 and computes (2r+1) + (2r+2) = 4r + 3; zigzag rank r holds chunks r
    and 2N−1−r and computes (r+1) + (2N−r) = 2N + 1, the same on every rank."""
    if layout == "contiguous":
        return [4 * r + 3 for r in range(world)]
    return [2 * world + 1] * world
