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
# `finish_gradient_sync()`, waits for them before the optimizer step. The lesson is
# [chapters/ch08_overlap/README.md](../chapters/ch08_overlap/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch08_overlap import bucketed, plots, train
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
    layout = train.bucket_names(model, kb * 1024)
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
# ## The real run: three ways on two processes
# Naive (chapter 03's `all_reduce_gradients` after backward), `BucketedDDP` and torch DDP,
# each checked against one process on the global batch; then a sweep over bucket sizes and a
# profiler trace of each variant (`trace_*.json.gz`, open it in https://ui.perfetto.dev).

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch08"
result = run_torchrun(REPO_ROOT / "chapters/ch08_overlap/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %% [markdown]
# ## Timeline of one step on rank 0
# Grey ticks: a gradient is ready; blue: an all-reduce is launched; green: it is waited for;
# red: `backward()` returned. The naive loop launches only after the red line; the bucketed
# wrapper launches its first bucket when 3 of 27 gradients exist; DDP does the same with its
# own bucket layout (it rebuilds its buckets after the first step in the order gradients
# actually arrived, and waits inside backward, so its waits are not in the log).

# %%
logs = json.loads((out_dir / "events.json").read_text())
fig, ax = plt.subplots(figsize=(10.5, 3.2))
plots.draw_timeline(ax, logs)
fig.tight_layout()
plt.show()
first = next(e for e in logs["bucketed"] if e["kind"] == "launch")
print("first bucketed launch:", first)

# %% [markdown]
# ## Step time against bucket size (reported, never asserted)
# On two processes sharing two cores the gain of the bucketed versions over the naive one is
# mostly *fewer, larger* messages (each all-reduce pays a fixed latency); the 4096 KiB cap is
# one bucket, launched at the end of backward: no overlap, one message. See the lesson for
# what a GPU shows instead.

# %%
figures = result.summary["figures"]
names = [n for n in figures if n.startswith("bucketed step time, cap")]
labels = ["naive"] + [n.split("cap ")[1] for n in names] + ["DDP"]
values = [figures["naive step time"]["measured"]] + [figures[n]["measured"] for n in names] \
    + [figures["ddp step time"]["measured"]]
plt.figure(figsize=(8, 3))
plt.bar(labels, values, color=["tab:gray"] + ["tab:blue"] * len(names) + ["tab:orange"])
plt.ylabel("median step time (ms)")
plt.xticks(fontsize=8)
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run the script with `--sweep-kb 1 4 16 64 256 1024`. Where is the best cap, and why does
#    a very small cap get slower again?
# 2. Make `_grad_ready` launch a bucket as soon as it is full, not in bucket order. Run it on
#    two ranks with a model whose gradients arrive out of order. What happens, and why?
# 3. Add a `no_sync()` context manager to `BucketedDDP` for gradient accumulation (chapter 03).
