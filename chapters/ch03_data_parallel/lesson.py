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
# # Chapter 03 · Data parallelism · 数据并行
#
# Every rank holds the whole model and a shard of the global batch. After backward, one
# all-reduce averages the gradients, so every replica takes the step one process would take on
# the whole batch. This notebook looks at the code, at the two quiet bugs of data-parallel
# loops (accumulation and token normalisation), and then runs the real thing on two processes.
# The lesson is [chapters/ch03_data_parallel/README.md](../chapters/ch03_data_parallel/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch03_data_parallel import data_parallel, plots, tap, token_loss, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The whole technique in ten lines
# Sum every gradient over the ranks, divide by the number of ranks. DDP does exactly this,
# but in buckets and overlapped with backward (chapter 08).

# %%
print(inspect.getsource(data_parallel.all_reduce_gradients))

# %% [markdown]
# ## Sharding a global batch
# Each rank takes a contiguous shard and cuts it into `grad_accum_steps` micro-batches. Here a
# global batch of 12 samples on 3 ranks with 2 micro-batches each:

# %%
global_batch = torch.arange(12)
for rank in range(3):
    print(f"rank {rank}:", [m.tolist() for m in data_parallel.micro_batches(global_batch, rank, 3, 2)])

# %% [markdown]
# Accumulating k micro-batches equals one k-times larger batch only if each micro-batch's mean
# loss is divided by k: the gradient of the global mean is the mean of the micro-batch means.
# The training loop that does it:

# %%
print(inspect.getsource(train.train_hand_dp))

# %% [markdown]
# The loop does not count its own all-reduces: a loop that skipped the collective but kept a
# `calls += 1` would still report them. `AllReduceTap` counts where the call is made, by
# replacing `torch.distributed.all_reduce` with a recording wrapper while the loop runs:

# %%
print(inspect.getsource(tap.AllReduceTap.__enter__))

# %% [markdown]
# ## Uneven token counts: the silent bug
# With padded sequences, micro-batches hold different numbers of real tokens. A per-batch mean,
# averaged by DDP, gives a token in a short micro-batch more weight than one in a long
# micro-batch. One process would weight every token by 1/N. The cell below prints the weights for
# the first step of the course's token data on 2 ranks.

# %%
labels, counts, naive, correct = plots.token_weights(train.Config(steps=1, global_batch_size=16), 2)
for label, n, w in zip(labels, counts, naive):
    print(f"{label.replace(chr(10), ' '):16s} {int(n):3d} tokens   naive weight {w:.4f}   correct {correct:.4f}")

# %%
print(inspect.getsource(token_loss.train_tokens_ddp))

# %% [markdown]
# The first k-1 micro-batches run under `no_sync`, as in `train_ddp`: their gradients add up
# locally and the last backward all-reduces the sums, which is still exactly the global-token
# mean.

# %% [markdown]
# ## The linear scaling rule
# Growing the global batch by a factor g, grow the learning rate by g, reached after a warm-up
# (Goyal et al., 2017). The script checks the rates the optimizer actually used against the
# ramp written out another way (`warmup_ramp`: evenly spaced rates up to the peak, not
# `scaled_lr` itself, which would agree with anything `scaled_lr` does):

# %%
cfg = train.Config()
print("optimizer (LambdaLR over scaled_lr):", [round(train.scaled_lr(s, cfg), 4) for s in range(7)])
print("warmup_ramp (the expected value):   ", [round(x, 4) for x in train.warmup_ramp(cfg)[:7].tolist()])

# %%
fig, ax = plt.subplots(figsize=(6, 3))
for batch in (256, 1024, 4096):
    c = train.Config(base_lr=0.1, base_batch_size=256, global_batch_size=batch, warmup_steps=20)
    ax.plot([train.scaled_lr(s, c) for s in range(40)], label=f"global batch {batch}")
ax.set_xlabel("step")
ax.set_ylabel("learning rate")
ax.legend()
plt.show()

# %% [markdown]
# ## The real run: two processes under torchrun
# Hand-written data parallelism, DDP with `no_sync` accumulation, and one process on the
# global batch, trained side by side; every check must say `ok`.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch03"
result = run_torchrun(REPO_ROOT / "chapters/ch03_data_parallel/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %%
for check in result.summary["checks"]:
    print(f"{'ok ' if check['ok'] else 'FAIL'} {check['name']}: {check['measured']}")

# %%
steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
plt.figure(figsize=(5, 3))
plt.plot([s["step"] for s in steps], [s["loss"] for s in steps], marker="o")
plt.xlabel("step")
plt.ylabel("training loss (global batch)")
plt.show()

# %% [markdown]
# ## Exercises
# The lesson's exercises, with hints and worked answers
# ([README.md](../chapters/ch03_data_parallel/README.md#exercises)):
# 1. Run the script with `--dtype float32` on 2 and 3 processes. How large do the parity
#    differences get, and why is "hand DP == DDP" exactly 0 on 2 ranks but not on 3?
# 2. Make `all_reduce_gradients` skip one tensor. Which checks fail, and by how much?
# 3. Replace its six all-reduces by one all-reduce of a flattened buffer, and compare the step
#    time with DDP's.
# 4. Normalise the token loss by the rank's *local* token count
#    (`token_loss.train_tokens_ddp(..., "local")`). When does that match one process?
# 5. Make the warm-up start one step late (`step` instead of `step + 1` in `scaled_lr`). Which
#    checks fail, and why do the parity checks not notice?
