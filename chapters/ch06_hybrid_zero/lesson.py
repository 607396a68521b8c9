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
# it is needed. This notebook looks at the hand-written stages, the memory formula, ZeRO++'s
# int8 weight all-gather and DeepSpeed's config, then runs every stage on two processes.
# The lesson is [chapters/ch06_hybrid_zero/README.md](../chapters/ch06_hybrid_zero/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch06_hybrid_zero import deepspeed_zero, memory, zero, zeropp
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
# (once for a tied weight, after both uses). It reduce-scatters the gradient by owner and drops
# it, so no rank ever holds all the gradients at once.

# %%
print(inspect.getsource(zero.reduce_scatter_param_grad))
print(inspect.getsource(zero.ZeroTwo._grad_ready))

# %% [markdown]
# ## ZeRO-3: gather a layer's weights just in time
# The parameters' storage is freed (`untyped_storage().resize_(0)`); a forward pre-hook
# gathers a module's weights, a forward hook frees them and registers a hook on the output's
# gradient that gathers them again before backward needs them.

# %%
print(inspect.getsource(zero.ZeroThree.gather))

# %% [markdown]
# ## The memory calculator and the ZeRO paper's table
# Mixed-precision Adam: 2 bytes of weights + 2 of gradients + K = 12 of optimizer states per
# parameter. For Ψ = 7.5B on N_d = 64 devices the paper lists 120, 31.4, 16.6 and 1.88 GB.

# %%
for stage, gb in memory.paper_table(7.5e9, 64, 12).items():
    print(f"{stage:10s} {gb:8.3f} GB per device")
for stage in range(4):
    print(f"stage {stage}: the largest model whose states fit in 80 GB on 64 GPUs: "
          f"{memory.max_params_that_fit(80, 64, stage) / 1e9:7.1f} B parameters")

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
# This is the config it uses for stage 3 with 6 sequences per rank:

# %%
print(json.dumps(deepspeed_zero.ds_config(3, 6), indent=2))

# %% [markdown]
# ## The real run: DDP, ZeRO-1, ZeRO-2, ZeRO-3 and FSDP2 on two processes
# Every stage must end with DDP + Adam's parameters, and every rank's bytes must equal the
# formula.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch06"
result = run_torchrun(REPO_ROOT / "chapters/ch06_hybrid_zero/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %%
names = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2"]
measured = [result.summary["figures"][f"{n} bytes per rank"]["measured"] / 1e3 for n in names]
paper = memory.paper_table(7.5e9, 64, 12)
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
axes[0].bar(list(paper), list(paper.values()))
axes[0].set_title("ZeRO paper: 7.5B parameters, 64 GPUs (formula)")
axes[0].set_ylabel("GB per device")
axes[1].bar(names, measured, color="C1")
axes[1].set_title("this run: tiny GPT, 2 ranks (measured from the tensors)")
axes[1].set_ylabel("kB per rank")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run `train.py` with 3 processes: Ψ is not a multiple of 3. Where does the padding show
#    up in the byte counts?
# 2. Give ZeRO-3 one gather for the whole model instead of one per module. What happens to the
#    peak memory, and to the number of collectives?
# 3. Run `mesh.py` on 4 processes with `--tp 4` and with `--tp 1`. How do the bytes per rank
#    and the communication change?
