"""A small CLIP: an image tower (a CNN), a text tower (one transformer layer), a learnt temperature.

Both towers end in a linear projection to the same `embed_dim` and an L2 normalisation, so the
similarity of an image and a caption is a cosine; the logits are those cosines times
exp(logit_scale), clamped at 100 as in CLIP (Radford et al., 2021).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch26_multimodal.data import CAPTION_LEN, WORDS


class ImageTower(nn.Module):
    """Two conv blocks then a linear projection of the whole feature map (no global pooling:
    the position of the shape is part of what the caption says)."""

    def __init__(self, embed_dim: int = 32, width: int = 16, image_size: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.proj = nn.Linear(2 * width * (image_size // 4) ** 2, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.proj(x.flatten(1))


class TextTower(nn.Module):
    """Word and position embeddings, one pre-norm self-attention + MLP layer, mean pooling,
    a linear projection."""

    def __init__(self, embed_dim: int = 32, width: int = 32, heads: int = 2):
        super().__init__()
        self.tok = nn.Embedding(len(WORDS), width)
        self.pos = nn.Parameter(torch.randn(CAPTION_LEN, width) * 0.02)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.proj = nn.Linear(width, embed_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.proj(x.mean(dim=1))


class CLIP(nn.Module):
    def __init__(self, embed_dim: int = 32, image_size: int = 16):
        super().__init__()
        self.image = ImageTower(embed_dim, image_size=image_size)
        self.text = TextTower(embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image(images), dim=-1)

    def encode_text(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(ids), dim=-1)

    def scale(self) -> torch.Tensor:
        return self.logit_scale.exp().clamp(max=100.0)

    def forward(self, images: torch.Tensor, ids: torch.Tensor):
        return self.encode_image(images), self.encode_text(ids), self.scale()
