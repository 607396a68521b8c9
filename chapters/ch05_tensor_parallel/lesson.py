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
# in one process, reads the hand-written operators, counts what sequence parallelism saves,
# computes a cross-entropy from vocabulary shards, and runs the real thing on two processes. The lesson is [chapters/ch05_tensor_parallel/README.md](../chapters/ch05_tensor_parallel/README.md).

# %%
import inspect

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from chapters.ch05_tensor_parallel import activations, dtensor_tp, plots, tp_layers, vocab_parallel
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
# What DTensor should communicate per layer in each phase, read from the plan (the script
# checks its CommDebugMode counts against these). Without SP the backward needs 4 all-reduces:
# q, k and v each all-reduce their own input gradient. With SP the LayerNorm gradients come
# out of backward `Partial(sum)` and need a sum ("grad sync").

# %%
for sp in (False, True):
    print("TP+SP" if sp else "TP   ", dtensor_tp.expected_counts(sp))

# %% [markdown]
# ## What the layout costs
# Per layer and training step, each rank sends 8(t−1)/t · B·S·h·b bytes on a ring, with or
# without sequence parallelism. Activations are another matter: Korthikanti et al. count what a
# layer keeps for backward (16-bit activations, 1-byte dropout masks). Under TP the LayerNorm
# inputs, the linears' inputs and the two dropout masks (10 of the 34·sbh) stay whole on every
# rank; sequence parallelism divides them by t too.

# %%
for t in (2, 4, 8):
    print(f"t={t}: {plots.ring_bytes_per_layer(t, 1, 2048, 4096, 2) / 2**20:7.1f} MiB per rank per layer "
          f"(b=1, s=2048, h=4096, bf16)")
for what, per_sbh, per_as2b, region in activations.BREAKDOWN:
    print(f"{what:45s} {per_sbh:2d}·sbh + {per_as2b}·as²b   {region}")
s_, b_, h_, a_ = 2048, 1, 4096, 32
for t in (1, 2, 8):
    print(f"t={t}: TP {activations.layer_activation_bytes(s_, b_, h_, a_, t) / 2**20:6.0f} MiB, "
          f"TP+SP {activations.layer_activation_bytes(s_, b_, h_, a_, t, True) / 2**20:6.0f} MiB per layer")

# %% [markdown]
# ## The loss on vocabulary-sharded logits
# Each "rank" below holds V/t columns of the logits. Three numbers per token cross the ranks:
# the maximum, the sum of exponentials, the target's logit. The result is the ordinary
# cross-entropy. (The distributed version is `vocab_parallel.VocabParallelCrossEntropy`.)

# %%
torch.manual_seed(0)
V, t, tokens = 12, 3, 5
logits, target = torch.randn(tokens, V, dtype=torch.float64), torch.randint(V, (tokens,))
shards = logits.chunk(t, dim=1)
m = torch.stack([x.max(-1).values for x in shards]).max(0).values          # all-reduce MAX
Z = sum((x - m[:, None]).exp().sum(-1) for x in shards)                     # all-reduce SUM
picked = logits.gather(1, target[:, None]).squeeze(1) - m                   # all-reduce SUM (owner only)
print("sharded:", (Z.log() - picked).mean().item(), " F.cross_entropy:", F.cross_entropy(logits, target).item())
print(inspect.getsource(vocab_parallel.VocabParallelCrossEntropy.forward))

# %% [markdown]
# ## The real run: two processes under torchrun
# The dense block, the hand-written TP block with and without sequence parallelism, the
# DTensor versions and the vocabulary-parallel ends of a language model, trained side by side;
# every check must say `ok`.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch05"
result = run_torchrun(REPO_ROOT / "chapters/ch05_tensor_parallel/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %% [markdown]
# Step times are reported, never asserted: on two CPU processes sharing two cores they vary
# from run to run, and TP is slower than the dense block (tiny matrices, gloo on loopback).

# %%
figures = result.summary["figures"]
names = [n.removeprefix("step time, ").split(":")[0] for n in figures if n.startswith("step time") and "median" in n]
median = [next(v["measured"] for k, v in figures.items() if k.startswith(f"step time, {n}: median")) for n in names]
low, high = zip(*(figures[f"step time, {n}: min, max"]["measured"] for n in names))
plt.figure(figsize=(6, 3))
plt.barh(names, median, xerr=[[m - lo for m, lo in zip(median, low)], [hi - m for m, hi in zip(median, high)]])
plt.xlabel("ms per training step (median, min-max; CPU, reported only)")
plt.gca().invert_yaxis()
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run with `--dtype float32`: how large do the parity differences get, and why?
# 2. Make `RowParallelLinear` add its bias *before* the all-reduce. Which checks fail, by how much?
# 3. Fuse `attn.q`, `attn.k`, `attn.v` into one `nn.Linear` and give it `ColwiseParallel`. Why
#    does the output go wrong even though no error is raised?
# 4. Replace the six per-parameter all-reduces of `sync_sequence_parallel_grads` by one.
# 5. Give the plan a `PrepareModuleInput` before attention without SP: how many backward all-reduces?
# 6. Skip `reduce_partial_grads`: how many all-reduces do the clip and the optimizer step make?
# 7. How many bytes would a loss on all-gathered logits move instead of the three all-reduces?
#
# Hints and answers are in the lesson, [README.md](../chapters/ch05_tensor_parallel/README.md#exercises).
