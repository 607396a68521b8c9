"""DeepSpeed-Ulysses by hand (Jacobs et al. 2023): an all-to-all turns "every rank holds T/N
tokens of all H heads" into "every rank holds all T tokens of H/N heads"; attention then runs
unchanged, head group by head group (any kernel: FlashAttention, or here
`scaled_dot_product_attention`); a second all-to-all turns the output back.

Each all-to-all moves (N−1)/N of the local tensor: four of them in forward (q, k, v, out) and
four in backward, so a rank sends 8·(N−1)/N·B·H·(T/N)·D elements per layer, a volume that does
not grow with N at a fixed T/N (the ring's grows with N). The price: N must divide the heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

BROKEN_ULYSSES = ("none", "wrong_order")


@dataclass
class AllToAllCounter:
    """Bytes each rank's all-to-alls send to *other* ranks (the part destined to itself stays)."""

    bytes: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    calls: int = 0

    def reset(self) -> None:
        self.bytes, self.calls = {"forward": 0, "backward": 0}, 0


COUNTER = AllToAllCounter()


def heads_error(heads: int, world: int) -> str | None:
    """One sentence if Ulysses cannot split `heads` over `world` ranks, else None."""
    if heads % world:
        none = " (fewer heads than ranks: a rank would get none)" if heads < world else ""
        return (f"DeepSpeed-Ulysses gives each rank whole attention heads: {world} ranks do not "
                f"divide {heads} heads{none}")
    return None


def _all_to_all(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (x[j] goes to rank j), counting what leaves."""
    x = x.contiguous()
    out = torch.empty_like(x)
    stays = x[dist.get_rank(group)]  # the piece addressed to this rank never leaves it
    COUNTER.bytes[phase] += (x.numel() - stays.numel()) * x.element_size()
    COUNTER.calls += 1
    dist.all_to_all_single(out, x, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Piece j goes to rank j; rank j's piece i comes back. Its gradient is the same exchange
    run backwards, which for equal splits is the same call on the gradient."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return _all_to_all(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, "backward"), None


def seq_to_heads(x: torch.Tensor, group=None, broken: str = "none") -> torch.Tensor:
    """(B, H, T/N, D) sharded by sequence → (B, H/N, T, D) sharded by heads."""
    world = dist.get_world_size(group)
    B, H, t, D = x.shape
    if error := heads_error(H, world):  # before the all-to-all: every rank refuses, none hangs
        raise ValueError(error)
    if broken == "wrong_order":  # head h goes to rank h mod N instead of h // (H/N)
        send = x.reshape(B, H // world, world, t, D).permute(2, 0, 1, 3, 4)
    else:
        send = x.reshape(B, world, H // world, t, D).transpose(0, 1)  # send[g]: head group g
    recv = AllToAll.apply(send, group)  # recv[j]: rank j's tokens of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // world, world * t, D)


def heads_to_seq(y: torch.Tensor, group=None) -> torch.Tensor:
    """(B, H/N, T, D) sharded by heads → (B, H, T/N, D) sharded by sequence."""
    world = dist.get_world_size(group)
    B, h, T, D = y.shape
    send = y.reshape(B, h, world, T // world, D).permute(2, 0, 1, 3, 4)  # send[j]: tokens of rank j
    recv = AllToAll.apply(send, group)  # recv[g]: head group g of my tokens
    return recv.transpose(0, 1).reshape(B, h * world, T // world, D)


def ulysses_attention(q, k, v, causal: bool = True, group=None, broken: str = "none") -> torch.Tensor:
    """This rank's (contiguous) sequence shard of attention over the whole sequence."""
    qh, kh, vh = (seq_to_heads(t, group, broken) for t in (q, k, v))
    return heads_to_seq(F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal), group)


def ulysses_bytes_per_rank(batch: int, heads: int, local_len: int, head_dim: int, elem: int,
                           world: int) -> dict:
    """Four all-to-alls each way, each sending (N−1)/N of a B·H·(T/N)·D tensor."""
    block = batch * heads * local_len * head_dim * elem
    return {"forward": 4 * block * (world - 1) // world, "backward": 4 * block * (world - 1) // world}
