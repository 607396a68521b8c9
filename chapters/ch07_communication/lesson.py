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
# # Chapter 07 · Collectives and NCCL · 通信优化基础
#
# Every parallel technique of chapters 03–06 talks through a handful of collectives. This
# notebook opens them up: a ring all-reduce written with send/recv, the α–β cost model that
# predicts its time, and a real benchmark on two processes that prints algorithm and bus
# bandwidth the way nccl-tests does. The lesson is
# [chapters/ch07_communication/README.md](../chapters/ch07_communication/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt

from chapters.ch07_communication import collectives, cost_model, plots
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The ring schedule
# With n ranks the tensor is cut into n chunks. In the reduce-scatter phase each rank sends one
# chunk to its right neighbour and adds the chunk arriving from its left, n−1 times; then the
# all-gather phase passes the finished chunks around, n−1 times more. Which chunk each rank
# sends and receives at each step, for 4 ranks:

# %%
for step, moves in enumerate(collectives.ring_schedule(4)):
    phase = "reduce-scatter" if step < 3 else "all-gather"
    print(f"step {step} ({phase:14s}):", "  ".join(f"r{r}: send {s} recv {v}" for r, (s, v) in enumerate(moves)))

# %% [markdown]
# The reduce-scatter phase in code: `exchange` posts the receive and the send together
# (`batch_isend_irecv`), because every rank sends in the same step and blocking sends could wait
# on each other forever. The receive goes first: under gloo over TCP, the send posted first made
# a ring step take about twice bytes ÷ rate (measured in chapter 22).

# %%
print(inspect.getsource(collectives.ring_reduce_scatter_))
print(inspect.getsource(collectives.P2P.exchange))

# %% [markdown]
# ## Bytes on the wire
# Each rank sends every chunk but one in each phase: 2(n−1)/n·S bytes, almost independent of n.
# The naive all-reduce makes rank 0 send (n−1)·S. For S = 1 MiB of float32:

# %%
S = 2**20
for n in (2, 4, 8, 64):
    ring = collectives.expected_bytes_sent("ring", S // 4, n, 0, 4) / S
    naive = collectives.expected_bytes_sent("naive", S // 4, n, 0, 4) / S
    print(f"n = {n:3d}: ring {ring:.3f}·S per rank   naive rank 0 {naive:.0f}·S")

# %% [markdown]
# ## From algorithm bandwidth to bus bandwidth
# nccl-tests multiplies algbw = S/t by the share of S each rank's link must carry, so that one
# number can be held against the hardware whatever the collective and the world size:

# %%
for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
    factors = "  ".join(f"n={n}: {cost_model.bus_factor(op, n):.3f}" for n in (2, 4, 8, 64))
    print(f"{op:15s} busbw/algbw  {factors}")

# %% [markdown]
# ## The α–β model: ring against trees
# Each message costs α + m·β. The ring takes 2(n−1) steps (latency grows with n) but moves the
# minimum data; NCCL's double binary tree takes about 2·log2(n) steps and, in this model, moves
# 2S per rank, only n/(n−1) times the ring's 2(n−1)/n·S. So the ring wins only above a size that
# grows like n²·α/β, and that size collapses as soon as the tree runs a little below the link's
# bandwidth (η = 0.92 is what NCCL's tuner assumes for a tree all-reduce):

# %%
for n in (8, 64, 512):
    exact, slower = (cost_model.ring_tree_crossover(n, 5e-6, 1 / 25e9, eta) for eta in (1.0, 0.92))
    print(f"n = {n:3d}: ring beats the double tree above {exact / 1e6:10.1f} MB (η = 1), "
          f"{slower / 1e6:7.1f} MB (η = 0.92)")

# %%
sizes = [2.0**k for k in range(3, 33)]
fig, ax = plt.subplots(figsize=(6, 3.3))
for name, bw in plots.model_curves(512, 5e-6, 1 / 25e9, sizes).items():
    ax.plot(sizes, bw, label=name)
ax.set_xscale("log", base=2)
ax.set_xlabel("message size (bytes)")
ax.set_ylabel("predicted busbw (GB/s)")
ax.legend()
plt.show()

# %% [markdown]
# ## Two levels: the hierarchical all-reduce
# Reduce-scatter inside each node, all-reduce one chunk across nodes, all-gather inside the node.
# Bytes each rank sends at each level, for S = 1 MiB of float32 on 2 nodes of 8 ranks, against a
# flat ring's 2(n−1)/n·S, which the rank at each node's border sends entirely across the network:

# %%
print(inspect.getsource(collectives.hierarchical_all_reduce))
n, g = 16, 8
intra, inter = collectives.expected_hierarchical_bytes(S // 4, n, g, 0, 4)
flat = collectives.expected_bytes_sent("ring", S // 4, n, g - 1, 4)
print(f"hierarchy: {intra / S:.3f}·S inside the node, {inter / S:.4f}·S across nodes, per rank")
print(f"flat ring: {flat / S:.4f}·S across nodes from each border rank")
t_flat = cost_model.predicted_time("ring", 2**28, n, 5e-6, 1 / 25e9)
t_hier = cost_model.hierarchical_time(2**28, g, n // g, 2e-6, 1 / 300e9, 5e-6, 1 / 25e9)
print(f"256 MiB, NVLink 300 GB/s inside, 25 GB/s between: flat {t_flat * 1e3:.1f} ms, "
      f"hierarchical {t_hier * 1e3:.2f} ms")

# %% [markdown]
# ## The real run: two processes under torchrun
# The script checks every hand collective against `torch.distributed` (exactly, on integers),
# counts the bytes each rank sends, and then benchmarks each collective over message sizes
# (here a reduced range, 8 B to 64 KiB, to stay quick; the default goes to 8 MiB).

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch07"
result = run_torchrun(REPO_ROOT / "chapters/ch07_communication/train.py", nproc=2, out_dir=out_dir,
                      args=["--max-bytes", "65536", "--steps", "3"])
print(result.output[result.output.index("# all_reduce"):result.output.index("# all_gather")])
print(result.output[result.output.index("α–β fit"):])

# %%
rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
fig, ax = plt.subplots(figsize=(6, 3.3))
plots.draw_bandwidth(ax, rows, "all_reduce")
ax.set_title("all-reduce bus bandwidth, 2 CPU processes")
plt.show()

# %% [markdown]
# busbw = algbw × 2(n−1)/n for all-reduce: with n = 2 it equals algbw. With two ranks tree and
# naive send the very same messages, so any gap between their curves is noise; 4 ranks show them
# differ in bytes (the lesson's 4-process run). On CPU and loopback the curves are noisy (other
# programs share the cores); on GPUs with NVLink the library's curve is expected to climb to
# hundreds of GB/s and the hand ring, which has no pipelining inside a step and no channels, to
# fall far behind it.

# %% [markdown]
# ## Exercises
# The lesson's exercises, each with a hint and a worked answer: try them with this notebook's
# functions (`collectives`, `cost_model`) and the script. For instance exercise 1: run the script
# with 3 and 4 processes and compare the fitted α; exercise 6: `--ranks-per-node 1`, `2`, `4` on
# 4 processes.
