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
# into compute, communication (and the part of it no compute hides: exposed communication) and
# idle time from the trace's own events, draws it, reads the step's memory from the same trace,
# and recomputes the run's MFU from the FLOPs formula. The lesson is
# [chapters/ch15_profiling/README.md](../chapters/ch15_profiling/README.md).

# %%
import inspect

import matplotlib.pyplot as plt

from chapters.ch15_profiling import plots, trace_breakdown, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## Named ranges
# Each phase of the step is a named range: `record_function` puts it in the profiler trace
# (on CPU that is all there is); on CUDA the same name also becomes an NVTX range that
# Nsight Systems shows on its timeline.

# %%
print(inspect.getsource(train.annotate))

# %% [markdown]
# ## The real run: two processes under torchrun
# Two warm-up and ten timed steps (MFU), three profiled steps (trace and memory), then the same
# all-reduces timed on their own. Timings vary from run to run on a shared machine.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch15"
result = run_torchrun(REPO_ROOT / "chapters/ch15_profiling/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %% [markdown]
# ## Reading the trace back
# Communication is the union of the collective events (`c10d::allreduce_` on the main thread,
# `gloo:all_reduce` on gloo's worker thread), compute the union of `aten::` ops; exposed
# communication is the communication no compute overlaps, idle what neither covers. The script
# checks the interval arithmetic against a second computation, a sweep over elementary segments.

# %%
print(inspect.getsource(trace_breakdown.breakdown))
events = trace_breakdown.load_events(out_dir / "trace.json.gz")
b = trace_breakdown.breakdown(events)
print({k: round(v, 1) for k, v in b.items()})
print({k: round(v, 1) for k, v in trace_breakdown.sweep_breakdown(events).items()})

# %% [markdown]
# The first profiled step on a timeline (one row per thread, each event a bar), and the split
# per step: compute + exposed communication + idle = the step.

# %%
fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 4.5), gridspec_kw={"height_ratios": [2, 1]})
plots.draw_step_timeline(ax, events)
plots.draw_breakdown(bx, {"this run": b})
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Memory from the same trace
# `profile_memory=True` adds one `[memory]` event per allocation and free. A step frees its
# gradients (`zero_grad(set_to_none=True)`), allocates them again in backward, and the update
# `p -= lr * p.grad` allocates a temporary the size of each parameter.

# %%
cfg = train.Config()
dims = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layers - 1) + [1]
grad_bytes = 4 * sum(d_in * d_out + d_out for d_in, d_out in zip(dims, dims[1:]))
for i, m in enumerate(trace_breakdown.memory_by_step(events)):
    print(f"step {i}: allocated {m['allocated']} B, peak above start {m['peak'] - m['start']} B, "
          f"end - start {m['end'] - m['start']} B")
fig, ax = plt.subplots(figsize=(9, 3))
plots.draw_memory(ax, events, grad_bytes)
plt.show()

# %% [markdown]
# ## MFU from the formula
# MFU = model FLOPs per step / (step time × peak FLOP/s). On a GPU the peak is the datasheet's;
# on this CPU it is a measured fp32 matmul at the ranks' own thread count (1 under torchrun):
# a noisy stand-in, not a peak the hardware promises.

# %%
fig_ = {k: v["measured"] for k, v in result.summary["figures"].items()}
recomputed = fig_["model FLOPs per step per rank"] / (fig_["step time, median"] / 1e3) / fig_["peak FLOP/s for MFU"]
print(f"peak: {fig_['peak source']}")
print(f"MFU recorded {fig_['MFU']:.4f}, recomputed {recomputed:.4f}")

# %% [markdown]
# ## Exercises
# The lesson's exercises (with hints and answers) start from this run: a larger model and MFU,
# the barrier before each profiled step, DDP's bucket size and exposed communication, and the
# memory of the update. Open `runs/notebooks/ch15/trace.json.gz` in ui.perfetto.dev to see the
# same events the plots draw.
