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
# # Chapter 15 · Profiling and tuning · 性能分析与调优
#
# Before tuning a distributed job, measure where a step's time goes. This notebook runs a
# profiled DDP step on two processes, reads the exported Chrome trace back, splits each step
# into compute, communication and idle time from the trace's own events, and draws it; then it
# recomputes the run's MFU from the FLOPs formula. The lesson is
# [chapters/ch15_profiling/README.md](../chapters/ch15_profiling/README.md).

# %%
import inspect

import matplotlib.pyplot as plt

from chapters.ch15_profiling import trace_breakdown, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## Named ranges
# Each phase of the step is a named range: `record_function` puts it in the profiler trace
# (on CPU that is all there is); on CUDA the same name also becomes an NVTX range that
# Nsight Systems (`nsys profile -t cuda,nvtx,osrt ...`) shows on its timeline.

# %%
print(inspect.getsource(train.annotate))

# %% [markdown]
# ## The real run: two processes under torchrun
# Two warm-up and ten timed steps (MFU), three profiled steps (trace), then the same
# all-reduces timed on their own.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch15"
result = run_torchrun(REPO_ROOT / "chapters/ch15_profiling/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %% [markdown]
# ## Reading the trace back
# Communication is the union of the collective events (`c10d::allreduce_` on the main thread,
# `gloo:all_reduce` on gloo's worker thread), compute the union of `aten::` ops outside it,
# idle the rest of the `train_step` range.

# %%
print(inspect.getsource(trace_breakdown.breakdown))
events = trace_breakdown.load_trace(out_dir / "trace.json.gz")
b = trace_breakdown.breakdown(events)
print({k: round(v, 1) for k, v in b.items()})

# %% [markdown]
# The first profiled step on a timeline: one row per thread, each event a bar.

# %%
step = sorted(trace_breakdown.spans(events, "train_step"))[0]
lo, hi = step
shown = [e for e in events if e["ts"] >= lo and e["ts"] + e["dur"] <= hi
         and (trace_breakdown.is_collective(e) or trace_breakdown.is_compute(e))]
threads = sorted({e["tid"] for e in shown}, key=str)
fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 4), gridspec_kw={"height_ratios": [2, 1]})
for e in shown:
    colour = "tab:red" if trace_breakdown.is_collective(e) else "tab:blue"
    ax.barh(threads.index(e["tid"]), e["dur"] / 1e3, left=(e["ts"] - lo) / 1e3, color=colour, height=0.6)
ax.set_yticks(range(len(threads)), [f"thread {t}" for t in threads])
ax.set_xlabel("ms into the step (blue: aten ops, red: collectives)")
parts = {"compute": b["compute_us"], "communication": b["comm_us"], "idle": b["idle_us"]}
left = 0.0
for (name, us), colour in zip(parts.items(), ["tab:blue", "tab:red", "tab:gray"]):
    bx.barh(0, us / b["steps"] / 1e3, left=left, color=colour, label=name)
    left += us / b["steps"] / 1e3
bx.set_yticks([])
bx.set_xlabel("ms per step, from the trace")
bx.legend(ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.6))
plt.tight_layout()
plt.show()

# %% [markdown]
# ## MFU from the formula
# MFU = model FLOPs per step / (step time × peak FLOP/s), with the peak measured by an fp32
# matmul at the ranks' own thread count (1 under torchrun).

# %%
fig_ = {k: v["measured"] for k, v in result.summary["figures"].items()}
recomputed = fig_["model FLOPs per step per rank"] / (fig_["step time, median"] / 1e3) / fig_["matmul peak, same threads"]
print(f"MFU recorded {fig_['MFU']:.4f}, recomputed {recomputed:.4f}")

# %% [markdown]
# ## Exercises
# 1. Run with `--d-hidden 2048`. How do MFU and the compute share of the step change, and why?
# 2. Open `runs/notebooks/ch15/trace.json.gz` in ui.perfetto.dev and find the gloo worker thread.
# 3. Run with `--compile` (inductor: a minute on CPU) and read Dynamo's graph-break report.
