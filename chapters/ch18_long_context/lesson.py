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
# # Chapter 18 · Sequence parallelism and long context · 序列并行与长上下文训练
#
# Every rank holds T/N tokens of each sequence; only attention needs the others. Ring attention
# passes key/value blocks around the ranks and merges partial softmaxes; Ulysses swaps sequence
# sharding for head sharding with an all-to-all. This notebook checks the merge rule in one
# process, counts the causal work of the two splits, compares the bytes of the two methods, and
# runs the real thing on two processes. The lesson is
# [chapters/ch18_long_context/README.md](../chapters/ch18_long_context/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch18_long_context import layouts, ring, ulysses
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The merge rule: softmax over two blocks from the two halves
# `block_forward` returns, for each query, the output normalised within one key block and the
# block's log-sum-exp. Weighting each partial output by exp(lse_block − lse_total) gives the
# softmax over both blocks exactly; adding them unweighted does not.

# %%
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
scale = 4 ** -0.5
full = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
o1, l1, _ = ring.block_forward(q, k[..., :4, :], v[..., :4, :], [0, 1], [0, 1], scale, causal=False)
o2, l2, _ = ring.block_forward(q, k[..., 4:, :], v[..., 4:, :], [0, 1], [2, 3], scale, causal=False)
lse = torch.logaddexp(l1, l2)
merged = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
print("merged with weights, max error:", (merged - full).abs().max().item())
print("added without weights, max error:", (o1 + o2 - full).abs().max().item())

# %% [markdown]
# ## The ring, forward
# The send of the next block starts before this block's product; the merge follows; the wait
# comes last. Backward (in the same class) passes K/V again and the dK/dV accumulators one hop
# behind, each waited for after the next block's product (only the last hop is waited at once).

# %%
print(inspect.getsource(ring.RingAttention.forward))

# %% [markdown]
# ## Causal work: contiguous against zigzag
# Chunk products per rank, by the formula (the script counts them and checks the counts).

# %%
for world in (2, 4, 8):
    for layout in layouts.LAYOUTS:
        counts = ring.causal_products_per_rank(world, layout)
        print(f"N={world} {layout:10s} {counts}  max/mean = {max(counts) * world / sum(counts):.2f}")

# %% [markdown]
# ## Why smaller blocks ran faster per score on a CPU
# One rank's score block is B·H·c·2c·e bytes (c = T/2N). Timed alone on one thread, a block that
# fits the last-level cache (32 MiB where the lesson ran) costs less per score than one that streams
# through memory. The lesson sets this beside its "4 ranks on 2 cores, 3.4 times faster": the gain
# appears at N = 4's block size, where the run beats cores × work; how much of it the run keeps
# is not measured.

# %%
import time

threads = torch.get_num_threads()
torch.set_num_threads(1)
for c in (192, 48):
    qb, kb, vb = (torch.randn(2, 48, 2 * c, 4, dtype=torch.float64) for _ in range(3))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        ring.block_forward(qb, kb, vb, [0, 1], [0, 1], 0.5, causal=False)
        times.append(time.perf_counter() - t0)
    print(f"c = {c:3d}: score block {2 * 48 * c * 2 * c * 8 / 2**20:5.1f} MiB, "
          f"{min(times) / (2 * 48 * 4 * c * c) * 1e9:5.1f} ns per score (best of 3)")
torch.set_num_threads(threads)

# %% [markdown]
# ## Bytes per rank: ring against Ulysses
# One layer, forward + backward, B = 1, 32 heads of 128, bf16, T = 128k tokens.

# %%
T, B, H, D, e = 131072, 1, 32, 128, 2
worlds = [2, 4, 8, 16, 32]
ring_gib = [sum(ring.ring_bytes_per_rank(B, H, T // n, D, e, n).values()) / 2**30 for n in worlds]
uly_gib = [sum(ulysses.ulysses_bytes_per_rank(B, H, T // n, D, e, n).values()) / 2**30 for n in worlds]
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(worlds, ring_gib, "o-", label="ring")
ax.plot(worlds, uly_gib, "s--", label="Ulysses")
ax.set_xscale("log", base=2)
ax.set_xlabel("ranks N")
ax.set_ylabel("GiB sent per rank per layer")
ax.legend()
plt.show()

# %% [markdown]
# ## The real run: two processes
# Every parity, byte, product and activation check of the lesson, and the sequence-parallel
# TinyGPT against one process.

# %%
out = REPO_ROOT / "runs" / "notebooks" / "ch18"
res = run_torchrun(REPO_ROOT / "chapters" / "ch18_long_context" / "train.py", nproc=2, out_dir=out, timeout=300)
summary = json.loads((out / "summary.json").read_text())
for c in summary["checks"]:
    print(f"{c['name']:45s} {str(c['measured']):>22s}  {'ok' if c['ok'] else 'FAIL'}")
