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
# # Chapter 17 · Load balancing in pipelines · 模型并行中的负载均衡
#
# A pipeline runs at the pace of its slowest stage. This notebook cuts a skewed model where its
# measured costs balance, then compares three schedules on the same stages: GPipe, 1F1B and
# interleaved 1F1B. It counts what each costs in bubble and in activation memory, using
# chapter 04's timeline simulator, and runs all three through `torch.distributed.pipelining`.
# The lesson is [chapters/ch17_pipeline_balance/README.md](../chapters/ch17_pipeline_balance/README.md).

# %%
import inspect

import matplotlib.pyplot as plt

from chapters.ch04_model_parallel.plots import draw_timeline
from chapters.ch04_model_parallel.schedule import (
    bubble_fraction,
    gpipe_order,
    one_f_one_b_order,
    simulate,
)
from chapters.ch17_pipeline_balance import partition, plots, schedules, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## A skewed model
# Eight blocks d→w→d; the last two are 8× and 16× wider (an LM head has this shape). Cutting it
# into equal *layer counts* gives one stage almost all the work.

# %%
cfg = train.Config()
flops = train.block_flops(cfg)
for p in (2, 4):
    uniform = partition.uniform_partition(len(flops), p)
    balanced = partition.balanced_partition(flops, p)
    print(f"p={p}: uniform {uniform} -> stage FLOPs {partition.stage_costs(flops, uniform)}")
    print(f"     balanced {balanced} -> stage FLOPs {partition.stage_costs(flops, balanced)}")
    print(f"     brute force agrees: {partition.brute_force_partition(flops, p)}")

# %%
print(inspect.getsource(partition.balanced_partition))

# %% [markdown]
# ## What the cut does to a 1F1B step
# Costs in MFLOPs per sample, backward twice the forward. The slow stage sets the pace; the
# fast one waits.

# %%
fig, axes = plt.subplots(2, 1, figsize=(9, 3.4), sharex=True)
for ax, (label, (bounds, events)) in zip(axes, plots.partition_timelines().items()):
    draw_timeline(ax, events, 2, f"1F1B, {label} cut {bounds}")
plt.show()

# %% [markdown]
# ## Activations in flight and the bubble, counted
# GPipe holds all m micro-batches' activations on every rank; 1F1B holds at most p − r on rank r.
# Interleaving v chunks per rank shrinks the bubble to (p−1)/(v·m+p−1), for a little more
# activation memory and v times more messages.

# %%
p, m = 4, 8
for name, events, v in [("GPipe", simulate(gpipe_order(p, m)), 1),
                        ("1F1B", simulate(one_f_one_b_order(p, m)), 1),
                        ("interleaved v=2", simulate(schedules.interleaved_order(p, m, 2), 0.5, 0.5), 2),
                        ("interleaved v=4", simulate(schedules.interleaved_order(p, m, 4), 0.25, 0.25), 4)]:
    peaks = [schedules.peak_in_flight(events, r, v) for r in range(p)]
    print(f"{name:16s} bubble {float(bubble_fraction(events, p)):.3f}   peak activations per rank {peaks}")

# %% [markdown]
# ## The real run: two ranks under torchrun
# The three schedules of `torch.distributed.pipelining` on the balanced cut, each checked
# against the unsplit model; live activations counted by wrapping the stage's forward and
# backward; torch's own interleaved order fed to the simulator; wall-clock times reported.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch17"
result = run_torchrun(REPO_ROOT / "chapters/ch17_pipeline_balance/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("block costs"):])

# %%
figs = result.summary["figures"]
kinds = list(train.SCHEDULES)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3))
ax1.bar(kinds, [figs[f"{k} bubble (counted)"]["measured"] for k in kinds])
ax1.set_title("bubble, counted on the timeline")
ax2.bar(kinds, [figs[f"{k} step, balanced"]["measured"] for k in kinds], color="grey")
ax2.set_title("wall-clock step (ms), 2 CPU ranks")
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run with `--micro-batches 8`: which bubble shrinks more, 1F1B's or the interleaved one's?
# 2. Change `--widths` so that the *first* block is the heavy one. Where does the balanced cut go?
# 3. Interleaving wins on the timeline but loses on the CPU's wall clock here. Which costs did
#    the simulator leave out? (Count the messages per step for v = 1 and v = 2.)
