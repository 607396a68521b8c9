"""A byte-level BPE tokenizer trained offline on the course corpus (Hugging Face `tokenizers`).

Byte-level BPE (GPT-2, Llama 3) starts from the 256 byte values, so every string, in any script,
encodes without an unknown token and decodes back to itself; training merges the most frequent
adjacent pair of symbols until the vocabulary reaches its configured size.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch

from common.data import text_corpus

END_OF_TEXT = "<|endoftext|>"


def corpus_split(val_fraction: float = 0.1) -> tuple[str, str]:
    """The course corpus (pydoc's help topics, ships with Python) cut into a training text and a
    held-out tail, at a paragraph boundary."""
    text = text_corpus()
    cut = text.rfind("\n\n", 0, int(len(text) * (1 - val_fraction)))
    return text[:cut], text[cut + 2:]


def paragraphs(text: str, size: int = 4096):
    """The text in chunks of about `size` characters cut at blank lines (the trainer's input)."""
    start = 0
    while start < len(text):
        end = text.find("\n\n", start + size)
        end = len(text) if end < 0 else end
        yield text[start:end]
        start = end


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer with `vocab_size` entries: 256 bytes, one special token
    (end of text) and vocab_size − 257 merges learnt from `text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(paragraphs(text), trainer)
    return tok


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def tokenizer_from_json(text: str):
    """The tokenizer a `Tokenizer.to_str()` described (what rank 0 sends the other ranks)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(text)


def encode(tok, text: str) -> torch.Tensor:
    """Token ids of `text` as a 1-D int64 tensor."""
    return torch.tensor(tok.encode(text).ids, dtype=torch.long)


def round_trips(tok, text: str) -> bool:
    """Does decode(encode(text)) give `text` back, byte for byte?"""
    return tok.decode(tok.encode(text).ids) == text


def unigram_entropy(ids: torch.Tensor) -> float:
    """Entropy in nats of the token frequencies: the loss of the best model that ignores context
    (it predicts every token with its corpus frequency)."""
    counts = Counter(ids.tolist())
    n = len(ids)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def chars_per_token(tok, text: str) -> float:
    return len(text) / len(tok.encode(text).ids)


def shared_tokenizer(vocab_size: int, out: Path, is_main: bool):
    """Rank 0 trains the tokenizer and saves it in `out` (for export); every other rank gets it
    from rank 0 over the process group, so that no node needs to read rank 0's disk for it.
    Returns the tokenizer, the encoded training and held-out text, and the held-out text."""
    import torch.distributed as dist

    from common.log import log

    train_text, val_text = corpus_split()
    box = [None]
    if is_main:
        log.info("training a byte-level BPE tokenizer, %d entries, on %d characters",
                 vocab_size, len(train_text))
        out.mkdir(parents=True, exist_ok=True)
        tok = train_tokenizer(train_text, vocab_size)
        tok.save(str(out / "tokenizer.json"))
        box = [tok.to_str()]
    dist.broadcast_object_list(box, src=0)  # every rank reaches it
    tok = tokenizer_from_json(box[0])
    return tok, encode(tok, train_text), encode(tok, val_text), val_text
