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
import torch.nn.functional as F

from chapters.ch18_long_context.ring import allgather_attention, ring_attention
from chapters.ch18_long_context.ulysses import ulysses_attention
from common.models import TinyGPT


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
