"""The paired image/caption set, generated offline: coloured shapes at positions, and their captions.

Every image shows one shape (circle, square, triangle, cross) in one colour (red, green, blue,
yellow) in one quadrant (top left, top right, bottom left, bottom right), with jittered size,
place, shade and pixel noise; its caption names the three attributes: "a red circle at the top
left". 4 x 4 x 4 = 64 captions.

Some (colour, shape) pairs are **held out**: training never shows a red circle, but it shows red
squares and green circles. Zero-shot retrieval then asks the trained model to find "a red circle
at the top left" among all 64 captions for an image it has never seen the like of: it can only
succeed by combining attributes it learnt apart. Everything is a pure function of its seed, so
every rank builds the same set and takes its own shard.
"""

from __future__ import annotations

import itertools

import torch

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = ("red", "green", "blue", "yellow")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
RGB = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.1), "blue": (0.15, 0.25, 0.95),
       "yellow": (0.9, 0.85, 0.1)}
WORDS = ("a", "at", "the", "top", "bottom", "left", "right", *COLOURS, *SHAPES)
VOCAB = {w: i for i, w in enumerate(WORDS)}
CAPTION_LEN = 7  # "a <colour> <shape> at the <top|bottom> <left|right>"


def all_combinations() -> list[tuple[int, int, int]]:
    """Every (shape, colour, position) index triple, in a fixed order: the 64 captions."""
    return list(itertools.product(range(len(SHAPES)), range(len(COLOURS)), range(len(POSITIONS))))


def is_held_out(shape: int, colour: int) -> bool:
    """The held-out (colour, shape) pairs: one per shape and one per colour (a Latin diagonal),
    so each shape and each colour is still seen in training with three of the four others."""
    return (shape + colour) % len(COLOURS) == 0


def split_combinations() -> tuple[list, list]:
    """(training combinations, held-out combinations): 48 and 16 of the 64."""
    train = [c for c in all_combinations() if not is_held_out(c[0], c[1])]
    held = [c for c in all_combinations() if is_held_out(c[0], c[1])]
    return train, held


def caption(shape: int, colour: int, position: int) -> str:
    return f"a {COLOURS[colour]} {SHAPES[shape]} at the {POSITIONS[position]}"


def tokenize(text: str) -> torch.Tensor:
    """Word ids of a caption (the vocabulary is the 15 words above: no tokenizer to train)."""
    ids = [VOCAB[w] for w in text.split()]
    if len(ids) != CAPTION_LEN:
        raise ValueError(f"a caption has {CAPTION_LEN} words: {text!r}")
    return torch.tensor(ids, dtype=torch.long)


def draw(shape: int, colour: int, position: int, size: int, g: torch.Generator) -> torch.Tensor:
    """One (3, size, size) image in [0, 1]."""
    half = size / 2
    cy = (half if position >= 2 else 0) + half / 2 + (torch.rand(1, generator=g).item() - 0.5) * half * 0.3
    cx = (half if position % 2 else 0) + half / 2 + (torch.rand(1, generator=g).item() - 0.5) * half * 0.3
    r = half * (0.32 + 0.12 * torch.rand(1, generator=g).item())
    yy, xx = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    dy, dx = yy - cy, xx - cx
    if SHAPES[shape] == "circle":
        mask = dy ** 2 + dx ** 2 <= r * r
    elif SHAPES[shape] == "square":
        mask = (dy.abs() <= r * 0.85) & (dx.abs() <= r * 0.85)
    elif SHAPES[shape] == "triangle":  # apex up: width grows from the top
        mask = (dy >= -r) & (dy <= r) & (dx.abs() <= (dy + r) / 2)
    else:  # cross
        arm = r * 0.35
        mask = ((dy.abs() <= arm) & (dx.abs() <= r)) | ((dx.abs() <= arm) & (dy.abs() <= r))
    shade = torch.tensor(RGB[COLOURS[colour]]).view(3, 1, 1) * (0.8 + 0.2 * torch.rand(1, generator=g).item())
    img = mask.float() * shade + 0.08 * torch.rand(3, size, size, generator=g)
    return img.clamp(0, 1)


def make_pairs(n: int, seed: int, combinations: list, size: int = 16,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(images (n, 3, size, size), caption ids (n, 7), combination index (n,) into
    `combinations`): n pairs drawn uniformly from `combinations`."""
    g = torch.Generator().manual_seed(seed)
    which = torch.randint(0, len(combinations), (n,), generator=g)
    images = torch.stack([draw(*combinations[int(k)], size, g) for k in which])
    captions = torch.stack([tokenize(caption(*combinations[int(k)])) for k in which])
    return images.to(dtype), captions, which


def caption_bank() -> tuple[torch.Tensor, list[str]]:
    """Every one of the 64 captions, tokenised, in `all_combinations()` order: the candidates of
    zero-shot retrieval."""
    texts = [caption(*c) for c in all_combinations()]
    return torch.stack([tokenize(t) for t in texts]), texts


def loss_floor(captions: torch.Tensor) -> float:
    """The lowest contrastive loss a batch allows: a caption that occurs n times in it matches
    n images equally well (and its image n equal captions), so the best a model can do for that
    pair is probability 1/n, a loss of ln n. The mean of ln n over the batch's pairs."""
    _, inverse, counts = torch.unique(captions, dim=0, return_inverse=True, return_counts=True)
    return counts[inverse].double().log().mean().item()


def expected_loss_floor(batch: int, distinct: int) -> float:
    """`loss_floor` expected for `batch` pairs drawn uniformly from `distinct` captions: the
    count of a pair's caption is 1 + Binomial(batch − 1, 1/distinct)."""
    import math

    p = 1 / distinct
    return sum(math.comb(batch - 1, k) * p ** k * (1 - p) ** (batch - 1 - k) * math.log(1 + k)
               for k in range(batch))


def shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous b = B / world rows of a global batch."""
    return x.chunk(world)[rank]
