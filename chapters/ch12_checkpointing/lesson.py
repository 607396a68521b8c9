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
# # Chapter 12 · Checkpointing · 检查点策略
#
# A checkpoint is only useful if training can continue from it as if nothing had happened. This
# notebook saves a full training state and resumes it bit for bit (and shows what goes wrong
# without the RNG state or the data position), looks at an atomic save, builds a delta
# checkpoint, and runs the sharded (DCP) save and load on two processes.
# The lesson is [chapters/ch12_checkpointing/README.md](../chapters/ch12_checkpointing/README.md).

# %%
import inspect
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed.checkpoint as dcp

from chapters.ch12_checkpointing import delta as deltas
from chapters.ch12_checkpointing import plots, resume, train
from common.checkpoint import atomic_write, load_checkpoint
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## What a resumable checkpoint holds
# Weights are not enough: Adam's moments, the scheduler's position, every random generator
# (dropout) and the position in the data (epoch, batch) are part of the training state.

# %%
print(inspect.getsource(resume.training_state))

# %% [markdown]
# Train 24 steps in one go; then train 10, save, build everything afresh with other random
# states (a new process), load and train the last 14. Only the full state continues the same run.

# %%
cfg = resume.Config()
curves = plots.resume_curves(cfg)
reference = curves["uninterrupted"]
for name, losses in curves.items():
    print(f"{name:28s} bit-identical to uninterrupted: {losses == reference}")
plt.figure(figsize=(7, 3))
for name, losses in curves.items():
    plt.plot(losses, label=name, lw=3 if name == "uninterrupted" else 1)
plt.axvline(cfg.stop_at - 0.5, color="grey", ls=":")
plt.xlabel("step")
plt.ylabel("loss")
plt.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## Atomic saves
# Write to a temporary file beside the target, flush, fsync, then `os.replace`: the checkpoint
# appears whole or not at all. A save killed halfway leaves a `.tmp` file, which the next start
# finds and removes; the previous checkpoint is untouched.

# %%
print(inspect.getsource(atomic_write))

# %%
ckpt_dir = Path(tempfile.mkdtemp(prefix="ch12-"))
resume.save_training_state(ckpt_dir, {"step": 4})
(ckpt_dir / ".step_000008.pt.x1y2.tmp").write_bytes(b"the first 4096 bytes of a killed save")
latest, incomplete = resume.latest_checkpoint(ckpt_dir)
print("resume from:", latest.name, "| incomplete saves removed:", [p.name for p in incomplete])
print("step in it:", load_checkpoint(latest)["step"])

# %% [markdown]
# ## A delta checkpoint
# Fine-tuning an embedding on 64 of 8192 tokens changes 64 rows. Store their flat indices and new
# values: 8 bytes per changed element instead of 4 bytes per element of the table.

# %%
base, new, n_changed = deltas.sparse_finetune(train.Config())
delta = deltas.make_delta(base, new)
print(f"full table {deltas.state_bytes(new):,} B, delta {deltas.delta_bytes(delta):,} B "
      f"({n_changed} changed elements)")
print("restores bit for bit:", torch.equal(deltas.apply_delta(base, delta)["embedding"], new["embedding"]))
lossy = deltas.apply_difference_delta(base, deltas.make_difference_delta(base, new))
print("bf16 differences restore bit for bit:", torch.equal(lossy["embedding"], new["embedding"]))

# %% [markdown]
# ## Sharded checkpoints with DCP, on two processes
# FSDP2 shards every weight over the ranks; `dcp.save` writes one file per rank and a metadata
# file describing the global tensors. The run also saves asynchronously while it keeps training,
# reloads both checkpoints and puts every size beside its formula.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch12"
result = run_torchrun(REPO_ROOT / "chapters/ch12_checkpointing/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %%
for p in sorted((out_dir / "dcp").iterdir()):
    print(f"{p.name:16s} {p.stat().st_size:>9,} B")
meta = dcp.FileSystemReader(str(out_dir / "dcp")).read_metadata()
for key in list(meta.state_dict_metadata)[:4]:
    print(key, "global shape", tuple(meta.state_dict_metadata[key].size))

# %% [markdown]
# The two-rank checkpoint loads into one process with no process group at all (for evaluation
# or export), and equals the state the run gathered before saving:

# %%
loaded = train.load_into_one_process(out_dir / "dcp")
saved = load_checkpoint(out_dir / "full_state.pt")
print("max |loaded − saved| =", train.max_state_diff(loaded, saved))

# %% [markdown]
# ## Exercises
# 1. Run `torchrun --nproc_per_node=4 chapters/ch12_checkpointing/train.py --load-from
#    runs/ch12_checkpointing/train/dcp` after a 2-process run. Which bytes does each rank read?
# 2. Remove `snapshot` from `train.full_state`. Which check fails, and why only Adam's `step`?
# 3. Keep only the last two complete checkpoints in `resume.run_with_checkpoints`. Where must the
#    deletion happen so that a crash never leaves you with none?
