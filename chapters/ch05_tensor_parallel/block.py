"""The dense transformer block that every tensor-parallel version must equal.

A pre-norm block, x + drop(attn(ln1(x))) then x + drop(mlp(ln2(x))), with separate q, k, v
projections (so a column split of each is a split by heads) and attention written out by hand.
`causal_attention` infers the number of heads from the width it is given, so the same code runs
on all heads (dense) or on one rank's heads (tensor parallel). Dropout masks come from a
generator seeded per layer and step over the FULL (batch, sequence, hidden) shape, so a rank
that holds a slice of the sequence can take the matching slice of the same mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """softmax(q kᵀ/√d + causal mask) v per head; q, k, v are (B, S, heads·head_dim)."""
    B, S, width = q.shape
    q, k, v = (t.view(B, S, width // head_dim, head_dim).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    future = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
    y = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    return y.transpose(1, 2).reshape(B, S, width)


def seeded_dropout(x: torch.Tensor, p: float, seed: int, seq_offset: int = 0,
                   seq_total: int | None = None) -> torch.Tensor:
    """Dropout whose mask is drawn for the full sequence from `seed`, then narrowed to the
    rows [seq_offset, seq_offset + x.shape[1]) this rank holds. The mask is drawn on the CPU,
    so it is the same on every device; Megatron instead forks a CUDA RNG per rank. The slice is
    copied: a narrowed view would keep the whole sequence's mask alive for backward, and
    sequence parallelism would save nothing on it. The mask is bool (1 byte per element)."""
    if p == 0.0:
        return x
    B, S, h = x.shape
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, seq_total or S, h, generator=g) >= p
    keep = keep.narrow(1, seq_offset, S).clone().to(x.device)
    return x * keep / (1 - p)


def dropout_seed(step: int, layer: int, site: int) -> int:
    """One seed per (step, layer, site): site 0 after attention, 1 after the MLP."""
    return 1_000_003 * step + 2 * layer + site


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(causal_attention(self.q(x), self.k(x), self.v(x), self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, layer: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn, self.mlp = Attention(d_model, n_heads), FeedForward(d_model, d_ff)
        self.p, self.layer = dropout, layer

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        x = x + seeded_dropout(self.attn(self.ln1(x)), self.p, dropout_seed(step, self.layer, 0))
        return x + seeded_dropout(self.mlp(self.ln2(x)), self.p, dropout_seed(step, self.layer, 1))


class DenseModel(nn.Module):
    """`n_layers` blocks on (batch, sequence, d_model) activations: the single-device reference."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, d_ff: int = 128, n_layers: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff, dropout, i) for i in range(n_layers))

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, step)
        return x
