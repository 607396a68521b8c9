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
# # Chapter 06 · Hybrid parallelism and ZeRO · 混合并行策略
#
# Data parallelism keeps N identical copies of the parameters, the gradients and the optimizer
# states. ZeRO keeps one: each rank holds a 1/N slice of the optimizer states (stage 1), of the
# gradients (stage 2) and of the parameters (stage 3), and collectives bring a slice to where
# it is needed. This notebook looks at the hand-written stages, the memory formula, the mesh
# layout, ZeRO++'s int8 weight all-gather and DeepSpeed's config, then runs every stage on two
# processes and draws what they held and sent, counted from the tensors.
# The lesson is [chapters/ch06_hybrid_zero/README.md](../chapters/ch06_hybrid_zero/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch06_hybrid_zero import deepspeed_zero, memory, mesh, plots, zero, zero23, zeropp
from common.checkpoint import load_checkpoint
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## One flat vector, N equal slices
# The trainable parameters are laid end to end (Ψ numbers) and padded to N·⌈Ψ/N⌉, so every
# rank's slice has the same length. A parameter may straddle two ranks. Here Ψ = 12 in three
# tensors on 5 ranks: S = ⌈12/5⌉ = 3 and the last rank's slice is zero padding.

# %%
params = [torch.zeros(5), torch.zeros(2, 3), torch.zeros(1)]
layout = zero.FlatLayout(params, world_size=5, rank=0)
print("shard length S =", layout.shard, " padded length =", 5 * layout.shard)
for i, p in enumerate(params):
    print(f"tensor {i} ({p.numel()} numbers): pieces per rank {layout.pieces(i)}")

# %% [markdown]
# ## ZeRO-2: reduce-scatter each gradient as soon as it exists, then free it
# A post-accumulate-grad hook fires once per parameter when backward has finished its gradient
# (once for a tied weight, after both uses). It reduce-scatters the gradient by owner, in fp32,
# and drops it, so no rank ever holds all the gradients at once. After backward the training
# loop calls `reduce_gradients()`, which averages the slice and hands it to the optimizer.

# %%
print(inspect.getsource(zero23.reduce_scatter_param_grad))
print(inspect.getsource(zero23._Sharded._reduce))
print(inspect.getsource(zero23._Sharded.reduce_gradients))

# %% [markdown]
# ## ZeRO-3: gather a module's weights just in time
# The parameters' storage is freed (`untyped_storage().resize_(0)`); a forward pre-hook
# gathers a module's weights (in the compute dtype), a forward hook frees them and registers a
# hook on the output's gradient that gathers them again before backward needs them.

# %%
print(inspect.getsource(zero23.ZeroThree.gather))

# %% [markdown]
# ## The memory calculator and the ZeRO paper's table
# Mixed-precision Adam: 2 bytes of weights + 2 of gradients + K = 12 of optimizer states per
# parameter. For Ψ = 7.5B on N_d = 64 devices the paper lists 120, 31.4, 16.6 and 1.88 GB.
# These are formulas; the run below measures the tiny model.

# %%
for stage, gb in memory.paper_table(7.5e9, 64, 12).items():
    print(f"{stage:10s} {gb:8.3f} GB per device (formula)")
for stage in range(4):
    fits = [memory.max_params_that_fit(80, n, stage) / 1e9 for n in (8, 64, 1024)]
    print(f"stage {stage}: largest model whose states fit in 80 GB on 8 / 64 / 1024 GPUs: "
          + " / ".join(f"{b:.1f}B" for b in fits))

# %% [markdown]
# ## A dp × tp mesh: which ranks talk to which
# `mesh.py` numbers the ranks row by row: the tp groups are rows of consecutive ranks (one node),
# the dp groups are columns. Each run checks this against the `DeviceMesh`'s own groups.

# %%
groups = mesh.mesh_groups(world_size=8, tp=4)
print("tp groups (split matrices, all-reduce activations):", groups["tp"])
print("dp groups (same TP shard, different data, ZeRO slices):", groups["dp"])

# %% [markdown]
# ## ZeRO++ qwZ: int8 weights, one scale per block
# Each block of 64 weights is sent as int8 with scale = max|x|/127; the receiver's error is at
# most half a step, scale/2, per block.

# %%
x = torch.randn(4096, dtype=torch.float64)
q, scale = zeropp.quantize_blockwise(x, block=64)
x_hat = zeropp.dequantize_blockwise(q, scale, x.numel(), torch.float64)
ratio = ((x - x_hat).abs() / (scale.double().repeat_interleave(64) / 2)).max().item()
print(f"max |x - x^| / (scale/2) = {ratio:.4f}  (bound: 1)")
print(f"bytes: {x.numel() * 2} as bf16, {q.numel() + 4 * scale.numel()} as int8 + scales")

# %% [markdown]
# ## DeepSpeed: ZeRO is one block of a JSON config
# `deepspeed_zero.py` trains the same model with `deepspeed.initialize(model, optimizer,
# config)`; the run is in the tests (DeepSpeed needs a one-time build of a communication op).
# This is the config it uses for stage 3 with 24 sequences per rank (48 over 2 ranks):

# %%
print(json.dumps(deepspeed_zero.ds_config(3, 24), indent=2))

# %% [markdown]
# ## The real run: six ways to train on two processes
# DDP, the hand ZeRO-1/2/3, `ZeroRedundancyOptimizer` and FSDP2 must all end with DDP + Adam's
# parameters; every rank's bytes at rest, at the peak of a step and sent to collectives must
# equal the formulas; the bf16 wrappers must match FSDP2's mixed-precision policy.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch06"
result = run_torchrun(REPO_ROOT / "chapters/ch06_hybrid_zero/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("check "):])

# %% [markdown]
# What one rank held (pale: at rest after the step; solid: each category's peak during it) and
# what one step handed to collectives, in units of Ψ bytes, beside the paper's 2Ψ and 3Ψ.

# %%
saved = load_checkpoint(out_dir / "final_params.pt")
psi_bytes = result.summary["figures"]["trainable parameters psi"]["measured"] * 8  # float64
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
plots.measured_bars(axes[0], saved, plots.WAYS)
plots.volume_bars(axes[1], saved, psi_bytes)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Exercises
# The lesson's exercises (with hints and answers) use this run: the padding on 3 ranks, where
# ZeRO-3's 55 all-to-alls come from, qwZ's bytes, the mesh's bytes per rank for each `--tp`,
# and which ZeRO stages stop scaling with the number of GPUs.
