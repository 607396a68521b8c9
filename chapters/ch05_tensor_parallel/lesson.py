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
# # Chapter 05 · Tensor parallelism · 张量并行
#
# Tensor parallelism splits every weight matrix of a layer across the ranks. Megatron-LM's
# trick: split the first linear of a pair by columns and the second by rows, so the pair
# needs a single all-reduce in forward and one in backward. This notebook checks the algebra
# in one process, reads the hand-written operators, and runs the real thing on two
# processes. The lesson is [chapters/ch05_tensor_parallel/README.md](../chapters/ch05_tensor_parallel/README.md).

# %%
import inspect

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from chapters.ch05_tensor_parallel import dtensor_tp, plots, tp_layers
from chapters.ch05_tensor_parallel.block import DenseModel
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## Column then row: why one all-reduce is enough
# Split A (h × 4h) by columns and B (4h × h) by rows over t "ranks". GeLU acts element by
# element, so each rank can apply it to its own columns of X·A without talking to anyone;
# only the final partial products must be summed. Checked here in one process, t = 4:

# %%
torch.manual_seed(0)
t, h = 4, 8
X, A, B = torch.randn(5, h, dtype=torch.float64), torch.randn(h, 4 * h, dtype=torch.float64), torch.randn(4 * h, h, dtype=torch.float64)
dense = F.gelu(X @ A) @ B
partials = [F.gelu(X @ A_r) @ B_r for A_r, B_r in zip(A.chunk(t, dim=1), B.chunk(t, dim=0))]
print("max |sum of partials - dense| =", (sum(partials) - dense).abs().max().item())
row_first = sum(F.gelu(X[:, rows] @ A[rows]) for rows in torch.arange(h).chunk(t)) @ B
print("A split by rows instead (GeLU of partial sums) is off by", (row_first - dense).abs().max().item())

# %% [markdown]
# ## The conjugate operators f and g
# `f` enters the parallel region: identity forward, all-reduce of the input gradient backward
# (each rank's gradient with respect to X covers only its columns of A). `g` leaves it:
# all-reduce forward, identity backward. Each is the other's transpose.

# %%
print(inspect.getsource(tp_layers.CopyToTP))
print(inspect.getsource(tp_layers.ReduceFromTP))

# %% [markdown]
# With sequence parallelism the replicated regions (LayerNorm, dropout, residual) are split
# along the sequence instead: `f` becomes an all-gather (backward: reduce-scatter) and `g` a
# reduce-scatter (backward: all-gather). A ring all-reduce *is* a reduce-scatter followed by an
# all-gather, so the bytes on the wire do not change.

# %%
print(inspect.getsource(tp_layers.GatherFromSP))
print(inspect.getsource(tp_layers.RowParallelLinear))

# %% [markdown]
# ## Which rank holds what
# `shard_state` maps the dense block's weights to one rank's: whole heads of q, k and v (fused
# into one column-parallel matrix), a slice of the MLP's hidden units, and replicated
# LayerNorms and output biases.

# %%
model = DenseModel(d_model=32, n_heads=4, d_ff=128, n_layers=1)
shard = tp_layers.shard_state(model.state_dict(), rank=0, tp=2)
print("dense:", {name: tuple(v.shape) for name, v in model.state_dict().items() if "weight" in name})
print("rank 0 of 2:", {name: tuple(v.shape) for name, v in shard.items() if "weight" in name})

# %% [markdown]
# The same split with DTensor is a plan: one `ParallelStyle` per submodule.

# %%
for name, style in dtensor_tp.block_plan(sequence_parallel=True).items():
    print(f"{name:10s} {type(style).__name__}")

# %% [markdown]
# ## What the layout costs
# Per layer and training step, each rank sends 8(t−1)/t · B·S·h·b bytes on a ring, with or
# without sequence parallelism; sequence parallelism divides the LayerNorm/dropout activations
# by t.

# %%
for t in (2, 4, 8):
    print(f"t={t}: {plots.ring_bytes_per_layer(t, 8, 2048, 4096, 2) / 2**20:7.1f} MiB per rank per layer "
          f"(B=8, S=2048, h=4096, bf16)")

# %% [markdown]
# ## The real run: two processes under torchrun
# The dense block, the hand-written TP block with and without sequence parallelism, and the
# DTensor versions, trained side by side; every check must say `ok`.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch05"
result = run_torchrun(REPO_ROOT / "chapters/ch05_tensor_parallel/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %%
figures = result.summary["figures"]
names = [n.removeprefix("step time, ") for n in figures if n.startswith("step time")]
plt.figure(figsize=(6, 3))
plt.barh(names, [figures[f"step time, {n}"]["measured"] for n in names])
plt.xlabel("ms per training step (median, CPU, reported only)")
plt.gca().invert_yaxis()
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run with `--dtype float32`: how large do the parity differences get?
# 2. Make `RowParallelLinear` add its bias *before* the all-reduce. Which checks fail, by how much?
# 3. Fuse `attn.q`, `attn.k`, `attn.v` into one `nn.Linear` and give it `ColwiseParallel`. Why
#    does the output go wrong even though no error is raised?
