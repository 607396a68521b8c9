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
# # Chapter 14 · Logging and monitoring · 日志与监控
#
# A distributed run is only as fast as its slowest rank, and only as trustworthy as the logs it
# leaves behind. This notebook runs the chapter's script on two CPU processes with rank 1 slowed
# on purpose, then reads back everything it wrote: the JSON metrics (checked against their
# schema), the TensorBoard event files, the offline Weights & Biases run, and the per-rank step
# times that give the straggler away. The lesson is
# [chapters/ch14_monitoring/README.md](../chapters/ch14_monitoring/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt

from chapters.ch14_monitoring import monitor, train
from common.checkpoint import load_checkpoint
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The schema of a metrics line
# One JSON object per line, with these keys and types. Anything that reads the logs (a
# dashboard, an alert, a test) relies on them, so the script validates its own file.

# %%
print(json.dumps(monitor.METRICS_SCHEMA, indent=2))

# %% [markdown]
# ## Where the clocks are
# One step, timed in two parts: compute up to the all-reduce, and the wait inside it.

# %%
print(inspect.getsource(train.timed_step))

# %% [markdown]
# ## A real run: two ranks, rank 1 sleeps 30 ms per step

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch14"
result = run_torchrun(train.__file__, nproc=2, out_dir=out_dir,
                      args=["--slow-rank", "1", "--slow-ms", "30"])
print(result.output[result.output.index("straggler"):])

# %% [markdown]
# ## The JSON log, validated
# Every line follows the schema; a line with a key missing or a wrong type does not.

# %%
lines = [json.loads(t) for t in (out_dir / "metrics.jsonl").read_text().splitlines()]
print(json.dumps(lines[-1]))
print("invalid lines:", monitor.validate_file(out_dir / "metrics.jsonl"))
broken = {**lines[-1], "loss": "0.4"}
del broken["lr"]
print("a broken line:", monitor.validate_line(json.dumps(broken)))

# %%
fig, axes = plt.subplots(1, 4, figsize=(13, 2.8))
for ax, key in zip(axes, ("loss", "lr", "grad_norm", "samples_per_s")):
    ax.plot([line["step"] for line in lines], [line[key] for line in lines], marker=".")
    ax.set_title(key)
    ax.set_xlabel("step")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## TensorBoard and W&B hold the same numbers
# TensorBoard's own `EventAccumulator` reads the event files; the offline W&B run file is a log
# of W&B's protobuf records, decoded with W&B's own message classes. Both agree with
# metrics.jsonl (TensorBoard stores float32, W&B the exact Python float).

# %%
tb = monitor.read_tensorboard_scalars(out_dir / "tb")
history = monitor.read_wandb_history(out_dir)
print("TensorBoard tags:", sorted(tb))
print("W&B run file:", monitor.wandb_run_file(out_dir).relative_to(out_dir))
for (step, tb_loss), wb, line in list(zip(tb["loss"], history, lines))[:4]:
    print(f"step {step:2d}  jsonl {line['loss']:.7f}  tensorboard {tb_loss:.7f}  wandb {wb['loss']:.7f}")

# %% [markdown]
# ## Finding the straggler
# Whole step times are equal on every rank: the all-reduce makes the fast rank wait for the slow
# one. The time each rank needs to *reach* the all-reduce tells them apart.

# %%
times = load_checkpoint(out_dir / "step_times.pt")
found = monitor.find_stragglers(times["compute"].tolist())
fig, axes = plt.subplots(1, 3, figsize=(13, 3), sharey=True)
for ax, key in zip(axes, ("whole", "compute", "wait")):
    for r in range(times[key].shape[0]):
        ax.plot(times[key][r] * 1e3, label=f"rank {r}")
    ax.set_title(f"{key} (ms)")
    ax.set_yscale("log")
    ax.legend()
plt.show()
print("median compute per rank (ms):", [round(m * 1e3, 2) for m in found["medians"]])
print("thresholds (ms):", [round(t * 1e3, 2) for t in found["thresholds"]], " flagged:", found["flagged"])
print("on whole step times the detector flags:", monitor.find_stragglers(times["whole"].tolist())["flagged"])

# %%
print(inspect.getsource(monitor.find_stragglers))

# %% [markdown]
# ## MFU and its denominator
# Each line logs MFU = 6·N·(samples per rank) / (step time × peak). On a GPU the peak is the
# datasheet's; on this CPU it is a measured matmul, noisy and not a hardware promise.

# %%
figures = {k: v["measured"] for k, v in result.summary["figures"].items()}
print("peak:", figures["peak source"], f"{figures['peak used for MFU']:.1f} GFLOP/s")
print("MFU of the last logged step:", lines[-1]["mfu"])

# %% [markdown]
# ## Exercises
# The lesson's exercises (with hints and answers): a small straggler and the threshold's three
# terms (`--straggler-min-gap-ms`), a new schema key, per-rank charts with `add_scalars`, and what
# an all-reduce of (sum, sum of squares, max) can and cannot tell.
