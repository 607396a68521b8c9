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
# # Chapter 13 · Fault tolerance and elasticity · 容错与弹性训练
#
# At scale something always breaks: a node dies, a link flaps, a rank hangs. The recipe is
# periodic atomic checkpoints of *everything* the next step depends on (parameters, optimizer
# state, LR schedule, every rank's RNG state, data position), a launcher that restarts the group
# (`torchrun --max-restarts`), and finite timeouts so that a hang becomes an error. This notebook
# computes how often to save, looks at the two-phase checkpoint, shows in one process why a resume
# must restore every part and how a checkpoint serves a larger world, damages a checkpoint to
# see the resume skip it, then kills a rank in a real two-process run.
# The lesson is [chapters/ch13_fault_tolerance/README.md](../chapters/ch13_fault_tolerance/README.md).

# %%
import dataclasses
import inspect
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch

from chapters.ch13_fault_tolerance import checkpoints, train
from common.checkpoint import CheckpointError, load_checkpoint
from common.distributed import setup_distributed, teardown_distributed
from common.launch import run_torchrun
from common.log import setup_logging
from common.results import REPO_ROOT

# %% [markdown]
# ## How often to save
# A job of $N$ nodes of MTBF $M_1$ fails every $M = M_1/N$: 1 000 nodes of 1 000 days fail once a
# day. Young/Daly's interval $\sqrt{2\,\delta\,M}$ ($\delta$: the seconds one save stalls
# training) balances the time spent saving against the work lost at a failure.

# %%
M = 1000 * 86400 / 1000  # seconds
for delta in (0.008, 3, 30, 300):
    tau = checkpoints.young_daly_interval(delta, M)
    print(f"save {delta:>6} s -> checkpoint every {tau / 60:7.1f} min, "
          f"overhead {100 * (delta / tau + tau / (2 * M)):.2f} %")

# %% [markdown]
# ## The fault injector and the two-phase checkpoint
# A rank dies at the chosen step, only on the first attempt (`TORCHELASTIC_RESTART_COUNT == 0`),
# so the restarted group can finish; with `--fail-in save` it dies halfway through writing a
# checkpoint file. Rank 0 writes the state every replica shares once, every rank its own RNG
# stream, each file atomically; once every rank's file is written, rank 0 commits the step: the
# folder's manifest (every file's size and SHA-256), then `latest`. A crash during a save leaves
# a folder without a manifest, which no resume reads: the previous checkpoint stays in charge.

# %%
print(inspect.getsource(train.fault_due))
print(inspect.getsource(checkpoints.save_state))
print(inspect.getsource(checkpoints.read_step))

# %% [markdown]
# ## What a resume must restore
# In a world of one process: train 12 steps undisturbed, then "crash" at step 7 (the checkpoint
# of step 5 survives) and resume, restoring everything or leaving one part out. Only the full
# restore lands on the undisturbed parameters; momentum, the noise stream and the data order each
# change the trajectory.

# %%
info = setup_distributed("cpu", "gloo", 30)
cfg = train.Config(steps=12)
work = Path(tempfile.mkdtemp(prefix="ch13-"))
clean = train.train(cfg, info, work / "clean")["model"].state_dict()
variants = {"full": train.STATE_PARTS, "no optimizer": ("model", "rng", "data"),
            "no rng": ("model", "optimizer", "data"), "no data position": ("model", "optimizer", "rng")}
diffs = {}
for name, restore in variants.items():
    folder = work / name.replace(" ", "_")
    train.train(cfg, info, folder, stop_at=7)
    resumed = train.train(dataclasses.replace(cfg, restore=restore), info, folder)
    params = resumed["model"].state_dict()
    diffs[name] = max((params[k] - clean[k]).abs().max().item() for k in clean)
    print(f"{name:18s} resumed from step {resumed['start']}   "
          f"max |param - undisturbed| = {diffs[name]:.3e}")

# %% [markdown]
# ## A checkpoint that a larger world can resume
# The "full" run above was a world of one: its last committed checkpoint holds the shared state
# once and rank 0's stream. Rank 1 of a world of 2 finds the state and no stream of its own:
# `load_state` says so (`rng` is None) and `train` re-derives the stream from (seed, step, rank).
# Reading a per-rank file for it, as this chapter's first layout did, fails.

# %%
folder = work / "full"
state = checkpoints.load_state(folder, rank=1, world_size=2)
print("step", state["step"], "| saved by a world of", state["world_size"], "| rng for rank 1:", state["rng"])
try:
    load_checkpoint(folder / f"step{state['step']:06d}" / "rng1.pt")
except CheckpointError as e:
    print("per-rank read:", e)

# %% [markdown]
# ## A checkpoint that lies
# `torch.save` writes a zip archive whose members carry CRC-32s, and `torch.load` never checks
# them. Flip 16 bytes of a weight in the newest checkpoint of the "full" run: `torch.load` reads
# it without a word; the resume (`load_state`) finds that `state.pt` no longer matches its
# manifest, says so in one line, resumes from the previous step and keeps the damaged folder
# aside. A run with another `--out` is another run (its own run id) and is refused: a real run
# keeps its id in `--out` (`train(..., rec)` reads `rec.out`); `train()` called without a
# recorder, as in the cells above, keeps it in the checkpoint folder. The cell gives it a
# stand-in recorder whose `out` is another folder.

# %%
setup_logging()  # the course's log lines, as a run prints them
newest = folder / f"step{state['step']:06d}"
print(json.dumps(json.loads((newest / "manifest.json").read_text()), indent=1)[:330], "...")
data = bytearray((newest / "state.pt").read_bytes())
at = data.find(load_checkpoint(newest / "state.pt")["model"]["0.weight"].numpy().tobytes())
data[at + 32:at + 48] = bytes(b ^ 0xFF for b in data[at + 32:at + 48])
(newest / "state.pt").write_bytes(bytes(data))
print("torch.load of the damaged file: step", torch.load(newest / "state.pt", weights_only=True)["step"])
resumed = checkpoints.load_state(folder, rank=0, world_size=1)
print("resumed from", Path(resumed["folder"]).name, "| folders:",
      sorted(p.name for p in folder.iterdir() if p.is_dir()))
try:  # the same checkpoint folder, run with another --out
    train.train(cfg, info, folder, rec=SimpleNamespace(out=work / "another_out"))
except CheckpointError as e:
    print("refused:", e)
teardown_distributed()

# %%
fig, ax = plt.subplots(figsize=(6, 2.8))
ax.bar(list(diffs), [max(d, 1e-17) for d in diffs.values()], color=["tab:green"] + ["tab:red"] * 3)
ax.set_yscale("log")
ax.set_ylabel("max |param − undisturbed|")
ax.set_title("resume after a crash at step 7 (0 is drawn as 1e-17)")
plt.show()

# %% [markdown]
# ## The real thing: kill rank 1 at step 7 under torchrun
# `PET_MAX_RESTARTS=2` is `torchrun --max-restarts=2` (torchrun reads every option from a `PET_`
# variable too). Rank 1 exits, rank 0's all-reduce fails ("Connection closed by peer"), the agent
# stops the group and starts it again; the new attempt resumes from step 5. A job of fixed size
# needs no `TORCH_DISABLE_SHARE_RDZV_TCP_STORE` (the lesson explains when it does).

# %%
out = work / "run"  # a fresh folder: a folder with finished checkpoints would resume at the end
result = run_torchrun(REPO_ROOT / "chapters/ch13_fault_tolerance/train.py", nproc=2,
                      args=["--fail-rank", "1", "--fail-step", "7"], out_dir=out,
                      env={"PET_MAX_RESTARTS": "2"})
print("\n".join(line for line in result.output.splitlines()
                if not line.startswith("[rank0]:") and "Traceback" not in line)[-2500:])

# %%
figures = result.summary["figures"]
print("restarts:", figures["restarts (TORCHELASTIC_RESTART_COUNT)"]["measured"],
      "  resumed from step:", figures["resumed from step"]["measured"])
for check in result.summary["checks"]:
    print(f"{check['name']:48s} {check['measured']}  {'ok' if check['ok'] else 'FAIL'}")

# %% [markdown]
# ## Exercises
# 1. Make rank 0 die halfway through the save of step 15 (`--fail-rank 0 --fail-step 15
#    --fail-in save`). From which step does the run resume, and what is in `ckpt/step000015/`?
# 2. With a save of 16 ms and of 30 s and $M$ = 24 h, what interval and overhead does Young/Daly give?
# 3. Keep the global batch at 16 when the elastic demo shrinks to one node.
# 4. Catch a desync (different shapes on two ranks) with `TORCH_DISTRIBUTED_DEBUG=DETAIL`.
# 5. Why does node A print `attempt 0` at world 2 in the elastic demo?
#
# Hints and answers are in the lesson.
