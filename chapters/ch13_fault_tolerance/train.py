"""Survive a dead rank: periodic atomic checkpoints, a fault injector and torchrun restarts.

Every `--ckpt-every` steps rank 0 writes what all replicas share (model, optimizer, data position,
step, world size, run id, shapes) and every rank its own RNG stream, each file atomically; once
every rank's file is written, rank 0 commits the step: `manifest.json` (every file's size and
SHA-256), then `latest`. A rank killed at `--fail-step` (first attempt only), in the step or
halfway through a save, makes torchrun restart the whole group, which resumes from the newest
checkpoint that verifies and ends bit-identical to a clean run. A damaged checkpoint (flipped
bytes, a truncated or missing file, a torn manifest) is skipped in one line for the previous one
and kept aside, never deleted; another run's checkpoint is refused in one line. The checkpoint
does not depend on the world size: an elastic job that shrinks or grows resumes from it (per-rank
streams re-derived after a resize). One run at a time: global rank 0 locks `--out` and
`--ckpt-dir` (`common.config.parse_config`).

Run:
    python chapters/ch13_fault_tolerance/train.py                                 # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch13_fault_tolerance/train.py   # no fault
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        chapters/ch13_fault_tolerance/train.py --fail-rank 1 --fail-step 7         # kill rank 1, restart
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        chapters/ch13_fault_tolerance/train.py --fail-rank 1 --fail-step 10 --fail-in save   # dies mid-save
    torchrun --standalone --nproc_per_node=8 --max-restarts=3 chapters/ch13_fault_tolerance/train.py \\
        --fail-rank 3 --fail-step 7 --fail-how sigkill                             # 8 GPUs, NCCL
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc_per_node=8 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=job13 \\
        chapters/ch13_fault_tolerance/train.py --out /shared/run13     # elastic nodes, shared --out
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch13_fault_tolerance/train.py \\
        --out /shared/run13                                 # Slurm (a requeued job resumes)
"""

import hashlib
import io
import math
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.checkpoint import (
    MANIFEST,
    CheckpointError,
    atomic_write,
    check_identity,
    load_checkpoint,
    newest_verified,
    run_id,
    save_checkpoint,
    training_shapes,
    verify_manifest,
    write_manifest,
)
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import capture_rng_state, restore_rng_state, seed_everything
from common.timing import Timer

STATE_PARTS = ("model", "optimizer", "rng", "data")
STEP_FOLDER = re.compile(r"step(\d{6})")  # step000010: a checkpoint; step000010.rejected: kept aside


@dataclass
class Config(RunConfig):
    ckpt_every: int = 5
    """Write a checkpoint after every this many steps."""
    ckpt_dir: str = ""
    """Checkpoint folder (default: <out>/ckpt), locked by the run. A run resumes from its newest checkpoint that verifies, if it has one."""
    fail_rank: int = -1
    """Rank that dies at --fail-step on the first attempt (-1: no fault)."""
    fail_step: int = -1
    """Step at which --fail-rank dies, before its all-reduce (-1: no fault)."""
    fail_how: Literal["exit", "sigkill"] = "exit"
    """How the rank dies: os._exit(13) or SIGKILL (no Python cleanup at all)."""
    fail_in: Literal["step", "save"] = "step"
    """Where: in step --fail-step before its all-reduce, or halfway through writing the checkpoint of step --fail-step."""
    restore: tuple[str, ...] = STATE_PARTS
    """What a resume restores; leave parts out to see the run diverge (negative control)."""
    batch_size: int = 8
    """Samples per rank per step."""
    n_samples: int = 96
    """Size of the dataset (epochs are reshuffled, so the data position matters)."""
    lr: float = 0.05
    """Learning rate of SGD with momentum."""
    momentum: float = 0.9
    """Momentum of SGD (its buffers are the optimizer state a resume must restore)."""
    noise: float = 0.1
    """Std of Gaussian input noise drawn from each rank's RNG (the RNG state a resume must restore)."""
    step_seconds: float = 0.0
    """Sleep this long every step: time to kill a node by hand in the elastic demo."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ckpt_every < 1:
            raise ValueError(f"--ckpt-every must be at least 1, got {self.ckpt_every}")
        if (self.fail_rank < 0) != (self.fail_step < 0):
            raise ValueError("--fail-rank and --fail-step go together: set both or neither")
        if self.fail_step >= self.steps:
            raise ValueError(f"--fail-step {self.fail_step} is never reached in --steps {self.steps}")
        if self.fail_in == "save" and self.fail_step >= 0 and (
                self.fail_step == 0 or self.fail_step % self.ckpt_every):
            raise ValueError(f"--fail-in save needs a --fail-step that is saved: a multiple of "
                             f"--ckpt-every {self.ckpt_every}")
        unknown = set(self.restore) - set(STATE_PARTS)
        if unknown or "model" not in self.restore:
            raise ValueError(f"--restore takes 'model' and any of {STATE_PARTS[1:]}, not {self.restore}")


def validate(cfg: Config, world_size: int) -> None:
    """The rank that is told to fail must exist; everything else works at any world size (the
    batch is per rank, the data position is global)."""
    if cfg.fail_rank >= world_size:
        raise ValueError(f"--fail-rank {cfg.fail_rank} does not exist in a world of {world_size}")


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def fault_due(cfg: Config, rank: int, step: int, where: str) -> bool:
    """Is this the rank, step and place chosen to fail? Only on the first attempt, so that the
    restart can succeed."""
    return (rank == cfg.fail_rank and step == cfg.fail_step and where == cfg.fail_in
            and restart_count() == 0)


def die(cfg: Config, rank: int, step: int) -> None:
    """Die like a crash: no finally, no destroy_process_group."""
    log.warning("rank %d: injected fault at step %d (%s, in the %s)", rank, step, cfg.fail_how,
                cfg.fail_in)
    sys.stdout.flush()
    if cfg.fail_how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(13)


def maybe_inject_fault(cfg: Config, rank: int, step: int) -> None:
    """Kill this rank in the chosen step, on the first attempt only."""
    if fault_due(cfg, rank, step, "step"):
        die(cfg, rank, step)


def noise_seed(cfg: Config, rank: int, step: int = 0) -> int:
    """Seed of a rank's noise stream begun at `step`: at the start of the run, and after a
    resize (the saved per-rank streams belong to a world that no longer exists)."""
    return cfg.seed + 1 + rank + (step << 20)


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Checkpoint interval that minimises saving plus expected lost work, sqrt(2 δ M) (Young
    1974; Daly 2006 adds higher-order terms that matter only when δ is not small against M)."""
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def batch_at(X, Y, cursor: int, rank: int, world_size: int, cfg: Config):
    """This rank's batch at data position `cursor` (samples consumed by the whole job so far);
    each epoch is a fresh permutation seeded by its number, so a position fixes the batch."""
    positions = cursor + rank * cfg.batch_size + torch.arange(cfg.batch_size)
    epochs = positions // cfg.n_samples
    perms = {int(e): torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
        cfg.seed * 1000 + int(e))) for e in epochs.unique()}
    idx = torch.stack([perms[int(e)][int(p)] for e, p in zip(epochs, positions % cfg.n_samples)])
    return X[idx], Y[idx]


def all_reduce_mean_(tensors: list[torch.Tensor], world_size: int) -> None:
    for t in tensors:
        dist.all_reduce(t)
        t /= world_size


def sgd_momentum_step(params, grads, buffers, cfg: Config) -> None:
    """torch.optim.SGD's update (dampening 0); `buffers` is the optimizer state."""
    with torch.no_grad():
        for p, g, b in zip(params, grads, buffers):
            b.mul_(cfg.momentum).add_(g)
            p.sub_(cfg.lr * b)


def write_file(path: Path, obj: dict, crash=None) -> dict:
    """Atomic torch.save (temporary file, fsync, rename); returns the file's manifest entry
    (`common.checkpoint.file_entry`'s size and SHA-256, of the bytes written: no second read).
    `crash` (the fault injector) is called after half the bytes are written: the process dies
    with a half-written .tmp file."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()

    def write(f) -> None:
        f.write(data[:len(data) // 2])
        if crash is not None:
            f.flush()
            crash()
        f.write(data[len(data) // 2:])

    atomic_write(path, write)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def uncommit(folder: Path) -> None:
    """Remove a step folder's manifest before that step is saved again: the re-save is then
    uncommitted until its end (a crash halfway leaves a folder no resume reads)."""
    (folder / MANIFEST).unlink(missing_ok=True)


def save_state(ckpt_dir: Path, step: int, shared: dict, rng: dict, rank: int, crash=None) -> None:
    """Two phases, independent of the world size. Phase 1: rank 0 writes what every replica
    holds alike (model, optimizer, data position, step, world size, run id, shapes) once, every
    rank its own RNG stream, each file atomically. Phase 2, once every rank's entry has reached
    rank 0 (the gather is the barrier): rank 0 writes the folder's manifest, every file with its
    size and SHA-256, and then names the step in `latest`. The manifest is the commit: a crash
    before it leaves a folder without one, which no resume reads. A step saved again (its folder
    already committed) is first uncommitted by rank 0, and a barrier keeps the other ranks' files
    out of the folder until then. A write that fails (a full disk: `atomic_write` names the
    file) fails the save on every rank, in both phases: one collective `CheckpointError`, so that
    no rank is left waiting in a collective for a rank that has gone."""
    folder, world = ckpt_dir / f"step{step:06d}", dist.get_world_size()
    if rank == 0:
        uncommit(folder)
    if world > 1:
        dist.barrier()  # no rank writes into a committed folder: its manifest is gone first
    mine, problem = {}, None
    try:
        if rank == 0:
            mine["state.pt"] = write_file(folder / "state.pt", shared, crash)
        mine[f"rng{rank}.pt"] = write_file(folder / f"rng{rank}.pt", rng, crash)
    except CheckpointError as e:
        problem = str(e)
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, problem))
    problem = next((p for _, p in everyone if p), None)
    if rank == 0 and problem is None:
        try:
            write_manifest(folder, {name: e for part, _ in everyone for name, e in part.items()},
                           step=step, world_size=world, run_id=shared["run_id"])
            atomic_write(ckpt_dir / "latest", lambda f: f.write(str(step).encode()))
        except CheckpointError as e:
            problem = str(e)
    problem = from_rank0(problem)
    if problem:
        raise CheckpointError(problem, collective=True)


def from_rank0(obj):
    """Global rank 0's `obj` on every rank (a collective when the world has several ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def group_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def candidates(ckpt_dir: Path) -> list[Path]:
    """The checkpoints a resume may use, oldest first: every step folder holding a manifest (a
    committed save), and the one `latest` names. `latest` is a hint: a folder it names is tried
    even without a manifest (a committed folder that lost it is skipped in a line, not ignored);
    a torn `latest` is reported and the folders speak for themselves. Global rank 0 lists the
    folder and reads `latest`, and every rank gets its list: on a shared file system another
    node may see a stale listing, and ranks walking different lists would call the verdict's
    collectives a different number of times (a hang)."""
    found = None
    if group_rank() == 0:
        found = {p for p in ckpt_dir.glob("step*")
                 if STEP_FOLDER.fullmatch(p.name) and (p / MANIFEST).exists()}
        try:
            text = (ckpt_dir / "latest").read_bytes().decode(errors="replace")
        except FileNotFoundError:
            text = None
        if text is not None and text.strip().isdigit():
            found.add(ckpt_dir / f"step{int(text):06d}")
        elif text is not None:
            log.warning("%s is torn (%r): trying the step folders", ckpt_dir / "latest", text[:20])
        found = sorted(found)
    return from_rank0(found)


def read_step(folder: Path, rank: int, world_size: int) -> dict:
    """This rank's part of checkpoint `folder`, verified, or `CheckpointError` saying what is
    wrong with which file. The ranks share the hashing of the files against the manifest
    (`verify_manifest`); every `.pt` is checked against its zip CRCs and loaded with
    `weights_only=True` (`load_checkpoint`); the manifest must list `state.pt` and the RNG file
    of every rank of the world that saved it."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} does not exist (`latest` names it)")
    group = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    manifest = verify_manifest(folder, *group)  # each rank hashes every world-th file
    state = load_checkpoint(folder / "state.pt")
    missing = [key for key in ("step", "cursor", "world_size", "model", "optimizer") if key not in state]
    if missing:
        raise CheckpointError(f"{folder / 'state.pt'} is not this script's checkpoint (no {missing[0]})")
    saved_world = state["world_size"]
    needed = ["state.pt", *(f"rng{r}.pt" for r in range(saved_world))]
    unlisted = [name for name in needed if name not in manifest["files"]]
    if unlisted:
        raise CheckpointError(f"{folder} is incomplete: a world of {saved_world} saved it, and its "
                              f"{MANIFEST} lists no {unlisted[0]}")
    state["rng"] = load_checkpoint(folder / f"rng{rank}.pt") if saved_world == world_size else None
    return state


def agreed(verify):
    """`verify(folder)` on every rank, with one verdict for all: the first problem any rank
    found fails the folder on every rank (a collective `CheckpointError`), so that every rank
    resumes from the same checkpoint."""
    def verdict(folder: Path):
        result, problem = None, None
        try:
            result = verify(folder)
        except CheckpointError as e:
            problem = str(e)
        problems = [problem]
        if dist.is_initialized() and dist.get_world_size() > 1:
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p), None)
        if first:
            raise CheckpointError(first, collective=True)
        return result
    return verdict


def keep_aside(folder: Path) -> Path:
    """Rename a rejected checkpoint out of the way (`step000010.rejected`, `.rejected2`, ...):
    the resumed run saves that step again, and the damaged one stays for whoever looks."""
    for n in range(1, 1000):
        aside = folder.with_name(f"{folder.name}.rejected{n if n > 1 else ''}")
        if not aside.exists():
            folder.rename(aside)
            return aside
    raise CheckpointError(f"{folder}: too many rejected copies beside it")


def load_state(ckpt_dir: Path, rank: int, world_size: int, identity: dict | None = None) -> dict | None:
    """The newest checkpoint that verifies, or None for a fresh start (no committed checkpoint
    at all). A checkpoint that fails is skipped with one line naming the file and why (from
    `newest_verified`); none verifying is refused in one line. `identity` ({"run_id", "shapes"}
    of this run): a checkpoint of another run or model is refused in one line. Rejected folders
    newer than the one used are renamed aside (`keep_aside`), never deleted, and `latest` then
    names the step used. The state's `rng`
    is this rank's saved stream when the world size is the one that saved it, else None (a
    resize: rank r of the new world has no stream of its own in the checkpoint)."""
    rejected, verdict = [], agreed(lambda folder: read_step(folder, rank, world_size))

    def verify(folder: Path) -> dict:
        try:
            return verdict(folder)
        except CheckpointError:
            rejected.append(folder)
            raise

    # (the verdicts are collective, so `newest_verified` has rank 0 alone say what it skips)
    folder, state = newest_verified(candidates(ckpt_dir), verify, describe=lambda p: p.name)
    if state is None:
        return None
    if identity is not None:
        check_identity(state, identity["run_id"], identity["shapes"], folder)
    if group_rank() == 0:
        for bad in rejected:
            if bad.exists():
                log.warning("kept the rejected %s as %s", bad.name, keep_aside(bad).name)
        latest = ckpt_dir / "latest"
        if not latest.exists() or latest.read_bytes() != str(state["step"]).encode():
            atomic_write(latest, lambda f: f.write(str(state["step"]).encode()))  # the hint, true again
    if rejected and dist.is_initialized():
        dist.barrier()  # nobody saves into a folder before it is out of the way
    state["folder"] = str(folder)
    return state


def train(cfg: Config, info, ckpt_dir: Path, rec=None, stop_at: int | None = None) -> dict:
    """The training loop with checkpoint/resume. `stop_at` ends it early without saving (a
    crash, for in-process experiments). The run's id is kept in its `--out` (`rec.out`); called
    without a recorder (a test, the notebook), in the checkpoint folder."""
    dtype = torch.float64  # parity to the bit: resuming must change nothing
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=dtype)
    X, Y = X.to(info.device), Y.to(info.device)
    seed_everything(cfg.seed)  # same initial model on every rank
    model = MLP(8, 32, 1).to(info.device, dtype)
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    seed_everything(noise_seed(cfg, info.rank))  # each rank its own noise stream
    start, cursor = 0, 0
    identity = {"run_id": run_id(rec.out if rec is not None else ckpt_dir),
                "shapes": training_shapes(model)}
    state = load_state(ckpt_dir, info.rank, info.world_size, identity)
    if state is not None:
        start = state["step"]
        model.load_state_dict(state["model"])
        if "optimizer" in cfg.restore:
            for b, s in zip(buffers, state["optimizer"]):
                b.copy_(s)
        if "rng" in cfg.restore and state["rng"] is not None:
            restore_rng_state(state["rng"])
        elif "rng" in cfg.restore:  # a resize: every rank starts a stream of its own, reproducibly
            seed_everything(noise_seed(cfg, info.rank, start))
            log.info("world %d -> %d: noise streams re-derived from (seed, step, rank)",
                     state["world_size"], info.world_size)
        if "data" in cfg.restore:
            cursor = state["cursor"]
        log.info("resumed from step %d (restart %d), restoring %s", start, restart_count(),
                 ", ".join(cfg.restore))
    losses, save_s = [], []
    for step in range(start, cfg.steps):
        if step == stop_at:
            break
        x, y = batch_at(X, Y, cursor, info.rank, info.world_size, cfg)
        cursor += cfg.batch_size * info.world_size
        x = x + cfg.noise * torch.randn_like(x)
        loss = F.mse_loss(model(x), y)
        grads = list(torch.autograd.grad(loss, params))
        maybe_inject_fault(cfg, info.rank, step)
        all_reduce_mean_(grads, info.world_size)
        sgd_momentum_step(params, grads, buffers, cfg)
        losses.append(loss.item())
        time.sleep(cfg.step_seconds)
        if rec is not None and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            rec.metrics(step, loss=loss.item(), lr=cfg.lr, restart=restart_count(),
                        world=info.world_size)
            log.info("step %3d  loss %.5f (rank 0's shard)", step, loss.item())
        if (step + 1) % cfg.ckpt_every == 0 or step == cfg.steps - 1:
            crash = fault_due(cfg, info.rank, step + 1, "save")
            with Timer(info.device) as t:
                save_state(ckpt_dir, step + 1, {
                    "step": step + 1, "cursor": cursor, "world_size": info.world_size,
                    "model": model.state_dict(), "optimizer": [b.clone() for b in buffers],
                    **identity},
                    capture_rng_state(), info.rank,
                    crash=(lambda s=step + 1: die(cfg, info.rank, s)) if crash else None)
            save_s.append(t.elapsed)
    return {"model": model, "start": start, "losses": losses, "save_s": save_s,
            "resumed_from": state["folder"] if state is not None else None}


def replica_spread(model) -> float:
    """Largest difference of any parameter between ranks (0 when the replicas agree)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).max().item()


def verify_seconds(folder: Path, info, repeats: int = 5) -> list[float]:
    """Seconds to verify checkpoint `folder` as a resume does (manifest hashes shared by the
    ranks, zip CRCs, `weights_only` loads, one verdict), the slowest rank's, `repeats` times."""
    verify = agreed(lambda f: read_step(f, info.rank, info.world_size))
    times = []
    for _ in range(repeats):
        with Timer(info.device) as t:
            verify(folder)
        times.append(reduce_number(t.elapsed, "max"))
    return times


def main(cfg: Config) -> int:
    # One run per folder: parse_config has global rank 0 lock --out and --ckpt-dir before any
    # process group exists (common.config; a second run is refused there in one line).
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else rec.out / "ckpt"
        log.info("world %d on %s/%s, attempt %d, checkpoints in %s", info.world_size, info.device,
                 info.backend, restart_count(), ckpt_dir)
        result = train(cfg, info, ckpt_dir, rec)

        restarts = restart_count()
        rec.figure("restarts (TORCHELASTIC_RESTART_COUNT)", restarts)
        rec.figure("resumed from step", result["start"])
        rec.figure("final loss (rank 0's shard)", result["losses"][-1] if result["losses"] else None)
        rec.check("replicas identical (max |dparam| across ranks)", "parity",
                  replica_spread(result["model"]), 0.0)
        if cfg.fail_rank >= 0 and restarts > 0:
            # A step fault loses the steps since the last save; a save fault that save as well.
            last_ckpt = (cfg.fail_step - (cfg.fail_in == "save")) // cfg.ckpt_every * cfg.ckpt_every
            rec.check("resumed from the last committed checkpoint", "count", result["start"], last_ckpt)
        # How often to save: Young/Daly with this run's save time and a job MTBF of 24 h (1 000
        # nodes of MTBF 1 000 days). A formula output, not a measurement of anything failing.
        saves = [reduce_number(t, "max") for t in result["save_s"]]  # each save: its slowest rank
        save = statistics.median(saves) if saves else 0.0
        rec.figure("checkpoint save, median (slowest rank)", round(save * 1e3, 2), unit="ms",
                   spread=(round(min(saves) * 1e3, 2), round(max(saves) * 1e3, 2)) if saves else None)
        rec.figure("Young/Daly interval for that save at M = 24 h (formula)",
                   round(young_daly_interval(save, 24 * 3600), 1), unit="s")
        if saves:  # what verifying before use costs, against that save
            checks = verify_seconds(ckpt_dir / f"step{cfg.steps:06d}", info)
            rec.figure("checkpoint verify before use, median (slowest rank)",
                       round(statistics.median(checks) * 1e3, 2), unit="ms",
                       spread=(round(min(checks) * 1e3, 2), round(max(checks) * 1e3, 2)))
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt", {
                "model": result["model"].state_dict(), "restarts": restarts, "start": result["start"]})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
