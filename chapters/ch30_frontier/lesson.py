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
# # Chapter 30 · Frontiers · 未来趋势与前沿
#
# An auto-parallel planner built from the course's own cost and memory models, checked against
# brute force; and federated averaging whose updates are summed under pairwise masks that cancel
# exactly. The lesson is [chapters/ch30_frontier/README.md](../chapters/ch30_frontier/README.md).

# %%
import dataclasses
import inspect

import torch

from chapters.ch25_llm.model import PRESETS
from chapters.ch30_frontier import mesh_bytes, planner, secure_agg
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The planner's choice for the worked pairs
# Every term comes from an earlier chapter (ch04 bubble, ch05 activations and all-reduces, ch06
# ZeRO, ch07 ring). The hardware figures are stated assumptions (`planner.H100_NODE`).

# %%
for name, (spec, cluster) in planner.WORKED.items():
    plan = planner.search(spec, cluster)
    full = planner.brute_force(spec, cluster)
    print(f"{name}: {plan.layout}")
    print(f"   {plan.time:.2f} s per step, {plan.memory / 1e9:.1f} GB per GPU;"
          f" {plan.evaluated} of {full.evaluated} layouts evaluated; brute force agrees:",
          (plan.layout, plan.time) == (full.layout, full.time))
    print("   terms:", {k: round(v, 3) for k, v in planner.step_terms(spec, cluster, plan.layout).items()})

# %% [markdown]
# ## What changes the choice
# Less memory per GPU, or a gradient all-reduce hidden behind backward (chapter 08), move the
# planner to other layouts (exercises 1 and 2 of the lesson).

# %%
spec, cluster = planner.WORKED["7B on 64 GPUs of 80 GB"]
print("40 GB GPUs:", planner.search(spec, dataclasses.replace(cluster, memory_bytes=40e9)).layout)
print("all-reduce hidden:", planner.search(spec, cluster, drop="dp_comm").layout)
print("memory ignored (a broken planner):", planner.search(spec, cluster, ignore_memory=True).layout)

# %% [markdown]
# ## Bytes per mesh dimension
# Chapter 25's CPU Llama on dp × tp × pp × cp = 2 × 2 × 2 × 2: what each rank holds and what each
# dimension's collectives move in one step (at the collective boundary / on a ring's wire), under
# torchtitan's sequence-parallel plan and under chapter 25's `composed.py` plan ("blocks").
# These are the figures to be held against chapter 25's measurements: model state and bytes
# exactly, activations within the band.

# %%
llama = mesh_bytes.Llama.from_preset(PRESETS["cpu"])
for plan in mesh_bytes.PLANS:
    mesh = mesh_bytes.Mesh(dp=2, tp=2, pp=2, cp=2, micro_batch_size=1, micro_batches=2, plan=plan)
    print("\n".join(mesh_bytes.report(llama, mesh, mesh_bytes.Dtypes.of(torch.float32))))
print(mesh_bytes.comm_bytes(llama, mesh, mesh_bytes.Dtypes.of(torch.float32))["tp"])

# %% [markdown]
# ## Masks that cancel
# Five clients in one process: each masked vector alone is noise; their sum modulo 2³² is the
# plain sum, bit for bit.

# %%
world, n = 5, 6
xs = [torch.randn(n, dtype=torch.float64) for _ in range(world)]
masked = [torch.remainder(secure_agg.payload(x, 16) + secure_agg.mask_for(r, world, n + 1, 0, 0), secure_agg.MOD)
          for r, x in enumerate(xs)]
print("client 0 sends:", masked[0].tolist())
total = torch.remainder(sum(masked), secure_agg.MOD)
print("slot 0 (clients counted):", int(secure_agg.decode(total[:1], 0)))
print("decoded sum - float sum:", (secure_agg.decode(total[1:], 16) - sum(xs)).abs().max().item())
print("one client missing, slot 0:", int(secure_agg.decode(torch.remainder(sum(masked[1:]), secure_agg.MOD)[:1], 0)))
print(inspect.getsource(secure_agg.mask_for))

# %% [markdown]
# ## FedAvg on two ranks
# The real run: two clients, non-IID shards, 30 rounds, one secure all-reduce each.

# %%
run = run_torchrun(REPO_ROOT / "chapters/ch30_frontier/fedavg.py", nproc=2, timeout=300)
for check in run.summary["checks"]:
    print(f"{check['name'][:70]:72s} {check['measured']!s:>12}  {'ok' if check['ok'] else 'FAIL'}")
