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
# without the RNG state or the data position), looks at an atomic save and a verified load (a
# damaged checkpoint is skipped, another run's refused), builds a delta checkpoint, runs the
# sharded (DCP) save and load on two processes with a checksum manifest, shows that a crafted
# `.metadata` runs no code here, and resumes a two-process run whose per-rank state DCP would
# cross-wire under one key.
# The lesson is [chapters/ch12_checkpointing/README.md](../chapters/ch12_checkpointing/README.md).

# %%
import inspect
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from chapters.ch12_checkpointing import (
    checkpoint_files,
    checks,
    plots,
    resumable,
    resume,
    resume_dcp,
    train,
)
from chapters.ch12_checkpointing import delta as deltas
from common.checkpoint import (
    CheckpointError,
    atomic_write,
    load_checkpoint,
    read_dcp_metadata,
    read_manifest,
    training_shapes,
    verify_dcp,
)
from common.data import regression_data
from common.launch import run_torchrun
from common.log import setup_logging
from common.results import REPO_ROOT

setup_logging()  # the course's log lines (a skipped checkpoint says so) appear below the cells

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
X, Y = regression_data(cfg.n_samples, 16, 1, seed=cfg.seed)
run = resume.new_run(cfg)
for step in (4, 8):
    resume.train(cfg, run, X, Y, step)
    checkpoint_files.save_training_state(ckpt_dir, resume.training_state(run, "lesson-run"))
(ckpt_dir / ".step_000012.pt.x1y2.tmp").write_bytes(b"the first 4096 bytes of a killed save")
print("incomplete saves removed:", [p.name for p in checkpoint_files.remove_incomplete(ckpt_dir)])
shapes = training_shapes(run["model"], run["opt"])
path, state = checkpoint_files.newest_checkpoint(ckpt_dir, "lesson-run", shapes)
print("resume from:", path.name, "| step in it:", state["step"])

# %% [markdown]
# ## Verified loads
# `torch.save` writes a zip archive whose members carry CRC-32s, and `torch.load` never checks
# them. Flip 16 bytes in the middle of the newest checkpoint (inside a tensor): `torch.load`
# returns it as if nothing happened; the loader checks every CRC first, skips it in one line and
# takes the newest checkpoint that verifies. A checkpoint of another run (another run id) or of
# another model is refused.

# %%
newest = ckpt_dir / "step_000008.pt"
data = bytearray(newest.read_bytes())
middle = len(data) // 2
data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
newest.write_bytes(bytes(data))
print("torch.load takes it: step", torch.load(newest, weights_only=True)["step"])
path, state = checkpoint_files.newest_checkpoint(ckpt_dir, "lesson-run", shapes)
print("the loader resumes from:", path.name)
try:
    checkpoint_files.newest_checkpoint(ckpt_dir, "another-run", shapes)
except CheckpointError as e:
    print("refused:", e)

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
# Differences in the *same* dtype are exact only where the subtraction is: Sterbenz's lemma covers
# new and old within a factor 2 of each other (small fine-tuning steps); re-drawn rows are not.

# %%
print("fp32 (0.001 - 1) + 1 =", ((torch.tensor(0.001) - 1) + 1).item())
print("small steps: ", deltas.difference_roundtrip(base["embedding"], new["embedding"]))
redrawn = deltas.reinitialised_rows(train.Config(), base)["embedding"]
print("re-drawn rows:", deltas.difference_roundtrip(base["embedding"], redrawn))

# %% [markdown]
# ## Sharded checkpoints with DCP, on two processes
# FSDP2 shards every weight over the ranks; `dcp.save` writes one file per rank and a metadata
# file describing the global tensors. The run also saves asynchronously while it keeps training,
# reloads both checkpoints and puts every size beside its formula.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch12" / "train"
result = run_torchrun(REPO_ROOT / "chapters/ch12_checkpointing/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %% [markdown]
# DCP checks no checksum, so every folder gets a manifest, written last: each file's size and
# SHA-256, the run id and the shapes. `verify_dcp` checks it before anything is loaded.

# %%
for p in sorted((out_dir / "dcp").iterdir()):
    print(f"{p.name:16s} {p.stat().st_size:>9,} B")
manifest = read_manifest(out_dir / "dcp")
print({name: entry["sha256"][:12] for name, entry in manifest["files"].items()}, manifest["run_id"])
meta = read_dcp_metadata(out_dir / "dcp")  # the restricted unpickler: reading runs no code
for key in list(meta.state_dict_metadata)[:4]:
    print(key, "global shape", tuple(meta.state_dict_metadata[key].size))
print("verifies:", bool(verify_dcp(out_dir / "dcp")))

# %% [markdown]
# `.metadata` is a pickle, and a pickle is a program: DCP's own reader runs whatever it says. A
# `.metadata` that is nothing but a call (open a file for writing) is refused here, and the file
# it would create never appears (the tests show DCP's reader creating it).

# %%
crafted = Path(tempfile.mkdtemp(prefix="ch12-crafted-"))
marker = crafted / "marker"
(crafted / ".metadata").write_bytes(b"cio\nopen\n(V" + str(marker).encode() + b"\nVw\ntR.")
refused = None
try:
    read_dcp_metadata(crafted)
except CheckpointError as e:
    refused = e
    print("refused:", e)
print("marker exists:", marker.exists())
assert refused is not None, "the crafted .metadata was read"
assert not marker.exists(), "the crafted .metadata ran its call"

# %% [markdown]
# The two-rank checkpoint loads into one process with no process group at all (for evaluation
# or export), verified first, and equals the state the run gathered before saving:

# %%
loaded = train.load_into_one_process(out_dir / "dcp", manifest["run_id"])
saved = load_checkpoint(out_dir / "full_state.pt")
print("max |loaded − saved| =", checks.max_state_diff(loaded, saved))

# %% [markdown]
# ## A multi-rank resume, and per-rank state under one key
# `resume_dcp.py` saves an FSDP2 run at step 5 with one `dcp.save` (sharded model and optimizer,
# scheduler, data position, each rank's RNG under `per_rank.rank<r>`), rebuilds everything from
# other seeds, loads and continues. DCP stores a plain tensor saved under one key on every rank
# once: the controls show both ranks loading one `pos`, and a rank resuming with the other's RNG.

# %%
print(inspect.getsource(resumable.training_state))
rd_dir = REPO_ROOT / "runs" / "notebooks" / "ch12" / "resume_dcp"
rd = run_torchrun(REPO_ROOT / "chapters/ch12_checkpointing/resume_dcp.py", nproc=2, out_dir=rd_dir)
print(rd.output[rd.output.index("figure"):])

# %%
losses = load_checkpoint(rd_dir / "losses.pt")
fig, axes = plt.subplots(1, 2, figsize=(8, 2.8), sharey=True)
for rank, ax in enumerate(axes):
    ax.plot(losses["reference"][rank], lw=4, alpha=0.35, color="k", label="uninterrupted")
    ax.plot(losses["resumed"][rank], ls="--", label="saved at 5, resumed")
    ax.axvline(resume_dcp.Config().stop_at - 0.5, color="grey", ls=":")
    ax.set_title(f"rank {rank}: identical = {losses['resumed'][rank] == losses['reference'][rank]}")
    ax.set_xlabel("step")
axes[0].set_ylabel("loss on this rank's batch")
axes[0].legend(fontsize=7)
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run `torchrun --standalone --nproc_per_node=4 chapters/ch12_checkpointing/train.py --load-from
#    runs/ch12_checkpointing/train/dcp` after a 2-process run. Which files does each rank read?
# 2. Remove `snapshot` from `train.full_state`. Which check fails, and why only Adam's `step`?
# 3. Keep only the last two complete checkpoints in `resume.run_with_checkpoints`. Where must the
#    deletion happen so that a crash never leaves you with none?
# 4. Make a delta chain (base, delta 1, delta 2): what must a restore read?
# 5. With the save stalls above and a job MTBF of 24 h, how often should this job save?
# 6. What does each of 3 ranks load after `dcp.save({"pos": torch.tensor([rank])})`?
# 7. Your checkpoints and their manifests sit in a bucket others can write to: what does checking
#    the manifest after the download protect you from, and what does it not?
#
# Hints and answers are in the lesson.
