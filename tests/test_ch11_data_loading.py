"""Chapter 11: sampler shards are disjoint and cover the data; set_epoch reshuffles; memmap
windows equal the source tokens; the loader benchmark yields the same batches in every setting.

The expected shards are computed here from DistributedSampler's documented rule (shuffle with
seed + epoch, pad by repeating the head or drop the tail, stride by the world size), not from
the chapter's code, and broken samplers must fail the chapter's own check.
"""

from __future__ import annotations

import math
import pickle
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from chapters.ch11_data_loading import benchmark, train
from chapters.ch11_data_loading.datasets import (
    AugmentedImages,
    CachedDataset,
    TokenWindows,
    ensure_tokens,
    read_tokens,
)
from chapters.ch11_data_loading.sampling import (
    NoEpochSampler,
    ShardSampler,
    WrongStrideSampler,
    check_shards,
    epoch_shards,
)
from common.checkpoint import load_checkpoint
from common.data import CharTokenizer, text_corpus
from common.launch import run_python, run_torchrun

SEED = 7


def documented(n: int, world: int, drop_last: bool, epoch: int) -> tuple[list[int], list[int]]:
    """(the shuffled permutation, the padded-or-trimmed list the ranks stride over)."""
    g = torch.Generator()
    g.manual_seed(SEED + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    if drop_last:
        return perm, perm[:(n // world) * world]
    total = math.ceil(n / world) * world
    return perm, (perm * world)[:total]


def torch_shards(n: int, world: int, drop_last: bool, epoch: int) -> list[list[int]]:
    return epoch_shards(lambda r: DistributedSampler(range(n), num_replicas=world, rank=r,
                                                     seed=SEED, drop_last=drop_last), world, epoch)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [11, 12, 203])
def test_shards_are_disjoint_and_cover_the_data(world, drop_last, n):
    for epoch in (0, 1):
        shards = torch_shards(n, world, drop_last, epoch)
        perm, listed = documented(n, world, drop_last, epoch)
        assert [listed[r::world] for r in range(world)] == shards
        assert len({len(s) for s in shards}) == 1, "equal shard sizes, or DDP ranks desynchronise"
        counts = Counter(i for s in shards for i in s)
        repeated = sorted(i for i, c in counts.items() for _ in range(c - 1))
        if drop_last:
            assert repeated == [], "without padding nothing repeats"
            assert sorted(set(range(n)) - set(counts)) == sorted(perm[len(listed):])  # the tail
            assert len(perm) - len(listed) == n % world
        else:
            assert set(counts) == set(range(n)), "padding: every index is read"
            assert repeated == sorted(perm[:len(listed) - n])  # exactly the head, repeated
        verdict = check_shards(shards, n, drop_last)
        assert verdict["ok"] and verdict["repeats"] == len(repeated)
        hand = epoch_shards(lambda r: ShardSampler(n, world, r, seed=SEED, drop_last=drop_last),
                            world, epoch)
        assert hand == shards, "the hand-written sampler equals DistributedSampler"
        assert [len(ShardSampler(n, world, r, drop_last=drop_last)) for r in range(world)] == \
            [len(s) for s in shards]


def test_set_epoch_reshuffles_and_the_same_epoch_reproduces():
    n, world = 203, 2
    e0, e1 = torch_shards(n, world, False, 0), torch_shards(n, world, False, 1)
    assert e0 != e1
    assert torch_shards(n, world, False, 1) == e1  # a fresh sampler at epoch 1: same order
    sampler = DistributedSampler(range(n), num_replicas=world, rank=0, seed=SEED)
    assert list(sampler) == list(sampler) == e0[0], "without set_epoch every epoch repeats"
    # Negative control: a sampler that forgets the epoch passes the cover check but not this one.
    broken = [epoch_shards(lambda r: NoEpochSampler(n, world, r, seed=SEED), world, e) for e in (0, 1)]
    assert check_shards(broken[1], n, False)["ok"]
    assert broken[0] == broken[1], "the broken sampler must not reshuffle"


@pytest.mark.parametrize("world, drop_last", [(3, False), (4, False), (4, True)])
def test_a_wrong_stride_sampler_is_rejected(world, drop_last):
    for n in (11, 203):
        shards = epoch_shards(lambda r, n=n: WrongStrideSampler(n, world, r, seed=SEED,
                                                                drop_last=drop_last), world, 0)
        verdict = check_shards(shards, n, drop_last)
        assert not verdict["ok"], f"wrong stride went unnoticed: {verdict}"
    # ... and a sampler that does not shard at all (every rank reads everything).
    unsharded = [list(range(11))] * world
    assert not check_shards(unsharded, 11, drop_last)["ok"]


def test_memmap_windows_equal_the_source_tokens(tmp_path):
    path = ensure_tokens(str(tmp_path / "missing.bin"), tmp_path / "built")  # builds it offline
    assert path == tmp_path / "built" / "tokens.bin"
    text = text_corpus()
    tokens = CharTokenizer.fit(text).encode(text)  # computed here, independently of the file
    assert torch.equal(read_tokens(path).long(), tokens)
    block = 16
    ds = TokenWindows(path, block)
    assert len(ds) == (len(tokens) - 1) // block
    for i in (0, 1, 1234, len(ds) - 1):
        j, x, y = ds[i]
        assert j == i and x.dtype == torch.int64
        assert torch.equal(x, tokens[i * block:(i + 1) * block])
        assert torch.equal(y, tokens[i * block + 1:(i + 1) * block + 1])
    assert len(TokenWindows(path, block, max_windows=50)) == 50
    # Negative control: windows cut with the stride block+1 (a classic off-by-one) are caught.
    broken = TokenWindows(path, block + 1)
    _, bx, _ = broken[7]
    assert not torch.equal(bx[:block], tokens[7 * block:8 * block])
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned worker receives: a path, no map
    assert clone._tokens is None and torch.equal(clone[5][1], ds[5][1])
    with pytest.raises(ValueError):
        TokenWindows(path, len(tokens))


def test_cache_returns_the_same_items():
    base = AugmentedImages(6, size=8, work=1, seed=3)
    cached = CachedDataset(base)
    for _ in range(2):
        for i in range(6):
            assert torch.equal(cached[i][0], base[i][0])
    assert len(cached.cache) == 6


@pytest.mark.timeout(120)
def test_torchrun_ranks_read_disjoint_shards_that_cover_the_data(tmp_path):
    res = run_torchrun(Path(train.__file__), nproc=2, args=["--num-workers", "1"],
                       out_dir=tmp_path, timeout=100)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    saved = load_checkpoint(tmp_path / "indices.pt")
    cfg = train.Config()
    n = saved["n"]
    assert n == cfg.windows
    for epoch, shards in enumerate(saved["orders"]):
        assert shards == torch_shards_seeded(n, 2, cfg.seed, epoch)
        assert set(shards[0]) | set(shards[1]) == set(range(n))
        assert sum(map(len, shards)) - n == 1  # 203 windows on 2 ranks: one padded repeat
    assert saved["orders"][0] != saved["orders"][1]
    assert res.check("memmap windows == source tokens (mismatches)")["measured"] == 0


def torch_shards_seeded(n: int, world: int, seed: int, epoch: int) -> list[list[int]]:
    return epoch_shards(lambda r: DistributedSampler(range(n), num_replicas=world, rank=r,
                                                     seed=seed), world, epoch)


@pytest.mark.timeout(120)
def test_benchmark_same_batches_in_every_setting(tmp_path):
    res = run_python(Path(benchmark.__file__), out_dir=tmp_path, timeout=100,
                     args=["--workers", "0", "1", "--items", "32", "--batch-size", "8",
                           "--repeats", "1", "--compute-ms", "2"])
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    names = [c["name"] for c in res.summary["checks"]]
    for w in (0, 1):
        for pin in (False, True):
            assert f"same batches: workers={w} pin={pin}" in names
            assert res.summary["figures"][f"samples/s, workers={w} pin={pin}"]["measured"] > 0
    assert "same batches: cached dataset" in names
    pinned = res.check("pinned batches, workers=1")
    assert pinned["expected"] == (4 if torch.cuda.is_available() else 0)


def test_bad_input_is_refused_in_one_sentence():
    for cls, argv in ((train.Config, ["--batch-size", "0"]), (train.Config, ["--windows", "-1"]),
                      (benchmark.Config, ["--workers", "-1"]), (benchmark.Config, ["--items", "0"])):
        with pytest.raises(SystemExit) as e:
            train.parse_config(cls, argv)
        assert e.value.code == 2
