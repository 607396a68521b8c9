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
# # Chapter 24 · Training in the cloud · 云上分布式训练实践
#
# A spot machine is taken back with a SIGTERM and, once the grace period is over, a SIGKILL. This
# notebook shows the handler and the agreement between ranks, polls AWS's spot notice from a
# stand-in metadata endpoint, sends a real SIGTERM to a run (one process here; the tests do it to
# a two-rank torchrun), resumes it, shows why the checkpoint's commit is a manifest written last
# and what a load verifies before it trusts a checkpoint, and validates the SageMaker, Vertex AI
# and PAI-DLC launch requests offline. The lesson is
# [chapters/ch24_cloud/README.md](../chapters/ch24_cloud/README.md).

# %%
import inspect
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from IPython.display import Image, display

from chapters.ch24_cloud import launchers, train
from chapters.ch24_cloud.fake_imds import FakeIMDS
from chapters.ch24_cloud.object_store import (
    MANIFEST,
    ObjectStoreCheckpoints,
    run_identity,
    step_folder,
)
from chapters.ch24_cloud.preemption import Preemption, stop_agreed
from chapters.ch24_cloud.spot_notice import SpotNoticePoller
from common.checkpoint import CheckpointError
from common.launch import last_logged_step, started, wait_until
from common.results import REPO_ROOT

# %% [markdown]
# ## The notice is a flag; the stop is a collective
# The handler only notes the time. Between steps every rank all-reduces the flag (MAX), so all
# stop at the same step even if only one node was told, and they save together.

# %%
print(inspect.getsource(Preemption))
print(inspect.getsource(stop_agreed))

# %% [markdown]
# ## AWS's notice comes before its SIGTERM: poll it (IMDSv2)
# On AWS the two minutes' notice is an item in the instance metadata, and SIGTERM comes only with
# the shutdown at their end. The poller asks for a session token by PUT, then GETs
# `spot/instance-action` with it: 404 means nothing is scheduled. Here the endpoint is a local
# stand-in (`fake_imds.FakeIMDS`, written from AWS's documentation) that answers 404 to the first
# three polls, then the notice; the poller's thread sets the same flag as the SIGTERM handler. A
# second poller without the token (IMDSv1's plain GET) gets 401 and never sees the notice.

# %%
print(inspect.getsource(SpotNoticePoller.poll_once))
with FakeIMDS(notice_after=3) as imds:
    notice, blind_notice = Preemption(grace_s=30), Preemption(grace_s=30)
    poller = SpotNoticePoller(imds.url, notice, interval_s=0.05).start()
    blind = SpotNoticePoller(imds.url, blind_notice, interval_s=0.05, imdsv2=False).start()
    give_up = time.monotonic() + 10
    while notice.signal_time is None and time.monotonic() < give_up:
        time.sleep(0.05)
    poller.stop()
    blind.stop()
for with_token in (True, False):
    print("GETs with a token:" if with_token else "GETs without one:",
          [r["status"] for r in imds.requests if r["method"] == "GET" and bool(r["token"]) == with_token])
print("notice:", notice.source, f"(seconds allowed: {notice.allowed_s():.0f})")
print("the tokenless poller's flag:", blind_notice.signal_time)

# %% [markdown]
# ## A real SIGTERM, then a restart
# One process (`python`, a world of one) trains with a short sleep per step; we send SIGTERM after
# step 6 as a cloud would, then start the same command again (the same `--out`, which holds the
# run id its checkpoints carry): it resumes from the step it saved.

# %%
work = Path(tempfile.mkdtemp(prefix="ch24-"))
bucket = f"file://{work}/bucket"
cmd = [sys.executable, str(REPO_ROOT / "chapters/ch24_cloud/train.py"), "--device", "cpu",
       "--steps", "20", "--step-seconds", "0.05", "--log-every", "1", "--ckpt-url", bucket]
with started([*cmd, "--out", str(work / "run")]) as first:  # killed on leaving, whatever happens
    wait_until(lambda: last_logged_step(work / "run" / "metrics.jsonl") >= 6, first, "step 6")
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=60)
print("exit code:", first.returncode)
print(out[out.index("figure"):])

# %%
second = subprocess.run([*cmd, "--out", str(work / "run")], cwd=REPO_ROOT, text=True,
                        capture_output=True, timeout=60)
print("exit code:", second.returncode)
summary = json.loads((work / "run" / "summary.json").read_text())
print("resumed from step", summary["figures"]["resumed from step"]["measured"])

# %% [markdown]
# What the bucket holds: a folder per step, each committed by its `manifest.json`: every object's
# size and SHA-256, and whose checkpoint it is (the run id kept in `--out`, the model's shapes).

# %%
store = ObjectStoreCheckpoints(bucket)
print("committed steps:", store.committed_steps())
manifest = store.read_manifest(store.committed_steps()[0])
print(json.dumps({k: v for k, v in manifest.items() if k != "shapes"}, indent=1))

# %% [markdown]
# ## What a load verifies before it trusts a checkpoint
# Flip 16 bytes in the middle of the newest step's `state.pt`, as a bad disk or a bad copy would:
# `torch.load` alone would load them without a word. `load_latest` reads every object once,
# checks its size, SHA-256 and zip CRC-32s, loads it with `weights_only=True`, skips the step in
# one line, takes the one before and keeps the bad one aside (`skipped-step...`). The run id in
# another `--out` is another run's: refused.

# %%
newest = store.committed_steps()[-1]
damaged = work / "bucket" / step_folder(newest) / "state.pt"
data = bytearray(damaged.read_bytes())
for i in range(len(data) // 2, len(data) // 2 + 16):
    data[i] ^= 0xFF
damaged.write_bytes(bytes(data))
model = train.new_model(train.Config(), "cpu")
mine = run_identity(work / "run", model, list(model.parameters()))
print("newest", newest, "-> resume from", store.load_latest(0, 1, mine)["step"])
print("kept aside:", sorted(p.name for p in (work / "bucket").glob("skipped-*")))
try:
    store.load_latest(0, 1, run_identity(work / "other", model, list(model.parameters())))
except CheckpointError as e:
    print("another --out:", e)
shutil.rmtree(work)  # the runs' folders and the bucket: nothing left behind

# %% [markdown]
# ## No rename on an object store: the manifest is the commit
# `memory://` behaves like S3 or GCS here: an object appears whole or not at all, and there is no
# rename. A save that dies before its manifest leaves the previous step in charge; a manifest
# written *first* (the negative control) commits objects that never arrived: the load says so and
# falls back to the step before.

# %%
mem = ObjectStoreCheckpoints("memory://ch24-notebook")
identity = {"run_id": "notebook", "shapes": {}}
shared = {"step": 5, "cursor": 40, "model": {"w": torch.zeros(3)}, "optimizer": []}
mem.save(5, shared, {}, rank=0, meta=identity)
try:
    mem.save(10, {**shared, "step": 10}, {}, rank=0, meta=identity,
             pause=lambda: sys.exit("killed mid-save"))
except SystemExit as e:
    print(e)
print("committed:", mem.committed_steps(), "-> resume from", mem.load_latest(0, 1, identity)["step"])
mem.put(f"step000015/{MANIFEST}", json.dumps({"step": 15, "world_size": 1, **identity, "files": {
    name: {"bytes": 1, "sha256": "0"} for name in ("rng0.pt", "state.pt")}}).encode())
print("committed:", mem.committed_steps(), "-> resume from", mem.load_latest(0, 1, identity)["step"])

# %% [markdown]
# ## Three clouds' launch requests, checked offline
# SageMaker's against botocore's service model; Vertex AI's and PAI-DLC's against JSON Schemas
# hand-written from their API references. Each command must name a real script with options it
# accepts at the world size the request starts.

# %%
for cloud in launchers.TEMPLATES:
    cfg, world = launchers.check_template(cloud)
    print(f"{cloud:9s} world {world}: --ckpt-url {cfg.ckpt_url}  --grace-s {cfg.grace_s:.0f}")
bad = launchers.load_template("pai")
bad["JobSpecs"][0]["PodCount"] = "2"
try:
    launchers.check_template("pai", bad)
except launchers.TemplateError as e:
    print("refused:", e)

# %% [markdown]
# ## The recorded figures
# Drawn from `chapters/ch24_cloud/figures/data.json` (`python tools/figures.py --rerun ch24`
# measures again).

# %%
for name in ("preempt_resume.png", "grace_budget.png"):
    display(Image(filename=str(REPO_ROOT / "chapters/ch24_cloud/figures" / name)))
