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

from chapters.ch11_data_loading import benchmark, datasets, train
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


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_fewer_samples_than_ranks(world, drop_last):
    """3 samples on 4 or 8 ranks, as torch's DistributedSampler really shards them. Padding:
    one sample per rank, ranks 0-2 read the permutation and every later rank reads only padding
    (the permutation again, cyclically). drop_last: num_samples = ceil((n - W) / W) = 0, so every
    rank gets nothing and the epoch is empty (train.py refuses --drop-last there). The hand
    sampler and check_shards agree with torch in both cases."""
    n = 3
    for epoch in (0, 1):
        shards = torch_shards(n, world, drop_last, epoch)
        perm, listed = documented(n, world, drop_last, epoch)
        if drop_last:
            assert shards == [[]] * world and listed == []
            assert len(DistributedSampler(range(n), num_replicas=world, rank=0, drop_last=True)) == 0
        else:
            assert shards == [[perm[r % n]] for r in range(world)]
            padding_only = [s for r, s in enumerate(shards) if r >= n]
            assert len(padding_only) == world - n and all(s[0] in perm for s in padding_only)
            assert Counter(i for s in shards for i in s) == Counter(perm * (world // n) +
                                                                    perm[:world % n])
        verdict = check_shards(shards, n, drop_last)
        assert verdict["ok"] and verdict["per_rank"] == (0 if drop_last else 1)
        assert (verdict["repeats"], verdict["missing"]) == ((0, n) if drop_last else (world - n, 0))
        hand = epoch_shards(lambda r: ShardSampler(n, world, r, seed=SEED, drop_last=drop_last),
                            world, epoch)
        assert hand == shards
        expected = [[p] for p in listed[:world]] if not drop_last else [[]] * world
        assert train.shard_mismatches(shards, expected, len(expected[0])) == 0
    # Negative control: the node-local stride on 4 ranks misses a sample at this size too.
    if not drop_last:
        wrong = epoch_shards(lambda r: WrongStrideSampler(n, world, r, seed=SEED), world, 0)
        assert not check_shards(wrong, n, False)["ok"]
    if drop_last:
        with pytest.raises(ValueError, match=f"--windows 3 cannot be split over {world} ranks"):
            train.validate(train.Config(windows=n, drop_last=True), world)
    else:
        train.validate(train.Config(windows=n), world)  # padding gives every rank one window


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
    path, built = ensure_tokens(str(tmp_path / "missing.bin"), tmp_path / "built")  # builds offline
    assert path == tmp_path / "built" / "tokens.bin" and built
    assert ensure_tokens(str(tmp_path / "missing.bin"), tmp_path / "built") == (path, False)
    assert not list((tmp_path / "built").glob(".build-*")), "the private build folder is removed"
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


class UnseededImages(AugmentedImages):
    """Broken on purpose: augments with torch's global generator instead of one seeded per
    item, so a batch depends on when (and in which worker) it was made."""

    def __getitem__(self, i: int):
        return datasets.augment(self.images[i], torch.default_generator, self.work), self.labels[i]


def test_same_batches_come_from_per_item_seeds():
    """The benchmark's "same batches" parity holds because augmentation is seeded per item; a
    dataset drawing from the global generator gives other batches on a second read, and the
    same comparison (max |difference|) rejects it."""
    from torch.utils.data import DataLoader

    cpu = torch.device("cpu")
    for cls, same in ((AugmentedImages, True), (UnseededImages, False)):
        loader = DataLoader(cls(12, size=8, work=1, seed=3), batch_size=5)
        first, second = benchmark.read_epoch(loader, cpu), benchmark.read_epoch(loader, cpu)
        assert first["batches"] == second["batches"] == 3  # 12 items in batches of 5: 5, 5, 2
        assert ((first["images"] - second["images"]).abs().max().item() == 0.0) == same, cls


def test_stall_formula_and_measurement():
    """expected_stall against numbers worked by hand; the measured stall counts batches, not
    items / batch size (a last, short batch is one step too)."""
    cfg = benchmark.Config(batch_size=16, compute_ms=10.0)
    zero = {"samples_s": 800.0}  # t_d = 16 / 800 = 20 ms per batch, t_c = 10 ms
    assert benchmark.expected_stall(0, 2, cfg, zero) == pytest.approx(20 / 30)
    assert benchmark.expected_stall(1, 2, cfg, zero) == pytest.approx(1 - 10 / 20)
    assert benchmark.expected_stall(2, 2, cfg, zero) == 0.0   # 2 t_c >= t_d: no stall
    assert benchmark.expected_stall(4, 1, cfg, zero) == pytest.approx(0.5)  # one core: as 1 worker
    assert benchmark.expected_stall(2, 2, cfg, None) is None
    assert benchmark.stall_fraction(0.03, 3, 0.01) == pytest.approx(0.5)


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
    assert res.check("windows compared with the source tokens")["measured"] == 2 * 102  # 2 epochs
    assert res.summary["figures"]["pin_memory"]["measured"] == (
        True if torch.cuda.is_available() else "n/a on CPU")
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
    pins = (False, True) if torch.cuda.is_available() else (False,)  # pinning needs CUDA
    for w in (0, 1):
        for pin in pins:
            assert f"same batches: workers={w} pin={pin}" in names
            fig = res.summary["figures"][f"samples/s, workers={w} pin={pin}"]
            assert 0 < fig["spread"][0] <= fig["measured"] <= fig["spread"][1]  # one run, its spread
    assert "same batches: cached dataset" in names
    if torch.cuda.is_available():
        assert res.check("pinned batches, workers=1 pin=True")["expected"] == 4
    else:  # a technique that does nothing here is a figure, not a passing check
        assert res.summary["figures"]["pin_memory"]["measured"] == "n/a on CPU"
        assert not [n for n in names if n.startswith("pinned batches")]


def test_bad_input_is_refused_in_one_sentence():
    for cls, argv in ((train.Config, ["--batch-size", "0"]), (train.Config, ["--windows", "-1"]),
                      (benchmark.Config, ["--workers", "-1"]), (benchmark.Config, ["--items", "0"])):
        with pytest.raises(SystemExit) as e:
            train.parse_config(cls, argv)
        assert e.value.code == 2


# --- the token file on several nodes, shard comparison, validate, exercise numbers -------------

def _prepare_on_two_nodes(tmp: str) -> dict:
    """4 gloo ranks as 2 nodes x 2 ranks, each node with its own disk (its own folder): the
    chapter's rule, then the old one (global rank 0 builds) as the negative control."""
    import torch.distributed as dist

    rank = dist.get_rank()
    node, local_rank = divmod(rank, 2)
    out = {}
    for rule in ("local rank 0", "global rank 0"):
        cfg = train.Config(tokens=str(Path(tmp) / "missing.bin"))
        disk = Path(tmp) / rule.replace(" ", "_") / f"node{node}"
        if rule == "local rank 0":
            path, built = train.prepare_tokens(cfg, local_rank, disk)
        else:
            built = False
            if rank == 0:
                path, built = ensure_tokens(cfg.tokens, disk / "data")
            dist.barrier()
            if rank:
                path, built = ensure_tokens(cfg.tokens, disk / "data")
        out[rule] = (str(path), built, int(read_tokens(path).numel()))
    return out


@pytest.mark.timeout(120)
def test_each_node_builds_the_token_file_once(tmp_path):
    from common.launch import run_on_ranks

    n_tokens = len(CharTokenizer.fit(text_corpus()).encode(text_corpus()))
    results = run_on_ranks(_prepare_on_two_nodes, 4, str(tmp_path), timeout=100)
    mine = [r["local rank 0"] for r in results]
    assert [built for _, built, _ in mine] == [True, False, True, False]  # local rank 0 per node
    assert all(path.endswith(f"node{r // 2}/data/tokens.bin") and size == n_tokens
               for r, (path, _, size) in enumerate(mine))
    # Negative control: with the old rule nobody builds on the second node before the barrier,
    # so both of its ranks find the file missing and build it (the same check rejects it).
    old = [r["global rank 0"] for r in results]
    assert [built for _, built, _ in old] == [True, False, True, True]


def test_shard_comparison_catches_wrong_and_missing_indices():
    expected = [[3, 1, 4], [0, 2, 5]]
    assert train.shard_mismatches([[3, 1, 4], [0, 2, 5]], expected, 3) == 0
    assert train.shard_mismatches([[3, 1], [0, 2]], expected, 2) == 0   # --steps capped the epoch
    assert train.shard_mismatches([[3, 1], [0, 2, 5]], expected, 3) == 1  # a rank read too few
    assert train.shard_mismatches([[3, 1, 4, 4], [0, 2, 5]], expected, 3) == 1  # too many
    assert train.shard_mismatches([[3, 1, 4], [0, 5, 2]], expected, 3) == 1  # other indices
    with pytest.raises(ValueError):
        train.shard_mismatches([[3, 1, 4]], expected, 3)  # a rank missing altogether


def test_validate_refuses_drop_last_without_a_window_per_rank():
    for world in (1, 2, 3, 4, 8, 16):
        train.validate(train.Config(), world)
        train.validate(train.Config(drop_last=True), world)
        benchmark.validate(benchmark.Config(), world)
    with pytest.raises(ValueError, match="--windows 2 cannot be split over 3 ranks with --drop-last"):
        train.validate(train.Config(windows=2, drop_last=True), 3)
    train.validate(train.Config(windows=2), 3)  # padding repeats a window instead


def test_exercise_answers():
    # 1. 203 windows on 3 ranks, seed 0: 68 per rank with padding, window pi[0] read twice;
    #    67 with --drop-last, the last two of pi never read (epoch 0; epoch 1 reshuffles).
    for epoch, twice, unread in ((0, [123], [0, 21]), (1, [49], [78, 183])):
        padded = torch_shards_seeded(203, 3, 0, epoch)
        counts = Counter(i for s in padded for i in s)
        assert [len(s) for s in padded] == [68] * 3
        assert sorted(i for i, c in counts.items() if c == 2) == twice
        dropped = epoch_shards(lambda r, e=epoch: DistributedSampler(
            range(203), num_replicas=3, rank=r, seed=0, drop_last=True), 3, epoch)
        assert [len(s) for s in dropped] == [67] * 3
        assert sorted(set(range(203)) - {i for s in dropped for i in s}) == unread
    # 5. Windows with stride 1 over the corpus: N - b of them instead of (N - 1) // b.
    n = len(CharTokenizer.fit(text_corpus()).encode(text_corpus()))
    assert (n, (n - 1) // 32, n - 32) == (465_047, 14_532, 465_015)
