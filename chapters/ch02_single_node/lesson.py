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
# # Chapter 02 · Single node, many devices · 单机多卡训练基础
#
# One training task, three scripts: `single.py` (one process, the whole global batch),
# `spawn.py` (DDP, processes started by `torch.multiprocessing.spawn`) and `train.py` (DDP,
# processes started by `torchrun`). With the same seed and global batch they must end with the
# same parameters — to 1e-12 in float64. This notebook shows the code, the CUDA background,
# `nn.DataParallel`'s mechanism counted step by step (`dataparallel.py`), runs the three scripts
# as subprocesses (DDP cannot run inside a notebook kernel: spawned workers cannot be pickled
# from `__main__`) and compares what they saved.

# %%
# %matplotlib inline
import difflib
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import matplotlib.pyplot as plt
import torch
from torch import nn

from chapters.ch02_single_node import counting, dataparallel, spawn, task, train
from chapters.ch02_single_node.make_diff import code_lines
from chapters.ch02_single_node.task import PARITY_TOLERANCE, build_model
from common.checkpoint import load_checkpoint
from common.launch import run_python, run_torchrun
from common.results import REPO_ROOT
from common.timing import Timer

CH = REPO_ROOT / "chapters" / "ch02_single_node"
OUT = REPO_ROOT / "runs" / "notebooks" / "ch02"

# %% [markdown]
# ## 1. The CUDA execution model in one cell
#
# A CUDA kernel launch only *queues* work on a stream and returns at once; the GPU runs the
# queue in order while Python carries on. A timer read right after `a @ a` measures the launch,
# not the matmul. `torch.cuda.synchronize()` waits for the queue to drain — every honest GPU
# timer (`common.timing.Timer`, `benchmark`) calls it before reading the clock. On a CPU there
# is no queue: the call returns when the work is done.

# %%
if torch.cuda.is_available():
    a = torch.randn(8192, 8192, device="cuda")
    a @ a  # warm-up (cuBLAS initialisation)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    b = a @ a
    returned = time.perf_counter() - t0
    torch.cuda.synchronize()
    finished = time.perf_counter() - t0
    print(f"a @ a returned after {returned * 1e3:.3f} ms; the GPU finished after {finished * 1e3:.3f} ms")
    with Timer("cuda") as timer:  # synchronises on entry and exit
        b = a @ a
    print(f"common.timing.Timer: {timer.elapsed * 1e3:.3f} ms")
else:
    print("No CUDA GPU here: CPU operations are synchronous, so there is no launch/finish gap to "
          "show. On a GPU this cell shows a timer that reads ~0.01 ms for an 8192² matmul that takes ms.")

# %% [markdown]
# ## 2. `nn.DataParallel`: one process drives every device, counted
#
# `nn.DataParallel(model)` runs in ONE Python process. Every forward it scatters the input batch
# over the devices, *replicates the module* onto each of them, runs the replicas in Python
# threads (which share the GIL), then gathers the outputs onto device 0, where the loss is
# computed; after the whole backward one autograd node sums every replica's gradients into
# device 0's parameters. DDP instead runs one process per device, copies the parameters once
# (at construction), and all-reduces gradients while the backward runs.
#
# Without two GPUs torch's `DataParallel` does not replicate (no accelerator: no devices, it
# calls the module; one GPU: it calls the module on cuda:0), so `dataparallel.py` runs torch's
# own `DataParallel.forward`, `scatter` and `gather` over *simulated* CPU devices
# (`SimulatedDataParallel`, in `simulated_devices.py`, replaces only the autograd Functions
# that move tensors between devices, and `parallel_apply`, which needs an accelerator) and a
# `MechanismTap` (`counting.py`) counts, at those four calls and at both ends of the backward, what each step
# copied and summed (bytes created, not bytes through one link). Below: 3 steps each, the
# last step's counts beside their closed forms (P = 1,633 parameters of 8 bytes, B rows of 16
# features in and 1 out, R devices that got rows; `torch.chunk` gives 5 rows over 4 devices as
# 2, 2, 1, so the fourth device gets nothing).

# %%
cfg = dataparallel.Config(steps=3, device="cpu")
ids = nn.DataParallel(build_model(cfg, torch.device("cpu"))).device_ids
if not ids:  # torch/nn/parallel/data_parallel.py: no accelerator, no devices
    print("torch's own nn.DataParallel here: device_ids = [] (no accelerator: it calls the module)")
elif len(ids) == 1:
    print(f"torch's own nn.DataParallel here: device_ids = {ids} (one GPU: it moves the module to "
          "cuda:0 and calls it, no replicas)")
else:
    print(f"torch's own nn.DataParallel here: device_ids = {ids} (it runs below, counted)")
for devices, batch in ((2, 48), (4, 48), (4, 5)):
    run_cfg = replace(cfg, devices=devices, global_batch_size=batch)
    trained, tap, losses, _ = dataparallel.train_data_parallel(run_cfg, "cpu", devices)
    last = tap.records[-1]
    print(f"\n{devices} devices, batch {batch}: {' -> '.join(last.calls)}; rows per device "
          f"{last.chunk_rows}; replica threads {sorted({name for _, name, _ in last.forwards})}")
    expected = counting.expected_per_step(run_cfg, devices, 8)
    for key, value in counting.measured_per_step(last).items():
        print(f"  {key:<20} measured {value:>6}   closed form {expected[key]:>6}")
    difference = task.max_param_diff(trained.state_dict(), task.reference_state(run_cfg, torch.device("cpu")))
    print(f"  parameters after 3 steps vs one process on the batch: {difference:.1e}")
if torch.cuda.device_count() >= 2:  # torch's own DataParallel, counted by the same tap
    n = torch.cuda.device_count()
    run_cfg = replace(cfg, devices=n, device="cuda")
    trained, tap, losses, _ = dataparallel.train_data_parallel(run_cfg, "cuda", n)
    print(f"\n{n} GPUs: replicas on {tap.records[-1].replica_devices}, "
          f"{counting.measured_per_step(tap.records[-1])}")
else:
    print(f"\n{torch.cuda.device_count()} CUDA GPU(s): torch's own multi-GPU DataParallel needs 2 or more.")

# %% [markdown]
# ## 3. The shared task, and the one function about data distribution
#
# All three scripts import `task.py`. The global batch of step `s` is the next
# `global_batch_size` rows of the data set; each rank takes a contiguous shard of it.

# %%
print(inspect.getsource(task.global_batch_indices))
print(inspect.getsource(task.shard_for_rank))
print(inspect.getsource(task.train_step))

# %%
batch = task.global_batch_indices(step=0, global_batch_size=8, n_samples=480)
for world_size in (1, 2, 4):
    print(world_size, "ranks:", [task.shard_for_rank(batch, r, world_size).tolist() for r in range(world_size)])

# %% [markdown]
# ## 4. `train.py` is `single.py` plus the distributed lines
#
# The diff below is computed now from the two files, docstrings left out (the README's copy is
# generated the same way, by `make_diff.py`). The added lines: the process-group setup and teardown, DDP around
# the model, the shard, the loss averaged over ranks for logging, saving on rank 0 only, and two
# checks that only make sense with several ranks.

# %%
single_lines = code_lines(CH / "single.py")  # each file's lines after its module docstring
train_lines = code_lines(CH / "train.py")
diff = list(difflib.unified_diff(single_lines, train_lines, "single.py", "train.py", n=1))
print(f"{sum(line.startswith('+') for line in diff) - 1} lines added, "
      f"{sum(line.startswith('-') for line in diff) - 1} removed\n")
print("".join(diff))

# %% [markdown]
# The setup, written inline as the lesson (from chapter 03 on it is one import of
# `common.distributed.setup_distributed`). The device is chosen (by the rule chapter 01 teaches,
# `common.distributed.choose_device_and_backend`) and set *before* `init_process_group`; the
# group gets a finite timeout; `main` destroys it in `finally`.

# %%
print(inspect.getsource(train.setup_distributed))
print(inspect.getsource(train.main))

# %% [markdown]
# `spawn.py` reuses `train.py`'s recipe and changes only the launcher: it picks a free port,
# exports `MASTER_ADDR`/`MASTER_PORT`, and `mp.spawn` calls `run_rank(rank, cfg)` in each new
# process — the rank is an argument, not an environment variable.

# %%
print(inspect.getsource(spawn.set_rendezvous_address))
print(inspect.getsource(spawn.run_rank))
print(inspect.getsource(spawn.main))

# %% [markdown]
# ## 5. Run the three
#
# Same options for all three: 12 steps from seed 3, not the defaults (20 steps, seed 0), so that
# the runs show an option reaching every rank (the chapter's tests run exactly these); global batch
# 48, float64. `single.py` and `spawn.py` start with plain `python`; `train.py` under
# `torchrun --nproc_per_node=2`.
# They run at the same time (to save time), so their step times are not comparable here —
# the README has timings of runs one after another.

# %%
args = ["--steps", 12, "--seed", 3, "--log-every", 1, "--device", "cpu"]
with ThreadPoolExecutor(max_workers=3) as pool:  # three independent jobs, started together
    futures = {
        "single": pool.submit(run_python, CH / "single.py", args=args, out_dir=OUT / "single"),
        "spawn": pool.submit(run_python, CH / "spawn.py", args=[*args, "--nprocs", 2],
                             out_dir=OUT / "spawn"),
        "train": pool.submit(run_torchrun, CH / "train.py", nproc=2, args=args,
                             out_dir=OUT / "train"),
    }
results = {name: future.result() for name, future in futures.items()}
print("\n".join(results["train"].output.splitlines()[-12:]))

# %% [markdown]
# ## 6. Same parameters?
#
# Each script saved its final `state_dict` (rank 0 only, for the DDP ones). Tolerance 1e-12:
# DDP computes the same sums in another order (per shard, then across ranks), so float64
# rounding differences of ~1e-16 per operation may appear — and nothing larger.

# %%
params = {name: load_checkpoint(r.out_dir / "final_params.pt") for name, r in results.items()}
tol = PARITY_TOLERANCE["float64"]
for a_name, b_name in [("single", "spawn"), ("single", "train"), ("spawn", "train")]:
    d = task.max_param_diff(params[a_name], params[b_name])
    print(f"max |{a_name} − {b_name}| = {d:.3e}   {'ok' if d <= tol else 'FAIL'} (tolerance {tol:g})")
for name, r in results.items():
    print(f"{name}.py checks:", {c["name"]: c["ok"] for c in r.summary["checks"]})

# %% [markdown]
# ## 7. Loss curves
#
# The DDP scripts log the global-batch loss (the mean of the ranks' shard losses, one
# all-reduce), so the three curves lie on top of each other.

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
for (name, r), style in zip(results.items(), ["-", "--", ":"]):
    lines = [json.loads(line) for line in (r.out_dir / "metrics.jsonl").read_text().splitlines()]
    ax.plot([m["step"] for m in lines], [m["loss"] for m in lines], style, lw=2,
            label=f"{name}.py (world {r.summary['world_size']})")
ax.set_xlabel("step")
ax.set_ylabel("MSE loss on the global batch")
ax.legend()
plt.show()

# %% [markdown]
# ## What to try next
#
# - `--global-batch-size 50` with 4 processes: the scripts refuse in one sentence. Why must the
#   shards be equal for DDP's *average* of gradients to equal the global-batch gradient?
# - `--dtype float32`: the difference grows to 6e-8 (2.7e-7 after 200 steps) — still far within
#   the float32 tolerance 1e-5.
# - The broken variants (every rank on shard 0, loss summed, no DDP, overlapping shards) are in
#   `controls.py`; the lesson's figure shows how far they drift from one process.
