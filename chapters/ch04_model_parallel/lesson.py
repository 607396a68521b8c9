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
# micro-batches so the stages overlap, leaving a *bubble* of (p−1)/(m+p−1): counted here on a
# simulated timeline, then measured on stages whose work is a fixed sleep.
# The lesson is [chapters/ch04_model_parallel/README.md](../chapters/ch04_model_parallel/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt

from chapters.ch04_model_parallel import gpipe, plots, schedule, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## One stage's forward and backward
# A stage receives its input (or reads the batch on rank 0), runs its layers and sends the
# output on. In backward it receives the gradient of its output, backpropagates, and sends the
# gradient of its input back. The received activation must `requires_grad_()`, or there is no
# input gradient to send.

# %%
print(inspect.getsource(gpipe.stage_forward))
print(inspect.getsource(gpipe.stage_backward))

# %% [markdown]
# ## GPipe: the same two functions, over m micro-batches
# Each micro-batch loss is scaled by 1/m, so the gradients that add up in `.grad` are those of
# the whole batch's mean loss.

# %%
print(inspect.getsource(gpipe.gpipe_step))

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
# Naive split, hand-written GPipe, the serial control (the same micro-batches one after
# another) and `torch.distributed.pipelining` (ScheduleGPipe, Schedule1F1B) must all give the
# unsplit model's loss and gradients; then GPipe trains for 20 steps beside the unsplit model,
# and GPipe steps are timed on real layers and on stages whose work is a fixed sleep.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch04"
result = run_torchrun(REPO_ROOT / "chapters/ch04_model_parallel/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %% [markdown]
# ## Two measured timelines
# Top: real layers, where the gaps are waiting for messages and for a core (on a busy CPU the
# two ranks often take turns instead of computing at once). Bottom: fixed-sleep stages, where
# the schedule alone decides: rank 0 starts each next forward while rank 1 is still busy with
# the previous one, the two stages compute at the same time, and the idle share is the bubble.

# %%
fig, axes = plt.subplots(2, 1, figsize=(9, 3.6))
for ax, (name, title) in zip(axes, [("timeline.json", "real layers"), ("timeline_sleep.json", "fixed-sleep stages")]):
    events = [schedule.Event(**e) for e in json.loads((out_dir / name).read_text())]
    events = [schedule.Event(e.rank, e.kind, e.mb, e.stage, e.start * 1e3, e.end * 1e3) for e in events]
    plots.draw_timeline(ax, events, 2, f"measured GPipe step, 2 CPU ranks, {title}", labels=name != "timeline.json")
axes[-1].set_xlabel("ms (boxes: compute; gaps: waiting and communication)")
fig.tight_layout()
plt.show()

# %%
figs = result.summary["figures"]
checks = {c["name"]: c for c in result.summary["checks"]}
ms = sorted(int(n.split("m=")[1]) for n in figs if n.startswith("real layers: bubble"))
band = train.Config().sleep_band
sleep = [next(c for n, c in checks.items() if n.startswith(f"fixed-sleep GPipe bubble, m={k}:"))["measured"] for k in ms]
plt.figure(figsize=(5.5, 3.2))
plt.plot(ms, [float(schedule.bubble_formula(2, k)) for k in ms], "o-", color="grey", label="(p-1)/(m+p-1)")
plt.fill_between(ms, [max(0, float(schedule.bubble_formula(2, k)) - band) for k in ms],
                 [float(schedule.bubble_formula(2, k)) + band for k in ms], color="grey", alpha=0.15, label="band")
plt.plot(ms, sleep, "s--", label="fixed-sleep stages (measured)")
plt.plot(ms, [figs[f"real layers: bubble, m={k}"]["measured"] for k in ms], "^:", label="real layers (measured)")
plt.xscale("log", base=2)
plt.xlabel("micro-batches m")
plt.ylabel("bubble fraction")
plt.legend(fontsize=8)
plt.show()
m = train.n_micro_batches(train.Config(), 2)
for kind in ("real layers", "fixed-sleep GPipe"):
    share = figs[f"{kind}: share of the step with two stages computing, m={m}"]
    print(f"{kind}: two stages computing for {share['measured']:.2f} of the step "
          f"(simulated timeline: {share['expected']:.2f})")

# %% [markdown]
# ## Exercises
# The lesson's exercises come with hints and worked answers. In short:
# 1. Run with `--micro-batches 8`: which measured bubble keeps following the formula, and why?
# 2. Reverse the order of the backwards in `gpipe_step`: do the checks pass, does the bubble change?
# 3. Give one stage three times the cost in `schedule.simulate`: how long is the step?
# 4. The serial control passes every parity check: which check catches it?
# 5. Make the sends blocking: do GPipe's stages still overlap? What would 1F1B do?
