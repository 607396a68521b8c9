# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 11 · Data loading · 数据加载优化
#
# A data-parallel job is only as fast as its slowest loader, and only as correct as its
# sampler: every rank must read a different shard, all shards together must cover the data,
# and each epoch must be shuffled anew. This notebook takes `DistributedSampler` apart, reads
# token windows from a memory-mapped file, times a loader, and then runs two ranks that prove
# their shards are disjoint and cover the data.
# The lesson is [chapters/ch11_data_loading/README.md](../chapters/ch11_data_loading/README.md).

# %%
import inspect
import json
import time

import matplotlib.pyplot as plt
import torch
from torch.utils.data import DataLoader, DistributedSampler

from chapters.ch11_data_loading import benchmark, datasets, sampling
from common.checkpoint import load_checkpoint
from common.data import CharTokenizer
from common.launch import run_torchrun
from common.results import REPO_ROOT
from common.timing import benchmark as time_it

torch.set_num_threads(1)

# %% [markdown]
# ## DistributedSampler: pad, stride, reshuffle
# A sampler takes `num_replicas` and `rank` explicitly, so we can ask it for every rank's shard
# in one process. 11 items on 4 ranks: 11 is not a multiple of 4, so the sampler pads the
# shuffled list by repeating its head (one item is read twice) or, with `drop_last=True`,
# drops the tail (one item is not read this epoch).

# %%
for drop_last in (False, True):
    shards = sampling.epoch_shards(
        lambda r, d=drop_last: DistributedSampler(range(11), num_replicas=4, rank=r, seed=0, drop_last=d),
        4, 0)
    print(f"drop_last={drop_last}:", shards, sampling.check_shards(shards, 11, drop_last))

# %% [markdown]
# The hand-written sampler does the same in three steps, shuffle with `seed + epoch`, pad or
# trim, stride by the world size:

# %%
print(inspect.getsource(sampling.shuffled_indices))
print(inspect.getsource(sampling.shard))

# %% [markdown]
# `set_epoch` changes the seed of the shuffle. Forget it and every epoch reads the same order:

# %%
fixed = DistributedSampler(range(11), num_replicas=4, rank=0, seed=0)
moving = DistributedSampler(range(11), num_replicas=4, rank=0, seed=0)
for epoch in range(3):
    moving.set_epoch(epoch)
    print(f"epoch {epoch}: rank 0 reads {list(fixed)} without set_epoch, {list(moving)} with it")

# %% [markdown]
# ## A memory-mapped token dataset
# `data/build.py` writes the course corpus as int16 tokens. `TokenWindows` maps the file and
# slices window i as `tokens[i*block : i*block + block + 1]`; only the pages a window touches
# are read. The map is opened lazily, so a DataLoader worker receives a path, not a map.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch11"
path, _ = datasets.ensure_tokens(REPO_ROOT / "data" / "cache" / "tokens.bin", out_dir / "data")
tokenizer = CharTokenizer.load(path.parent / "tokenizer.json")
windows = datasets.TokenWindows(path, block_size=48)
i, x, y = windows[100]
print(f"{len(windows)} windows; window {i}:")
print("x:", repr(tokenizer.decode(x)))
print("y:", repr(tokenizer.decode(y)))

# %% [markdown]
# ## Where a loader stalls
# With `num_workers=0` the training loop itself decodes and augments every item, so the
# step waits. Caching the items removes that cost from the second epoch on (but each worker
# process keeps its own cache). Worker processes run in the benchmark script, not here:
# a notebook kernel is a poor parent for them.

# %%
images = datasets.AugmentedImages(64, size=32, work=4)
for name, ds in (("decode + augment", images), ("cached", datasets.CachedDataset(images))):
    loader = DataLoader(ds, batch_size=16)
    stats = time_it(lambda loader=loader: benchmark.read_epoch(loader, torch.device("cpu")),
                    warmup=1, repeats=3)
    print(f"{name:17s} {len(ds) / stats.median:9.0f} samples/s   ({stats})")

# %% [markdown]
# The benchmark over `num_workers` (`python chapters/ch11_data_loading/benchmark.py`) drew this
# figure in five runs in a row on a shared 2-core machine without CUDA (each point: the median
# and min-max of three epochs; each run labelled with the machine's 1-minute load average
# before and after it, because other jobs decide how many cores the workers get);
# `pin_memory` needs CUDA, so there it is off and reported "n/a on CPU". With 0 workers the stall
# matches t_d / (t_c + t_d) closely; the benchmark prints theory and measurement side by side:

# %%
print(inspect.getsource(benchmark.expected_stall))

# %%
plt.figure(figsize=(6, 3.4))
plt.imshow(plt.imread(REPO_ROOT / "chapters/ch11_data_loading/figures/loader_throughput.png"))
plt.axis("off")
plt.show()

# %% [markdown]
# ## The real run: two ranks, one memory map, disjoint shards
# Each rank reads its shard through `DataLoader` + `DistributedSampler` (add
# `"--num-workers", "1"` to read through a worker process), trains a bigram model data-parallel, and after each epoch the ranks all-gather the
# indices they read.

# %%
start = time.perf_counter()
result = run_torchrun(REPO_ROOT / "chapters/ch11_data_loading/train.py", nproc=2,
                      out_dir=out_dir / "train")
print(result.output[result.output.index("figure"):])
print(f"({time.perf_counter() - start:.1f} s)")

# %%
orders = load_checkpoint(out_dir / "train" / "indices.pt")["orders"]
fig, ax = plt.subplots(figsize=(7, 2))
for epoch, shards in enumerate(orders):
    for rank, shard in enumerate(shards):
        ax.scatter(shard, [epoch + 0.15 * rank] * len(shard), s=4, label=f"rank {rank}" if epoch == 0 else None)
ax.set_yticks([0, 1], ["epoch 0", "epoch 1"])
ax.set_xlabel("window index")
ax.legend(fontsize=8)
plt.show()

# %%
steps = [json.loads(line) for line in (out_dir / "train" / "metrics.jsonl").read_text().splitlines()]
plt.figure(figsize=(5, 3))
plt.plot([s["step"] for s in steps], [s["loss"] for s in steps], marker="o")
plt.xlabel("step")
plt.ylabel("bigram loss (nats)")
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run `train.py` on 3 ranks with and without `--drop-last`. Which windows are read twice,
#    which not at all? Predict the numbers from the formulas first.
# 2. Comment out `sampler.set_epoch(epoch)` in `train.py`'s `main`. Which check fails?
# 3. Run the benchmark with `--start-method spawn --no-persistent-workers`. How much does
#    starting a worker cost per epoch?
# 4. Find the `--work` at which 2 workers stop removing the stall of a 10 ms step. Does the
#    measured stall match $t_d/(t_c+t_d)$ for 0 workers?
# 5. Make `TokenWindows` overlapping (stride 1 instead of `block_size`): how many windows are
#    there, and what does an epoch mean then?
#
# The lesson's exercises come with hints and worked answers.
