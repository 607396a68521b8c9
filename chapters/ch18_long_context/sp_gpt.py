"""The course's TinyGPT with its sequence sharded over the ranks.

Same parameters as `common.models.TinyGPT` (it subclasses it, so a state dict moves between the
two); only the forward differs: each rank embeds its own tokens at their *global* positions,
runs the blocks on its shard (LayerNorm, the MLP and the projections are per token and need no
communication), and attention alone talks to the other ranks — by ring attention or Ulysses
(or, as a negative control, by gathering all of K and V).
The loss is this rank's share: its tokens' summed cross-entropy divided by the global token
count, so the ranks' losses add up to the one-process mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch18_long_context.layouts import positions, unshard_sequence
from chapters.ch18_long_context.ring import ring_attention
from chapters.ch18_long_context.ulysses import ulysses_attention
from common.models import TinyGPT


class _AllGatherSeq(torch.autograd.Function):
    """Every rank's shard stacked on a new dim 0; backward sums the gradients over the ranks (an
    all-reduce) and keeps this rank's piece."""

    @staticmethod
    def forward(ctx, t, group):
        from common.distributed import all_gather_single

        ctx.group = group
        world = dist.get_world_size(group)
        out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        all_gather_single(out, t.contiguous(), group=group)
        return out.view(world, *t.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def allgather_attention(q, k, v, layout: str = "zigzag", causal: bool = True, group=None) -> torch.Tensor:
    """The simple alternative to the ring: all-gather K and V, attend locally. The output is
    right, but every rank holds, and saves for backward, the whole K and V: its activations do
    not fall as 1/N (the activation check's negative control)."""

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    k_all, v_all = (unshard_sequence(list(_AllGatherSeq.apply(t, group)), layout, dim=2) for t in (k, v))
    T = k_all.shape[-2]
    mask = None
    if causal:
        q_pos = positions(T, rank, world, layout).to(q.device)
        mask = torch.arange(T, device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


class SequenceParallelGPT(TinyGPT):
    def __init__(self, cfg, attention: str = "ring", layout: str = "zigzag", group=None):
        super().__init__(cfg)
        self.attention, self.layout, self.group = attention, layout, group

    def _attend(self, attn, x: torch.Tensor) -> torch.Tensor:
        B, t, C = x.shape
        q, k, v = attn.qkv(x).split(C, dim=2)
        q, k, v = (z.view(B, t, attn.n_head, C // attn.n_head).transpose(1, 2) for z in (q, k, v))
        if self.attention == "ring":
            y = ring_attention(q, k, v, self.layout, causal=True, group=self.group)
        elif self.attention == "allgather":  # a negative control: whole K/V on every rank
            y = allgather_attention(q, k, v, self.layout, causal=True, group=self.group)
        else:
            y = ulysses_attention(q, k, v, causal=True, group=self.group)
        return attn.proj(y.transpose(1, 2).reshape(B, t, C))

    def forward(self, idx: torch.Tensor, pos: torch.Tensor, targets: torch.Tensor, n_tokens: int):
        """idx, targets: this rank's (B, T/N) tokens; pos: their global positions (T/N,);
        returns this rank's share of the mean cross-entropy over all `n_tokens` tokens."""
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = x + self._attend(block.attn, block.ln1(x))
            x = x + block.mlp(block.ln2(x))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / n_tokens
