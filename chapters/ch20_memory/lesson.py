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
# # Chapter 20 · Memory optimisation · 数据并行中的显存优化
#
# Activations, not weights, fill a GPU during training. Recomputation keeps fewer of them and
# reruns part of the forward pass in backward; CPU offload moves optimizer state (and with
# FSDP2 the parameter shards) into host memory. This notebook counts the bytes autograd keeps,
# checks the gradients are unchanged, then runs the real scripts on two processes.
# The lesson is [chapters/ch20_memory/README.md](../chapters/ch20_memory/README.md).

# %%
import inspect

import matplotlib.pyplot as plt
import torch

from chapters.ch20_memory import offload, plots, recompute, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## Counting what autograd keeps
# `saved_tensors_hooks` calls a pack function for every tensor an op saves for backward. We
# record each distinct storage once (views share storage) and skip parameters and inputs.

# %%
print(inspect.getsource(recompute.saved_tensor_bytes))

# %% [markdown]
# One block, y = x + W2·gelu(W1·x + b1) + b2: without recomputation it keeps x, h and gelu(h);
# the selective policy keeps h and recomputes the gelu; full recomputation keeps only x.

# %%
torch.manual_seed(0)
model = recompute.ResidualMLP(d_model=32, d_ff=128, n_layers=4).double()
x, y = torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64)
reference = None
for strategy in recompute.STRATEGIES:
    r = train.measure_saved(model, x, y, strategy)
    reference = reference or r["grads"]
    formula = recompute.predicted_saved_bytes(strategy, 64, 32, 128, 4, 8)
    print(f"{strategy:16s} hooks {r['saved']:7d} B  census {r['live']:7d} B  formula {formula:7d} B"
          f"  max|dgrad| {train.max_diff(r['grads'], reference):.1e}")

# %% [markdown]
# `full`, `torch_full` and `torch_selective` rerun the forward's own ops: their gradients are
# bit-for-bit those of no recomputation. The hand-written `selective` forms its backward
# products itself, so on some CPUs it differs by an ulp or so (well inside the tolerance the
# script derives, a few ulps times the roundings behind each gradient element):

# %%
for strategy in recompute.STRATEGIES[1:]:
    print(f"{strategy:16s} tolerance {train.parity_tolerance(strategy, train.Config(), 1.0):.1e}"
          " x max|grad|")

# %% [markdown]
# ## The hand-written selective policy
# Save the matmul output h, not gelu(h); backward recomputes one pointwise op and no matmul.

# %%
print(inspect.getsource(recompute.GeluLinear))

# %%
measured, formula = plots.saved_bytes_table(train.Config())
plt.figure(figsize=(6, 3))
plt.bar(recompute.STRATEGIES, [b / 1024 for b in measured])
plt.ylabel("KiB kept for backward")
plt.xticks(rotation=20)
plt.show()

# %% [markdown]
# ## The real runs: two processes under torchrun
# First recomputation inside data-parallel training, then CPU offload (by hand and FSDP2).

# %%
result = run_torchrun(REPO_ROOT / "chapters/ch20_memory/train.py", nproc=2,
                      out_dir=REPO_ROOT / "runs" / "notebooks" / "ch20")
print(result.output[result.output.index("\ncheck ") + 1:])

# %%
times = {s: result.summary["figures"][f"step time / none, {s}"] for s in recompute.STRATEGIES}
for s, f in times.items():
    print(f"{s:16s} step time x{f['measured']:.2f} (matmul FLOPs predict x{f['expected']:.2f})")

# %% [markdown]
# The offload script (`offload.py`) is run the same way; here are its memory formulas for a
# 1B-parameter fp32 model on 8 ranks (GiB per rank, device and host):

# %%
for name, (device_bytes, host_bytes) in offload.per_rank_bytes(10**9, 4, 8).items():
    print(f"{name:28s} device {device_bytes / 2**30:5.1f} GiB   host {host_bytes / 2**30:5.1f} GiB")

# %% [markdown]
# ## Exercises
# 1. Add `aten.gelu` to `MATMULS` in `recompute.py`. Predict the new `torch_selective` byte
#    count, then run the script.
# 2. Write a `policy_fn` for SAC that saves only fc1's matmul. Does it reach the hand-written
#    selective count?
# 3. With `--d-ff 512`, how much does selective save compared with full? Which ratio $f/d$
#    makes selective worthwhile?
# 4. On a GPU, run `train.py --d-model 1024 --d-ff 4096 --tokens 8192 --dtype float32` with and
#    without `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` and compare the fragmentation figure.
#
# The lesson's exercises come with hints and worked answers.
