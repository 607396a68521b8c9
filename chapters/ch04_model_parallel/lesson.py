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
# # Chapter 04 · Model and pipeline parallelism · 模型并行
#
# When the model no longer fits on one device, split its layers across ranks: rank 0 holds the
# first layers, rank 1 the next, and activations travel forward (gradients backward) with
# send/recv. Done naively, only one rank works at a time; GPipe cuts the batch into
# micro-batches so the stages overlap, leaving a *bubble* of (p−1)/(m+p−1).
# The lesson is [chapters/ch04_model_parallel/README.md](../chapters/ch04_model_parallel/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt

from chapters.ch04_model_parallel import plots, schedule, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## One stage's forward and backward
# A stage receives its input (or reads the batch on rank 0), runs its layers and sends the
# output on. In backward it receives the gradient of its output, backpropagates, and sends the
# gradient of its input back. The received activation must `requires_grad_()`, or there is no
# input gradient to send.

# %%
print(inspect.getsource(train.stage_forward))
print(inspect.getsource(train.stage_backward))

# %% [markdown]
# ## GPipe: the same two functions, over m micro-batches
# Each micro-batch loss is scaled by 1/m, so the gradients that add up in `.grad` are those of
# the whole batch's mean loss.

# %%
print(inspect.getsource(train.gpipe_step))

# %% [markdown]
# ## The bubble, counted
# The simulator places every forward and backward (one time unit each) as early as the data
# allows. Idle slots are `.`; count them and divide by all slots.

# %%
p, m = 4, 4
for name, order in [("GPipe", schedule.gpipe_order), ("1F1B", schedule.one_f_one_b_order)]:
    events = schedule.simulate(order(p, m))
    print(name)
    for row in schedule.grid(events, p):
        print("  " + " ".join(f"{slot:>2}" for slot in row))
    print(f"  bubble {schedule.bubble_fraction(events, p)}, formula (p-1)/(m+p-1) = {schedule.bubble_formula(p, m)}\n")

# %%
fig, axes = plt.subplots(2, 1, figsize=(9, 4), sharex=True)
for ax, (name, order) in zip(axes, [("GPipe", schedule.gpipe_order), ("1F1B", schedule.one_f_one_b_order)]):
    plots.draw_timeline(ax, schedule.simulate(order(4, 8)), 4, f"{name}, p=4, m=8")
plt.show()

# %% [markdown]
# Both schedules have the same bubble; 1F1B's gain is memory: rank 0 holds at most p
# micro-batches' activations instead of m (chapter 17 counts it).
#
# ## The real run: two stages under torchrun
# Naive split, hand-written GPipe, and `torch.distributed.pipelining` (ScheduleGPipe,
# Schedule1F1B) must give the unsplit model's loss and gradients; then GPipe trains for 20 steps
# beside the unsplit model, and the wall-clock bubble is measured on a wider float32 model.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch04"
result = run_torchrun(REPO_ROOT / "chapters/ch04_model_parallel/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %%
measured = json.loads((out_dir / "timeline.json").read_text())
events = [schedule.Event(**e) for e in measured]
fig, ax = plt.subplots(figsize=(9, 1.8))
plots.draw_timeline(ax, [schedule.Event(e.rank, e.kind, e.mb, e.stage, e.start * 1e3, e.end * 1e3)
                         for e in events], 2, "measured GPipe step, 2 CPU ranks", labels=False)
ax.set_xlabel("ms (compute only; gaps are waiting and communication)")
plt.show()

# %%
figs = result.summary["figures"]
names = [n for n in figs if n.startswith("wall-clock bubble")]
ms = [int(n.split("m=")[1]) for n in names]
plt.figure(figsize=(5, 3))
plt.plot(ms, [figs[n]["expected"] for n in names], "o-", label="(p-1)/(m+p-1)")
plt.plot(ms, [figs[n]["measured"] for n in names], "s--", label="measured (wall clock)")
plt.xlabel("micro-batches m")
plt.ylabel("bubble fraction")
plt.legend()
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run with `--micro-batches 8` and `--micro-batches 16`: how does the measured bubble move?
# 2. Make `gpipe_step` forget the 1/m: which checks fail, and by what factor are the gradients off?
# 3. Write the 1F1B order by hand in `gpipe_step` (warm-up forwards, then one forward one backward).
