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
from fractions import Fraction

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
# Four blocks d→w→d per rank; the last two are 8× and 16× wider (an LM head has this shape).
# Cutting it into equal *layer counts* gives one stage almost all the work.

# %%
cfg = train.Config()
for p in (2, 4):
    flops = train.block_flops(train.model_widths(cfg, p), cfg.d_model)  # 4 blocks per rank
    uniform = partition.uniform_partition(len(flops), p)
    balanced = partition.balanced_partition(flops, p)
    print(f"p={p}: uniform {uniform} -> stage FLOPs {partition.stage_costs(flops, uniform)}")
    print(f"     balanced {balanced} -> stage FLOPs {partition.stage_costs(flops, balanced)}")
    print(f"     brute force agrees: {partition.brute_force_partition(flops, p)}, "
          f"so does the bisection: {partition.bisection_optimum(flops, p)}")

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
# activation memory ((2(p−r−1)+(v−1)p+1)/v on rank r) and about v times more messages.

# %%
p, m = 4, 8
for name, events, v in [("GPipe", simulate(gpipe_order(p, m)), 1),
                        ("1F1B", simulate(one_f_one_b_order(p, m)), 1),
                        ("interleaved v=2", simulate(schedules.interleaved_order(p, m, 2), 0.5, 0.5), 2),
                        ("interleaved v=4", simulate(schedules.interleaved_order(p, m, 4), 0.25, 0.25), 4)]:
    peaks = [schedules.peak_in_flight(events, r, v) for r in range(p)]
    print(f"{name:16s} bubble {float(bubble_fraction(events, p)):.3f}   peak activations per rank {peaks}")
print("interleaved formula, v=2:", [schedules.interleaved_peak(p, m, 2, r) for r in range(p)])

# %% [markdown]
# ## When messages cost something
# `simulate(..., comm=c)` delays every operation that waits for another rank by c. Interleaving
# sends about v times more messages; past some c it stops paying.

# %%
p, m = 4, 8
cs = [Fraction(k, 8) for k in range(0, 25)]
one_f = [max(e.end for e in simulate(one_f_one_b_order(p, m), 1, 2, comm=c)) for c in cs]
inter = [max(e.end for e in simulate(schedules.interleaved_order(p, m, 2), Fraction(1, 2), 1, comm=c)) for c in cs]
plt.figure(figsize=(5.5, 3))
plt.plot([float(c) for c in cs], one_f, "o-", label="1F1B")
plt.plot([float(c) for c in cs], inter, "s--", label="interleaved, v=2")
plt.xlabel("message delay (units of a stage's forward)")
plt.ylabel("simulated step")
plt.title(f"p={p}, m={m}: break-even near c = 11/8", fontsize=10)
plt.legend()
plt.show()

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
ax2.bar(kinds, [figs[f"{k} step, balanced"]["measured"] for k in kinds], color="grey", label="measured (median)")
ax2.scatter(kinds, [figs[f"{k} step, balanced"]["expected"] for k in kinds], color="black", zorder=3,
            label="simulated, free messages")
spread = [figs[f"{k} step, balanced"]["spread"] for k in kinds]
ax2.vlines(kinds, [lo for lo, _ in spread], [hi for _, hi in spread], color="black", linewidth=1)
ax2.set_title("wall-clock step (ms), 2 CPU ranks")
ax2.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## Exercises
# The lesson's exercises come with hints and worked answers. In short:
# 1. On 4 ranks, with m = 8 and m = 16: how do the counted bubbles and peaks change?
# 2. Put the heavy block first (`--widths 512 256 32 32 32 32 32 32`): where does the cut go?
# 3. With `simulate(..., comm=c)`: at what message cost does interleaving stop paying?
# 4. Balance a GPT-2-medium-like model on parameters instead of FLOPs: how much slower is it?
