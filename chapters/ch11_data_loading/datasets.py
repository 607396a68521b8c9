"""The chapter's datasets: token windows memory-mapped from the int16 file `data/build.py`
writes, images decoded and augmented per item (a deliberate CPU cost, so loader workers
matter), and a cache in front of any dataset (chapter 11).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from common.data import procedural_images

TOKEN_DTYPE = torch.int16  # data/build.py writes int16: the vocabulary has < 32768 tokens


def ensure_tokens(path: str | Path, fallback_dir: str | Path) -> tuple[Path, bool]:
    """The tokens file at `path` if it exists, else one built into `fallback_dir` with
    data/build.py's `build` (offline: the text ships with Python). Returns (path, built now?).

    The build goes to a private folder first and the finished file is renamed into place, so a
    reader never sees half a file, even if two nodes sharing a file system build at once."""
    if path and Path(path).exists():
        return Path(path), False
    target = Path(fallback_dir) / "tokens.bin"
    if target.exists():
        return target, False
    import importlib.util
    import os
    import tempfile

    from common.results import REPO_ROOT

    spec = importlib.util.spec_from_file_location("data_build", REPO_ROOT / "data" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        built = module.build(Path(tmp))  # corpus.txt, tokenizer.json, tokens.bin
        for name in ("corpus", "tokenizer", "tokens"):  # tokens last: its presence means done
            os.replace(built[name], target.parent / built[name].name)  # atomic on one file system
    return target, True


def read_tokens(path: str | Path) -> torch.Tensor:
    """The whole tokens file, read with torch alone (the reference the memmap is checked against)."""
    n = Path(path).stat().st_size // 2
    return torch.from_file(str(path), shared=False, size=n, dtype=TOKEN_DTYPE)


class TokenWindows(Dataset):
    """Window i is tokens[i·block : i·block + block + 1], read from a memory map: (i, x, y)
    with y = x shifted by one. Only the pages a window touches are read from disk.

    The map is opened lazily in the process that reads, never pickled: a DataLoader worker
    (spawned or forked) gets the path and opens its own map.
    """

    def __init__(self, path: str | Path, block_size: int, max_windows: int = 0):
        self.path, self.block_size = str(path), block_size
        n_tokens = Path(path).stat().st_size // 2
        available = (n_tokens - 1) // block_size
        if available < 1:
            raise ValueError(f"{path} holds {n_tokens} tokens: too few for block_size={block_size}")
        self.n = min(available, max_windows) if max_windows > 0 else available
        self._tokens = None

    def tokens(self):
        if self._tokens is None:
            import numpy as np

            self._tokens = np.memmap(self.path, dtype=np.int16, mode="r")
        return self._tokens

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        start = i * self.block_size
        window = torch.from_numpy(self.tokens()[start:start + self.block_size + 1].astype("int64"))
        return i, window[:-1], window[1:]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def augment(image: torch.Tensor, g: torch.Generator, work: int) -> torch.Tensor:
    """Random flip, random shift and `work` rounds of a 3×3 blur: the per-item CPU cost
    that stands for JPEG decoding and augmentation in a real image pipeline."""
    if torch.rand(1, generator=g).item() < 0.5:
        image = image.flip(-1)
    dy, dx = torch.randint(-2, 3, (2,), generator=g).tolist()
    image = image.roll((dy, dx), dims=(-2, -1))
    kernel = torch.full((3, 1, 3, 3), 1 / 9)
    for _ in range(work):
        image = torch.nn.functional.conv2d(image[None], kernel, padding=1, groups=3)[0]
    return image


class AugmentedImages(Dataset):
    """Procedural images, decoded and augmented on every access, deterministically per (seed, i)."""

    def __init__(self, n: int, size: int = 32, work: int = 20, seed: int = 0):
        self.n, self.size, self.work, self.seed = n, size, work, seed
        self.images, self.labels = procedural_images(n, size, seed=seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return augment(self.images[i], g, self.work), self.labels[i]


class CachedDataset(Dataset):
    """Keep every item after its first read. The cache lives in the process that reads: each
    DataLoader worker fills its own copy, and non-persistent workers lose it every epoch."""

    def __init__(self, base: Dataset):
        self.base, self.cache = base, {}

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        if i not in self.cache:
            self.cache[i] = self.base[i]
        return self.cache[i]
