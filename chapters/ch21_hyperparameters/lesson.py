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
# # Chapter 21 · Hyperparameters at scale · 分布式训练中的超参数调优
#
# Schedules as pure functions, the gradient noise scale measured from the two gradients data
# parallelism already has (the micro-batch's and the all-reduced one), and steps to a target
# loss against the batch size. The lesson is
# [chapters/ch21_hyperparameters/README.md](../chapters/ch21_hyperparameters/README.md).

# %%
import inspect

import matplotlib.pyplot as plt
import torch

from chapters.ch21_hyperparameters import gns, problem, schedules, train
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## Schedules are functions of the step
# No optimizer, no state: the value at any step can be compared with its formula.

# %%
steps = range(101)
plt.figure(figsize=(6, 3))
plt.plot(steps, [schedules.cosine(s, 1.0, 100, 10, 0.1) for s in steps], label="warm-up + cosine")
plt.plot(steps, [schedules.wsd(s, 1.0, 100, 10, 20, 0.1) for s in steps], "--", label="WSD")
plt.xlabel("step")
plt.ylabel("lr / peak")
plt.legend()
plt.show()
print("cosine at the middle of its decay:", schedules.cosine(55, 1.0, 100, 10, 0.1))

# %% [markdown]
# ## The noise scale from two norms
# |G_b|^2 at the micro-batch size b and |G_B|^2 at the global batch B give |G|^2 and tr(Sigma):

# %%
print(inspect.getsource(gns.noise_scale))
cfg = train.Config()
x, y = problem.sample(cfg, cfg.global_batch_size, torch.Generator().manual_seed(3))
w = 0.3 * problem.teacher(cfg)
grads = gns.per_example_grads(w, x, y)
small = (grads**2).sum(1).mean().item()
big = (grads.mean(0) ** 2).sum().item()
print("from the two norms:", gns.noise_scale(small, big, 1, len(y))["b_simple"])
print("per-example exact: ", gns.exact_noise_scale(grads)["b_simple"])

# %% [markdown]
# ## Both noise scales in closed form
# For Gaussian features and labels, Sigma = 4(L V + V e e^T V) (Isserlis), so
# B_simple = 1 + L tr V / (e^T V^2 e) and B_noise = 1 + L tr V^2 / (e^T V^3 e). At the point
# where the path from 0 to w* reaches the target loss, the script measures both the
# data-parallel way and checks them against these:

# %%
print(inspect.getsource(problem.closed_form_noise_scales))
print(problem.closed_form_noise_scales(cfg, problem.target_point(cfg)))

# %% [markdown]
# ## The real run: two processes under torchrun

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch21"
result = run_torchrun(REPO_ROOT / "chapters/ch21_hyperparameters/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %% [markdown]
# ## ASHA's rule, written out
# `tune.py` runs this search in Ray Tune, then four Tune trials that are each a 2-worker
# `TorchTrainer` (about 3 minutes on 2 quiet cores: `python chapters/ch21_hyperparameters/tune.py`);
# here the same rule runs by hand on the formula's losses. Ray's ASHA matches it trial for trial.
# The best region is known: rho(lr) <= rho* + 0.1 around lr* = 2/(h_min + h_max).

# %%
from chapters.ch21_hyperparameters import quadratic, tune, tune_checks

tcfg = tune.Config()
made = tune_checks.asha_by_hand(tcfg, quadratic.grid_order(tcfg))
print("known region:", [round(v, 4) for v in quadratic.known_region(tcfg)])
for lr in sorted(made):
    print(f"lr {lr:.4f}  rho {quadratic.rho(lr, tcfg):.3f}  reports {made[lr]}  "
          f"loss {quadratic.loss_after(lr, made[lr] * tcfg.steps_per_report, tcfg):.3g}")
print("stopped early:", sum(t < tcfg.max_t for t in made.values()), "of", tcfg.grid)

# %% [markdown]
# The training-run trials, one at a time in the order of `--trials` (lr*, the diverging
# 2^(4/3) lr*, lr*/2, 2^(-2/3) lr*), under ASHA with grace 1, reduction factor 2 and max_t 3:
# `asha_replay` takes the results in the order Tune receives them.

# %%
events = [(round(lr, 3), it, quadratic.loss_after(lr, it * tcfg.steps_per_report, tcfg))
          for lr in quadratic.trial_lrs(tcfg) for it in range(1, tcfg.trial_max_t + 1)]
print("reports made:", tune_checks.asha_replay(events, 1, 2, 3))

# %% [markdown]
# ## Exercises
# The lesson's exercises, with hints and worked answers
# ([README.md](../chapters/ch21_hyperparameters/README.md#exercises)):
# 1. Run with `--micro-batch-size 4`: why does the noise-scale parity check disappear?
# 2. Raise `--target-loss` to 1.0: where does the knee move, and why?
# 3. Why does the linear-scaled learning rate stop reaching the target at batch 32?
# 4. Run `tune.py --order-seed 0`: does ASHA still stop more than half of the trials?
