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
# # Chapter 23 · Containers and orchestration · 容器化与编排
#
# The same script runs under torchrun, a Kubeflow PyTorchJob, a Volcano Job, a plain indexed Job
# and Slurm, because each launcher leaves a few environment variables in the pod and one function,
# `common.distributed.read_launch_env`, turns them into a rank, a world size and a rendezvous
# address. This notebook reads the chapter's Dockerfile and manifests, validates them offline,
# shows what each launcher gives a pod, and then starts the PyTorchJob's container command as two
# plain processes with the operator's variables. No Docker engine and no cluster run here.
# The lesson is [chapters/ch23_containers/README.md](../chapters/ch23_containers/README.md).

# %%
import copy
import tempfile
from pathlib import Path

from chapters.ch23_containers import orchestration as o
from chapters.ch23_containers import plots
from common.distributed import read_launch_env
from common.results import REPO_ROOT

# %% [markdown]
# ## The Dockerfile, read and linted
# `dockerfile-parse` reads what the file does; the lesson's promises (a CUDA + PyTorch base whose
# torch and CUDA are the pinned wheel's, `PYTORCH_VERSION` equal to the pin, the pinned
# requirements installed, a non-root user, one rank per GPU) are checked on that, and hadolint
# lints it. The image itself is not built here.

# %%
facts = o.dockerfile_facts()
print("base image :", facts["base"])
print("copied     :", facts["copied"])
print("user       :", facts["user"], "   command:", " ".join(facts["cmd"]))
print("base       :", o.base_image_versions(facts["base"]), "  pinned torch:", o.pinned_version("torch"),
      "  PYTORCH_VERSION:", facts["env"]["PYTORCH_VERSION"])
print(f"driver     : CUDA {o.PINNED_TORCH_CUDA} needs branch >= {o.min_driver(o.PINNED_TORCH_CUDA)}")
print("problems   :", o.dockerfile_problems(facts))
print("hadolint   :", o.hadolint())

# %% [markdown]
# ## The manifests, validated offline
# Core objects go to Kubernetes' own schemas (kubernetes-validate, strict: an unknown field is an
# error); a custom resource's pod templates go there too, as PodTemplates, the rest to the
# operator's CRD schema (cut into `schemas/`), then through the operator's admission webhook
# (transcribed) and the course's lints. Each broken copy must be rejected. Below, the pitfalls
# with what the checks say: a container not named `pytorch` (the webhook); a port under another
# name, a PyTorchJob backoff limit that the first fault reaches (the operator sums every pod's
# container restarts, and one crashed rank restarts all 4 pods), Volcano pods restarted in place
# (the lints: the operators accept all three).

# %%
manifests = o.load_manifests()
for fname, obj in manifests:
    broken = o.broken_variants(obj)
    rejected = sum(bool(o.validate_object(b)) for _, b in broken)
    print(f"{fname:24} {obj['kind']:14} errors {len(o.validate_object(obj))}   "
          f"broken copies rejected {rejected}/{len(broken)}")
by_name = {obj["metadata"]["name"]: obj for _, obj in manifests}
for name, what in (("ch23-ddp", "PyTorchJob container not named pytorch"),
                   ("ch23-ddp", "PyTorchJob port not named pytorchjob-port"),
                   ("ch23-ddp", "PyTorchJob backoffLimit = its pod count"),
                   ("ch23-gang", "Volcano pods restarted in place (OnFailure)")):
    print(f"\n{name}, {what}:")
    for error in o.validate_object(dict(o.broken_variants(by_name[name]))[what]):
        print("   ", error)

# %% [markdown]
# ## What each launcher gives a pod
# The operators' own code, transcribed in `launchers.py`: here is worker 1 of the PyTorchJob,
# of the Volcano Job, pod 1 of the indexed Job and task 5 of a 2-node Slurm step, and what
# `read_launch_env` makes of each.

# %%
examples = {"PyTorchJob": o.pytorchjob_pods(by_name["ch23-ddp"])[2],
            "Volcano": o.volcano_pods(by_name["ch23-gang"])[2],
            "indexed Job": o.indexed_job_pods(by_name["ch23-indexed"])[1],
            "Slurm": o.slurm_pods(2, 4)[5]}
for name, (host, env) in examples.items():
    r = read_launch_env(env)
    print(f"{name} — {host}")
    print("   env :", {k: v for k, v in sorted(env.items()) if not k.startswith("VC_WORKER_H")})
    print(f"   read: rank {r['rank']} of {r['world_size']}, local {r['local_rank']} of "
          f"{r['local_world_size']}, rendezvous {r['master_addr']}:{r['master_port']}")

# %% [markdown]
# The elastic PyTorchJob sets no RANK at all: it hands torchrun its options as `PET_*`
# variables, which torchrun's parser takes as defaults.

# %%
print(o.pytorchjob_pods(by_name["ch23-elastic"])[0][1])

# %% [markdown]
# ## Every launcher, every pod, and a wrong mapping
# The figure (drawn by `plots.py` from the same functions): the rank each pod reads, and what a
# plausible mistake reads instead. `check_world` finds no problem in the first and at least one
# in the second.

# %%
with tempfile.TemporaryDirectory() as tmp:  # the committed figure stays as it is
    plots.make_figures(Path(tmp))
for name, d in plots.launcher_ranks().items():
    print(f"{name:32} ranks {d['ranks']}  problems {d['problems']}   "
          f"{d['wrong_label']}: {d['wrong']} -> problems {d['wrong_problems']}")

# %% [markdown]
# ![ranks](../chapters/ch23_containers/figures/launcher_ranks.png)
#
# ## The PyTorchJob's pods, run here
# One Master and one Worker: the container command `python chapters/ch23_containers/train.py
# --steps 20`, in two processes, each with the variables the operator would give its pod (the
# cluster's DNS name of the master becomes 127.0.0.1). About 10 s on two CPU cores (8–9 s in
# the tests here).

# %%
job = copy.deepcopy(by_name["ch23-ddp"])
job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1
pods = o.pytorchjob_pods(job)
argv = o.course_commands([("pytorchjob.yaml", job)])[0][1]
with tempfile.TemporaryDirectory() as tmp:  # nothing left behind
    codes, output, summary = o.run_pods(pods, argv, Path(tmp), timeout=180)
print("exit codes:", codes)
print("\n".join(line for line in output.splitlines() if line.strip())[-2500:])

# %%
for c in summary["checks"]:
    print(f"{c['name']:42} measured {c['measured']!s:>10}  ok {c['ok']}")
print("\nthe lesson:", REPO_ROOT / "chapters/ch23_containers/README.md")
