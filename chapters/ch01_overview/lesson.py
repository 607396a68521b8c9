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
# # Chapter 01 · Why distributed training · 分布式训练概述
#
# Two questions decide whether a model fits on one device: **does its training state fit in
# memory**, and **can one device do its FLOPs in a reasonable time**. This notebook answers
# both with the chapter's calculators (`chapters/ch01_overview/calculators.py`), counts the
# FLOPs of a real training step with PyTorch's `FlopCounterMode`, and launches the chapter's
# first program (`hello.py`) and its full script (`train.py`) on two CPU processes with `torchrun`.
#
# Units: GB means decimal gigabytes (1e9 bytes, as on datasheets); GiB is 2³⁰ bytes, the
# binary unit of memory tools (`nvidia-smi` prints MiB, 2²⁰ bytes).

# %%
import inspect
import json
import re

import matplotlib.pyplot as plt
import torch
from torch.utils.flop_counter import FlopCounterMode

from chapters.ch01_overview import calculators as calc
from chapters.ch01_overview import flops, hello, plots, train
from common.distributed import choose_device_and_backend
from common.launch import run_torchrun
from common.models import MLP, count_params
from common.results import REPO_ROOT

# %% [markdown]
# ## 1. Memory: 16 bytes per parameter to train with Adam
#
# Training with Adam keeps, per parameter, the weights, their gradient and Adam's two moments.
# In mixed precision the weights and gradients used for compute are bf16 (2 + 2 bytes), but an
# fp32 master copy (4) and the fp32 moments (4 + 4) stay: still 16 bytes. Mixed precision saves
# compute time and activation memory, not model-state memory.

# %%
N = 7e9
for recipe in calc.RECIPES:
    total = calc.training_state_bytes(N, recipe)
    parts = ", ".join(f"{k} {v:g}" for k, v in calc.state_breakdown_gb(N, recipe).items())
    print(f"{recipe:15s} {calc.bytes_per_param(recipe):2d} B/param  {calc.to_gb(total):6.1f} GB "
          f"= {calc.to_gib(total):6.1f} GiB   ({parts})")
for gb in (24, 80, 141):
    print(f"devices of {gb:3d} GB needed just to hold the 7B training state: "
          f"{calc.devices_to_hold(N, gb)}")

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
plots.plot_memory(a, b)
fig.tight_layout()

# %% [markdown]
# ## 2. Compute: 6·N·D FLOPs
#
# Each token costs about 2·N FLOPs forward (a multiply and an add per weight) and 4·N backward
# (gradients for the activations and for the weights): 6·N·D for D tokens. At a peak of
# 989 TFLOP/s (H100, bf16 dense) and a model FLOPs utilisation (MFU) of 0.4:

# %%
total_flops = calc.training_flops(7e9, 1e12)
print(f"7B parameters, 1T tokens: {total_flops:.2e} FLOPs")
for n in (1, 8, 64, 1024):
    t = calc.time_to_train_s(7e9, 1e12, n, 989e12, 0.4)
    print(f"{n:5d} H100s: {calc.days(t):8.1f} days")

# %%
fig, ax = plt.subplots(figsize=(8, 4.5))
plots.plot_time_to_train(ax)
fig.tight_layout()

# %% [markdown]
# ## 3. Counting a step's FLOPs for real
#
# `torch.utils.flop_counter.FlopCounterMode` intercepts every matmul of a forward and backward
# pass. For an MLP of linear layers it counts 2·B·in·out per layer forward, the same again for
# each weight gradient and each input gradient, except the first layer, whose input (the data)
# needs no gradient. So the count is exactly 6·B·Σ in·out − 2·B·in₀·out₀, close to but not
# equal to the textbook 6·N·B (N also counts biases, which cost no matmul).

# %%
print(inspect.getsource(flops.mlp_step_flops))

# %%
torch.manual_seed(0)
dims, B = [128, 256, 256, 256, 8], 128
model = MLP(dims[0], dims[1], dims[-1], len(dims) - 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(B, dims[0]), torch.randn(B, dims[-1])
with FlopCounterMode(display=False) as counter:
    train.train_step(model, opt, x, y)
counted = counter.get_total_flops()
N = count_params(model)
print(f"counted by FlopCounterMode   {counted:>12,d}")
print(f"6·B·Σ in·out − 2·B·in₀·out₀  {flops.mlp_step_flops(dims, B):>12,d}")
print(f"plain 6·N·B (N = {N:,d})  {6 * N * B:>12,d}   ratio {counted / (6 * N * B):.3f}")
for module, ops in counter.get_flop_counts().items():
    if module.startswith("MLP."):
        print(f"  layer {module}: " + ", ".join(f"{op}: {n:,d}" for op, n in ops.items()))

# %% [markdown]
# ## 4. Hello, distributed
#
# The first program writes the distributed setup inline: it reads its rank from torchrun's
# environment, chooses and sets the device before the process group exists, lets the backend
# follow the device, all-reduces one number and leaves the group in `finally`:

# %%
print(inspect.getsource(hello.main))

# %% [markdown]
# Two processes started by `torchrun` (as a subprocess: worker code never lives in a notebook
# cell), each printing the all-reduced sum of the ranks, 0 + 1:

# %%
hello_run = run_torchrun(REPO_ROOT / "chapters/ch01_overview/hello.py", nproc=2, timeout=120)
print("\n".join(re.findall(r"rank \d+ of \d+ .*?: (?:ok|WRONG)", hello_run.output)))

# %% [markdown]
# The chapter's full script, `train.py`, calls the course's setup in `common/distributed.py`
# instead, which also reads Slurm's `srun` and checks the GPU layout. Which device each rank
# takes depends on the launcher and on the GPUs it can see. Here the decision for 8 local ranks
# on machines with 0, 1 and 8 GPUs, under torchrun and under `srun --gpus-per-task=1` (each task
# sees one GPU, its own):

# %%
srun_one_gpu = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_GPUS_PER_TASK": "1"}
for launcher, env in (("torchrun", {"RANK": "5"}), ("srun", srun_one_gpu)):
    for gpus in (0, 1, 8):
        try:
            decision = choose_device_and_backend(5, 8, gpu_count=gpus, env=env)
        except Exception as e:
            decision = f"refused: {e}"[:90]
        print(f"{launcher:8s} {gpus} GPU(s) visible: local rank 5 -> {decision}")

# %% [markdown]
# Now the full script: two processes started by `torchrun` again. Each rank reports its view,
# they all-reduce rank+1, count and time a training step, and project the 7B run. On a CPU the MFU is against a measured matmul
# (noisy, not a peak); on a known GPU against its datasheet peak.

# %%
result = run_torchrun(REPO_ROOT / "chapters/ch01_overview/train.py", nproc=2,
                      args=["--steps", "6", "--log-every", "2"],
                      out_dir=REPO_ROOT / "runs" / "notebooks" / "ch01",
                      timeout=120)
print("\n".join(result.output.strip().splitlines()[-30:]))

# %%
views = json.loads((result.out_dir / "ranks.json").read_text())
for v in views:
    print(v)
for c in result.summary["checks"]:
    print(f"{c['name']:45s} {c['kind']:8s} expected {c['expected']!s:>12} "
          f"measured {c['measured']!s:>12}  {'ok' if c['ok'] else 'FAIL'}")

# %%
f = result.summary["figures"]
days = {k.removeprefix("projected: days on 8 devices at "): v["expected"] if v["measured"] == "-"
        else v["measured"] for k, v in f.items() if k.startswith("projected: days")}
fig, ax = plt.subplots(figsize=(7, 2.5))
ax.barh(list(days), list(days.values()))
ax.set_xscale("log")
ax.set(xlabel="days to train 7B on 1T tokens with 8 devices",
       title=f"one CPU rank reached {f['achieved FLOP/s per rank']['measured']:.2e} FLOP/s")
fig.tight_layout()

# %% [markdown]
# Try it yourself: change `--project-params`, `--project-tokens`, `--project-devices` and
# `--mfu` in the launch above, or run `python chapters/ch01_overview/train.py --help`.
