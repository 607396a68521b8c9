"""Offline datasets: nothing here downloads anything.

- `regression_data` / `classification_data`: synthetic tensors from a fixed random teacher.
- `procedural_images`: a 4-class image set drawn from code (disks, squares, stripes).
- `text_corpus` + `CharTokenizer`: English text that ships with Python itself (the `pydoc`
  help topics), tokenised per character; `token_windows` cuts it into LM examples.

Every function is deterministic in its `seed`, so every rank can build the same data and
take its own shard of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def regression_data(n: int = 256, d_in: int = 16, d_out: int = 1, seed: int = 0,
                    noise: float = 0.1, dtype: torch.dtype = torch.float32):
    """(X, Y) with Y = X·W + noise for a fixed random W."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    W = torch.randn(d_in, d_out, generator=g, dtype=torch.float64) / d_in**0.5
    Y = X @ W + noise * torch.randn(n, d_out, generator=g, dtype=torch.float64)
    return X.to(dtype), Y.to(dtype)


def classification_data(n: int = 512, d_in: int = 16, n_classes: int = 4, seed: int = 0,
                        dtype: torch.dtype = torch.float32):
    """(X, y): labels are the argmax of a fixed random two-layer teacher network."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_in, generator=g)
    W1 = torch.randn(d_in, 32, generator=g)
    W2 = torch.randn(32, n_classes, generator=g)
    y = (torch.tanh(X @ W1) @ W2).argmax(dim=1)
    return X.to(dtype), y


def procedural_images(n: int = 512, size: int = 16, seed: int = 0):
    """(images (n, 3, size, size) in [0, 1], labels (n,)): 0 disk, 1 square, 2 horizontal
    stripes, 3 vertical stripes; random colour, position, scale and pixel noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    images = torch.empty(n, 3, size, size)
    for i in range(n):
        cy, cx = (torch.rand(2, generator=g) * size * 0.5 + size * 0.25).tolist()
        r = float(torch.rand(1, generator=g)) * size * 0.2 + size * 0.15
        period = int(torch.randint(2, 5, (1,), generator=g))
        kind = int(labels[i])
        if kind == 0:
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        elif kind == 1:
            mask = ((yy - cy).abs() <= r) & ((xx - cx).abs() <= r)
        elif kind == 2:
            mask = (yy // period) % 2 == 0
        else:
            mask = (xx // period) % 2 == 0
        colour = torch.rand(3, 1, 1, generator=g) * 0.7 + 0.3
        img = mask.float() * colour + 0.1 * torch.rand(3, size, size, generator=g)
        images[i] = img.clamp(0, 1)
    return images, labels


def text_corpus(max_chars: int | None = None) -> str:
    """English text that ships with every CPython: the `help()` topics of pydoc (~0.46 MB)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return text if max_chars is None else text[:max_chars]


class CharTokenizer:
    """One token per character seen in the training text; unseen characters map to '?'."""

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars) | {"?"}))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def fit(cls, text: str) -> CharTokenizer:
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unk = self.index["?"]
        return torch.tensor([self.index.get(c, unk) for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"chars": self.chars}))

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        return cls(json.loads(Path(path).read_text())["chars"])


def token_windows(tokens: torch.Tensor, block_size: int, n: int, seed: int = 0):
    """`n` random (input, target) windows of length `block_size`; target is input shifted by one."""
    if len(tokens) <= block_size:
        raise ValueError(f"{len(tokens)} tokens are too few for block_size={block_size}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - block_size - 1, (n,), generator=g)
    x = torch.stack([tokens[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + 1 + block_size] for s in starts.tolist()])
    return x, y
