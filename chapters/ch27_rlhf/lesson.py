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
# # Chapter 27 · Reinforcement learning and RLHF · 强化学习与分布式训练
#
# A tiny decoder learns to write three digits that sum to a target, rewarded exactly by a
# program (or by a reward model trained on preferences). This notebook looks at the task, works
# GAE, the clipped objective, GRPO's advantages and PPO's KL-penalised rewards on small numbers,
# pushes weights from a trainer to generators, then runs the real asynchronous pipeline on two
# processes and draws its timeline. The lesson is
# [chapters/ch27_rlhf/README.md](../chapters/ch27_rlhf/README.md).

# %%
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch27_rlhf import checks, rl, sync
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The verifiable task
# Reward 1 − |sum − T| / 27: exact, cheap, no judge. A policy of uniform random digits scores:

# %%
print(f"uniform random digits: expected reward {checks.uniform_policy_reward(3):.4f}")
targets = torch.tensor([6, 6, 20])
digits = torch.tensor([[1, 2, 3], [9, 9, 9], [9, 9, 2]])
print("rewards:", rl.reward(targets, digits).tolist())

# %% [markdown]
# ## GAE, the clipped objective, GRPO's advantages and PPO's KL penalty, on hand-worked numbers

# %%
adv, returns = rl.gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), 1.0, 0.9)
print("GAE advantages", adv.tolist(), "returns", returns.tolist())
ratio = torch.tensor([1.5, 0.5, 1.5, 0.5])
print("clipped objective", rl.clipped_objective(ratio.log(), torch.zeros(4),
                                                torch.tensor([1.0, 1.0, -1.0, -1.0]), 0.2).tolist())
print("GRPO advantages", rl.grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4).tolist())
# PPO's per-token reward: −β·(log π_old − log π_ref) on every token, the score on the last
print("KL-penalised rewards", rl.kl_penalty_rewards(torch.tensor([1.0]), torch.tensor([[0.5, -0.2, 0.1]]),
                                                     torch.zeros(1, 3), beta=0.1).tolist())

# %% [markdown]
# ## A delta push costs 16 bytes plus 12 per changed element; a full push 4 per element

# %%
model = rl.TinyDecoder()
flat = sync.flatten(model)
n = len(flat)
for k in (10, 100, 1000, n):
    print(f"k = {k:6d} changed: delta {sync.delta_bytes_formula(k, flat):7d} B, full {4 * n} B")

# %% [markdown]
# ## The real run: a trainer and a generator under torchrun
# Hand-worked checks, the initial broadcast, the push protocol with its control, then 60 GRPO
# updates: the generator samples the batch of step t + 1 while the trainer trains on step t.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch27"
result = run_torchrun(REPO_ROOT / "chapters/ch27_rlhf/train.py", nproc=2,
                      args=["--log-every", "1"], out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %%
steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3))
ax1.plot([s["step"] for s in steps], [s["reward"] for s in steps])
ax1.axhline(checks.uniform_policy_reward(3), color="k", ls=":")
ax1.set_xlabel("update")
ax1.set_ylabel("mean reward")
ax2.plot([s["step"] for s in steps], [s["kl"] for s in steps])
ax2.set_xlabel("update")
ax2.set_ylabel("KL(π‖π_ref) per token")
plt.show()

# %% [markdown]
# ## The timeline each rank recorded: generation of step t + 1 beside training on step t

# %%
ranks = json.loads((out_dir / "timeline.json").read_text())["ranks"]
colours = {"generate": "C2", "train": "C0", "gather": "C7", "push": "C1"}
fig, ax = plt.subplots(figsize=(10, 2))
for r, events in enumerate(ranks):
    for what, i, start, end in events:
        if i <= 6:
            ax.barh(r, (end - start) * 1e3, left=start * 1e3, color=colours[what])
ax.set_yticks([0, 1], ["trainer", "generator"])
ax.set_xlabel("ms")
plt.show()
trains = {i: (s, e) for what, i, s, e in ranks[0] if what == "train"}
beside = sum(min(e, trains[i - 1][1]) > max(s, trains[i - 1][0])
             for what, i, s, e in ranks[1] if what == "generate" and i - 1 in trains)
print(f"generations of batch t+1 overlapping the training of t on the clock: {beside} of "
      f"{len(trains) - 1}")

# %% [markdown]
# ## Exercises
# The lesson's exercises, with hints and worked answers
# ([README.md](../chapters/ch27_rlhf/README.md#exercises)):
# 1. Below how many changed elements is a delta push cheaper than a full one, in float32 and bf16?
# 2. Run with `--staleness 0` and `--staleness 4`: what happens to the reward curve and why does
#    the run still learn? What does the timeline show at staleness 0?
# 3. Why does GRPO give a group whose completions all earn the same reward no gradient?
# 4. Run `--placement colocated` on 2 ranks: what does it communicate instead of weights?
