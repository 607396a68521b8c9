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
# # Chapter 19 · Mixture of experts and expert parallelism · 专家并行 (MoE)
#
# A mixture-of-experts layer replaces the MLP by E experts and a router that sends each token to
# its top-k of them, at most C tokens per expert. This notebook routes a few tokens by hand,
# checks the capacity rule and the balancing loss, reads the all-to-all that expert parallelism
# adds, and runs the real thing on two processes. The lesson is
# [chapters/ch19_moe/README.md](../chapters/ch19_moe/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch19_moe import moe, plots
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## Routing twelve tokens to four experts, top-2, capacity factor 1
# C = ceil(1 · 2 · 12 / 4) = 6 slots per expert. First choices are served before second choices;
# a choice that finds its expert full is dropped (the token keeps its residual).

# %%
torch.manual_seed(0)
logits = torch.randn(12, 4, dtype=torch.float64) + torch.tensor([1.5, 0.0, 0.0, -1.0], dtype=torch.float64)
r = moe.route(logits, k=2, capacity_factor=1.0)
print("capacity C =", r.capacity)
print("chosen experts (first, second) per token:\n", r.experts.tolist())
print("kept:\n", r.keep.int().tolist())
print("routed per expert:", r.routed.tolist(), " kept:", r.kept.tolist())
print("balancing loss E·Σ f_e P_e =", round(r.aux_loss.item(), 4), "(1 when balanced)")
print("z-loss =", round(r.z_loss.item(), 4))

# %% [markdown]
# ## The balancing loss is 1 for a uniform router and grows with imbalance

# %%
for bias in (0.0, 1.0, 3.0):
    skewed = torch.randn(256, 8, dtype=torch.float64) + bias * torch.arange(8, dtype=torch.float64) / 7
    print(f"bias {bias}: loss {moe.route(skewed, 2, 1.0).aux_loss.item():.3f}")
print("uniform router:", moe.route(torch.zeros(256, 8, dtype=torch.float64), 2, 1.0).aux_loss.item())

# %% [markdown]
# ## Expert parallelism: counts first, then rows, then back
# `ExpertParallelMoE.forward` sorts its kept choices by destination expert, exchanges the counts
# with one all-to-all, sends the rows with uneven splits, runs its local experts, and sends the
# results back along the same routes. `AllToAll` gives the collective a gradient.

# %%
print(inspect.getsource(moe.ExpertParallelMoE.forward))
print(inspect.getsource(moe.AllToAll))

# %% [markdown]
# ## The real run: two processes under torchrun
# The expert-parallel layer (top-1 and top-2) and an expert-parallel MoE TinyGPT against one
# process holding every expert; every check must say `ok`.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch19"
result = run_torchrun(REPO_ROOT / "chapters/ch19_moe/train.py", nproc=2, out_dir=out_dir)
for check in result.summary["checks"]:
    print(f"{'ok ' if check['ok'] else 'FAIL'} {check['name']}: {check['measured']}")

# %%
steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
a.plot([s["step"] for s in steps], [s["ce"] for s in steps], marker="o")
a.set_xlabel("step")
a.set_ylabel("cross-entropy")
b.plot([s["step"] for s in steps], [s["imbalance"] for s in steps], marker="o")
b.set_xlabel("step")
b.set_ylabel("max / mean choices per expert\n(per layer, mean over layers)")
plt.show()

# %% [markdown]
# ## Balancing loss and capacity, from the recorded measurements
# Drawn from `figures/data.json` (re-measure with `python tools/figures.py --rerun ch19`).

# %%
data = json.loads((REPO_ROOT / "chapters/ch19_moe/figures/data.json").read_text())
for path in plots.make_figures(REPO_ROOT / "runs" / "notebooks" / "ch19" / "figures", data):
    plt.figure(figsize=(9, 3.6))
    plt.imshow(plt.imread(path))
    plt.axis("off")
    plt.show()

# %% [markdown]
# ## Exercises
# The lesson's exercises, with hints and worked answers
# ([README.md](../chapters/ch19_moe/README.md#exercises)):
# 1. With 4 experts, top-2, 48 tokens per rank and capacity factor 1.25, what is C?
# 2. Set `wrong_combine_order = True` on the expert-parallel layer. Which checks fail?
# 3. Train without all-reducing the router's and attention's gradients. What breaks, and why
#    do the expert gradients still need dividing by the world size?
# 4. Why does DeepSpeed's top-2 output differ from ours exactly on the tokens with one choice dropped?
