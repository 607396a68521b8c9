"""Write the course's offline text data to files: the corpus, its tokenizer and its tokens.

    python data/build.py                # -> data/cache/corpus.txt, tokenizer.json, tokens.bin
    python data/build.py --out DIR

Nothing is downloaded: the text ships with Python (see data/README.md). Scripts build the same
data in memory from `common.data`, so running this is optional; chapters that stream tokens from
disk (memory-mapped datasets, chapter 11) read the files it writes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common.data import CharTokenizer, text_corpus


def build(out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    text = text_corpus()
    tokenizer = CharTokenizer.fit(text)
    paths = {"corpus": out / "corpus.txt", "tokenizer": out / "tokenizer.json",
             "tokens": out / "tokens.bin"}
    paths["corpus"].write_text(text)
    tokenizer.save(paths["tokenizer"])
    tokenizer.encode(text).to(torch.int16).numpy().tofile(paths["tokens"])  # vocab < 32768
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "cache",
                        help="output folder (default: data/cache)")
    for name, path in build(parser.parse_args().out).items():
        print(f"{name:9s} {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
