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
# # Chapter 16 · Numerical stability at scale · 大规模训练中的数值稳定性
#
# Long runs meet loss spikes, exploding gradients, NaNs from one bad batch, and the quiet
# rounding of low precision. This notebook looks at the defences one by one (global-norm
# clipping over shards, agreed step skipping, spike detection, fp32 accumulators and master
# weights), then runs the real FSDP2 script on two processes.
# The lesson is [chapters/ch16_stability/README.md](../chapters/ch16_stability/README.md).

# %%
import inspect
import math

import matplotlib.pyplot as plt

from chapters.ch16_stability import plots, precision, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The global norm over shards
# Under FSDP2 each rank holds a shard of every gradient. The norm of the whole gradient is the
# square root of the sum, over ranks, of each rank's local sum of squares: one all-reduce of a
# scalar. Leave it out and every rank clips by a different, too small norm.

# %%
print(inspect.getsource(train.local_grad_sq_norm))
print(inspect.getsource(train.global_grad_norm))
print(inspect.getsource(train.clip_by_global_norm))

# %% [markdown]
# ## Skipping a bad step on every rank
# A rank that sees a NaN must not skip alone: its peers would step (and the model's shards split
# silently), or wait in a collective it never enters. One MAX all-reduce of a 0/1 flag makes the
# decision common.

# %%
print(inspect.getsource(train.all_ranks_agree))
print(inspect.getsource(train.is_spike))

# %% [markdown]
# The training loop as a world of one (no collectives): a NaN in the batch at step 8, an inf in
# the gradient at step 17 and a spike at step 13, all skipped; training goes on. On several ranks
# the NaN reaches every rank's gradient shard through the reduce-scatter, while the inf, written
# after it, is seen by one rank only: there the MAX all-reduce is what makes the others skip.

# %%
run = plots.one_process_run(train.Config())
print("skipped (non-finite):", run["skipped_bad"], " spikes:", run["spikes"],
      " optimizer steps:", len(run["taken"]))
plt.figure(figsize=(5, 3))
plt.semilogy([x if math.isfinite(x) else float("nan") for x in run["every_loss"]], marker="o")
plt.xlabel("step")
plt.ylabel("global loss")
plt.show()

# %% [markdown]
# ## Where bf16 hurts: a long running sum
# bf16 has 8 significand bits (unit roundoff u = 2⁻⁸). Adding v = 2⁻¹⁰ again and again, the
# sum stops at 2⁸·v = 0.25, where v is exactly half an ulp and rounds away.

# %%
s16, s32 = precision.running_sums(2.0**-10, 2000)
print("bf16:", s16[-1], " fp32:", s32[-1], " predicted stagnation:", precision.stagnation_point(2.0**-10))
plt.figure(figsize=(5, 3))
plt.plot(s32, label="fp32")
plt.plot(s16, label="bf16")
plt.xlabel("terms")
plt.legend()
plt.show()

# %% [markdown]
# Kahan's compensated sum carries what each addition lost, but in bf16 the carry has 8 bits too:
# it stops at 2¹⁶·v instead of 2⁸·v.

# %%
v = 2.0**-10
print("naive:", precision.naive_sum([v] * 2**17), " Kahan:", precision.kahan_sum([v] * 2**17),
      " predicted:", precision.stagnation_point(v), precision.kahan_stagnation_point(v))

# %% [markdown]
# 10⁵ random values in [0, 10⁻³): each fix against the naive bf16 sum, beside Higham's worst-case
# bound (inf: no bound exists; a bound of 1 or more says nothing for a sum of positive terms).

# %%
errors = precision.accumulation_errors(100_000)
print(f"{'method':32s} {'sum':>10s} {'rel. error':>11s} {'bound':>10s}")
for name, e in errors.items():
    print(f"{name:32s} {e['sum']:10.5g} {e['rel_error']:11.3e} {e['bound']:10.3e}")
print("exact:", errors["bf16 naive"]["exact"], " stagnation predicted:", errors["bf16 naive"]["stagnation"])

# %% [markdown]
# ## fp32 master weights
# An update smaller than half an ulp of the weight vanishes on a bf16 weight. An fp32 master
# copy accumulates it; the forward pass uses the master's bf16 image.

# %%
print(precision.master_weight_demo(1.0, 1e-3, 1000))
print(precision.fp16_range_demo())

# %% [markdown]
# ## The real run: FSDP2 on two processes
# Hand-written global norm vs `clip_grad_norm_`, both vs one unsharded process; the poisoned
# steps (a NaN in rank 1's batch, an inf in rank 0's gradient shard) and the spiking step skipped;
# the accumulation table. Every check must say `ok`.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch16"
result = run_torchrun(REPO_ROOT / "chapters/ch16_stability/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %%
for check in result.summary["checks"]:
    print(f"{'ok ' if check['ok'] else 'FAIL'} {check['name']}: {check['measured']}")

# %% [markdown]
# ## Exercises
# The lesson's exercises (with hints and answers): other poisons and ranks, false spikes with a
# lower factor or a shorter window, a global norm without its all-reduce, and signed terms
# (`precision.accumulation_errors(100_000, low=-1e-3)`).
