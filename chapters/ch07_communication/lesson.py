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
# The reduce-scatter phase in code: `exchange` posts the send and the receive together
# (`batch_isend_irecv`), because every rank sends first and blocking sends could wait on each
# other forever.

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
# minimum data; NCCL's double binary tree takes about 2·log2(n) steps. At 512 ranks, small
# messages belong to the tree and large ones to the ring.

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
# busbw = algbw × 2(n−1)/n for all-reduce: with n = 2 it equals algbw. On CPU and loopback
# the curves are noisy (other programs share the cores); on GPUs with NVLink the library's
# curve climbs to hundreds of GB/s and the hand ring, which has no pipelining inside a step and
# no channels, falls far behind it.

# %% [markdown]
# ## Exercises
# 1. Run the script with 3 and 4 processes and compare the fitted α: does it grow like 2(n−1)?
# 2. Break `ring_all_gather_` by stopping one step early. Which checks fail?
# 3. Run `broadcast_test.py --size-mib 64` and compare its bus bandwidth with all-reduce's.
