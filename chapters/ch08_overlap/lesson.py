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
# # Chapter 08 · Overlapping communication with compute · 通信计算重叠
#
# Chapter 03 all-reduced every gradient after `loss.backward()` returned: first compute, then
# communicate, never both. Here the gradients are packed into buckets in reverse layer order,
# and each bucket's all-reduce is started with `async_op=True` from a gradient hook the moment
# the bucket is full, while backward keeps computing the earlier layers. One call,
# `finish_gradient_sync()`, waits for them before the optimizer step. A control launches the very
# same buckets only after backward, so overlap can be told apart from "fewer messages". The lesson is
# [chapters/ch08_overlap/README.md](../chapters/ch08_overlap/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch08_overlap import bucketed, checks, plots, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## Buckets, in reverse order
# Backward produces the last layer's gradients first, so the buckets are filled from the end
# of the parameter list. The model is a TinyGPT whose output head is tied to the token
# embedding (one parameter, used twice) and whose position embedding is frozen (no gradient):
# 27 trainable tensors, not 29.

# %%
cfg = train.Config()
model = train.build_model(cfg, vocab_size=96, device=torch.device("cpu"))
print(inspect.getsource(bucketed.build_buckets))
for kb in (16, 64, 256, 4096):
    layout = train.bucket_names(model, bucketed.cap_bytes_of(kb / 1024))  # MiB, as DDP takes it
    print(f"cap {kb:5d} KiB: {len(layout):2d} buckets; bucket 0 = {layout[0]}; last = {layout[-1][-2:]}")

# %% [markdown]
# ## The wrapper: a hook per gradient, an asynchronous all-reduce per full bucket
# `_grad_ready` runs inside backward each time a gradient has been accumulated. When the next
# bucket in order is complete, `_launch_bucket` copies its gradients into one flat buffer and
# calls `dist.all_reduce(..., async_op=True)`, which returns a `Work` handle at once.
# `finish_gradient_sync` waits on the handles and writes the averages back.

# %%
print(inspect.getsource(bucketed.BucketedDDP._grad_ready))
print(inspect.getsource(bucketed.BucketedDDP._launch_bucket))
print(inspect.getsource(bucketed.BucketedDDP.finish_gradient_sync))

# %% [markdown]
# ## How the log sees launches and completions
# The event log replaces `dist.all_reduce` while a variant trains, so it sees every launch (with
# the bytes handed to it) whoever makes it, and asks each `Work` `is_completed()` at every
# gradient, right after the wrapper's own hooks and at the end of backward. An all-reduce is
# *hidden under backward* when backward produced another gradient after its launch and it was
# seen complete before backward ended; one waited for inside the hook that launched it is not:

# %%
print(inspect.getsource(bucketed.EventLog.observe_all_reduce))
print(inspect.getsource(bucketed.EventLog.poll))
print(inspect.getsource(checks.hidden_under_backward))

# %% [markdown]
# ## The real run: four ways on two processes
# Naive (chapter 03's `all_reduce_gradients` after backward), the same buckets launched after
# backward (`BucketedDDP(overlap=False)`), `BucketedDDP` and torch DDP, each checked against one
# process on the global batch. A fixed 20 ms sleep in each block's backward stands in for
# accelerator compute, so that the early buckets have something to hide behind (three steps, no
# sweep, no traces, to stay quick; the lesson shows the default run too).

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch08"
result = run_torchrun(REPO_ROOT / "chapters/ch08_overlap/train.py", nproc=2, out_dir=out_dir,
                      args=["--backward-sleep-ms", "20", "--steps", "3", "--profile-steps", "0",
                            "--sweep-kb", "64"])
print(result.output[result.output.index("figure"):])

# %% [markdown]
# ## Timeline of one step on rank 0 (order, not time)
# Grey ticks: a gradient is ready; blue: an all-reduce is launched; green: it is seen complete;
# red: the end of backward. The naive loop and the deferred buckets launch only after the red
# line; the bucketed wrapper launches its first bucket when 3 of 27 gradients exist and sees the
# early ones complete before the red line; DDP (its buckets rebuilt after the first step in the
# order gradients arrived) waits for all of them inside backward. The x axis is the position in
# the log: a 20 ms sleep and a tiny copy each take one slot.

# %%
kinds = list(checks.VARIANTS)
logs = json.loads((out_dir / "events.json").read_text())
fig, ax = plt.subplots(figsize=(10.5, 3.2))
plots.draw_timeline(ax, logs)
fig.tight_layout()
plt.show()
first = next(e for e in logs["bucketed"] if e["kind"] == "launch")
print("first bucketed launch:", first)
print("DDP's first step:", [e["what"] for e in logs["ddp_first_step"] if e["kind"] == "launch"])
print("hidden under backward in this step:", {k: checks.hidden_under_backward(logs[k]) for k in kinds})

# %% [markdown]
# ## Step times: overlap alone, and fewer messages alone (reported, never asserted)
# The deferred control sends the same buckets as the overlapped wrapper, so bucketed ÷ deferred
# is what overlap alone buys; deferred ÷ naive is what fewer, larger messages alone buy. Each bar
# is the slowest rank's median step, the whisker its fastest and slowest step: one run on a
# shared machine, expect it to move.

# %%
figures = result.summary["figures"]
median = [figures[f"{k} step time (median, min-max)"]["measured"] for k in kinds]
low, high = zip(*(figures[f"{k} step time (median, min-max)"]["spread"] for k in kinds))
plt.figure(figsize=(6, 3))
plt.bar(kinds, median, yerr=[[m - lo for m, lo in zip(median, low)], [hi - m for m, hi in zip(median, high)]],
        color=["tab:gray", "tab:purple", "tab:blue", "tab:orange"], capsize=4)
plt.ylabel("step time (ms)")
plt.show()
print("bucketed / deferred:", round(figures["bucketed / deferred step time"]["measured"], 3),
      "  deferred / naive:", round(figures["deferred / naive step time"]["measured"], 3))

# %% [markdown]
# ## Exercises
# The lesson's five exercises carry hints and worked answers. Two start from this notebook:
# exercise 1 (sweep the bucket cap: where does the per-message latency take over?) and
# exercise 3 (`no_sync()` for gradient accumulation, compared with chapter 03).
