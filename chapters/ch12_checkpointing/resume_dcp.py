"""Multi-rank full resume with DCP: every rank continues exactly where it stopped.

Each rank trains an FSDP2-sharded MLP with dropout (its own dropout stream) on its
DistributedSampler shard, with AdamW and a cosine schedule. At --stop-at the whole state is saved
with one `dcp.save`: sharded model and optimizer, scheduler, data position, and each rank's RNG
state under a rank-keyed entry; then everything is rebuilt from other seeds (as a new process
would), loaded and continued. Every rank's losses and final shards must equal the uninterrupted
run's bit for bit (same machine, same world). DCP treats a plain tensor that every rank saves
under one key as replicated and stores one rank's copy: the negative controls show per-rank state
cross-wired that way, and resumes without the RNG, the data position or the loader's own generator.
Every DCP folder gets a SHA-256 manifest written last (`save_dcp`) and is verified before it is
loaded; DCP's pickled `.metadata` is read through a restricted unpickler only (`load_dcp`,
`read_dcp_metadata`): DCP itself checks no checksum and un-pickles whatever the folder holds.
The run and its state dict are in `resumable.py`; the demonstration's checks and controls in
`resume_dcp_checks.py`; this script is the `--ckpt-dir` loop a real job runs, and `main`.

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch12_checkpointing/resume_dcp.py
    python chapters/ch12_checkpointing/resume_dcp.py                               # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch12_checkpointing/resume_dcp.py \\
        --ckpt-dir /tmp/ck12 --save-every 4 --kill-at 10   # ends after step 10, as a crash would
    torchrun --standalone --nproc_per_node=2 chapters/ch12_checkpointing/resume_dcp.py \\
        --ckpt-dir /tmp/ck12 --save-every 4                # resumes from step 8, ends at --steps
    torchrun --standalone --nproc_per_node=8 chapters/ch12_checkpointing/resume_dcp.py   # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch12_checkpointing/resume_dcp.py --out /shared/fs/ch12r   # --out on a shared file system
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch12_checkpointing/resume_dcp.py --out /shared/fs/ch12r
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from chapters.ch12_checkpointing.checkpoint_files import set_aside
from chapters.ch12_checkpointing.resumable import (
    load_training_state,
    new_run,
    train,
    training_state,
)
from chapters.ch12_checkpointing.resume import make_deterministic
from chapters.ch12_checkpointing.resume_dcp_checks import gather_losses, record_resume, stored_keys
from common.checkpoint import (
    CheckpointError,
    FolderInUseError,
    check_identity,
    lock_folder,
    newest_verified,
    run_id,
    save_checkpoint,
    save_dcp,
    training_shapes,
    unlock_folder,
    verify_dcp,
)
from common.config import RunConfig, parse_config
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder, is_main_script


@dataclass
class Config(RunConfig):
    steps: int = 16
    """Optimizer steps of the whole run (crosses an epoch boundary after --stop-at on 2+ ranks)."""
    stop_at: int = 5
    """Demo: the step after which the run is saved, rebuilt from other seeds, loaded and continued."""
    ckpt_dir: str = ""
    """Folder of step_NNNNNN DCP checkpoints; when set, resume from its newest one that verifies and train to --steps."""
    save_every: int = 4
    """With --ckpt-dir: save after every this many steps."""
    kill_at: int = 0
    """With --ckpt-dir: stop after this step without finishing, as a crash would (0: run to --steps)."""
    batch_size: int = 4
    """Samples per rank per step (DistributedSampler gives each rank its share of every epoch)."""
    n_samples: int = 96
    """Samples in the data set."""
    d_hidden: int = 64
    """Hidden width of the MLP."""
    dropout: float = 0.2
    """Dropout probability: makes every rank's RNG state part of the training state."""
    lr: float = 3e-3
    """Peak learning rate of AdamW (cosine schedule over --steps)."""
    deterministic: bool = True
    """Deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG): a GPU rerun is bit-exact only with them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.stop_at < self.steps:
            raise ValueError(f"--stop-at must lie strictly between 0 and --steps={self.steps}")
        if self.save_every < 1 or self.batch_size < 1 or self.n_samples < 1:
            raise ValueError("--save-every, --batch-size and --n-samples must be at least 1")
        if not 0 <= self.kill_at < self.steps:
            raise ValueError(f"--kill-at must lie in [0, --steps={self.steps})")
        if not 0 <= self.dropout < 1:
            raise ValueError("--dropout must lie in [0, 1)")


def validate(cfg: Config, world_size: int) -> None:
    """The batch is per rank and DistributedSampler pads the data set to a multiple of the world
    (any world from 1 to 16 and beyond runs). Nothing in --ckpt-dir is read here: a folder is
    read only once it has verified, and its metadata only through the restricted unpickler (an
    earlier version read `.metadata` here with DCP's plain reader, so a crafted file ran code
    before the run had even started). The world a checkpoint was saved by is checked after
    verification (`check_world`)."""


STEP_FOLDER = re.compile(r"step_\d{6}")


def step_folders(ckpt_dir: Path) -> list[Path]:
    """The folder's step_NNNNNN checkpoints, oldest first."""
    return sorted(p for p in Path(ckpt_dir).glob("step_*") if STEP_FOLDER.fullmatch(p.name))


def newest_checkpoint(ckpt_dir: Path, rid: str, shapes: dict,
                      world_size: int | None = None) -> tuple[Path | None, dict | None]:
    """(folder, manifest) of the newest step_NNNNNN folder that verifies (`verify_dcp`: every
    file against its SHA-256 in manifest.json, which a save writes last, so a save that did not
    finish has none); each damaged one skipped is logged in one line. That folder must be this
    run's (`check_identity` on the manifest's run id and shapes): another run's or another
    model's is refused in one line, not walked past as damage. With `world_size`, it must also
    have been saved by that many ranks (`check_world`). Collective: every rank walks the same
    folders to the same verdicts."""
    path, manifest = newest_verified(step_folders(ckpt_dir), verify_dcp, describe=lambda p: p.name)
    if path is not None:
        check_identity(manifest, rid, shapes, path)
        if world_size is not None:
            check_world(path, world_size)
    return path, manifest


def check_world(path: Path, world_size: int) -> None:
    """A --ckpt-dir checkpoint resumes on the world that saved it: its RNG streams and data
    positions are per rank. Counted in the (verified, safely read) metadata: one rank-keyed RNG
    entry per saving rank. Collective verdict: every rank reads the same metadata."""
    saved = len(stored_keys(path, ".rng.torch"))
    if saved != world_size:
        raise CheckpointError(f"{path} was saved by {saved} ranks and resume_dcp.py resumes on the "
                              f"same number, not {world_size} (per-rank RNG and data positions; "
                              f"chapter 13 resumes on any world)", collective=True)


def lock_ckpt_dir(ckpt_dir: Path, wait_s: float = 3.0) -> None:
    """Global rank 0 takes the folder's lock (one run at a time; several nodes of one job never
    refuse each other) and every rank learns the verdict, so that no rank touches a folder that
    another run holds and rank 0 alone says so, in one line."""
    problem = None
    if dist.get_rank() == 0:
        try:
            lock_folder(ckpt_dir, "--ckpt-dir", wait_s=wait_s)
        except FolderInUseError as e:
            problem = str(e)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        error = FolderInUseError(box[0])
        error.collective = True  # common.log.one_line_errors: rank 0 alone prints it
        raise error


def run_with_checkpoints(cfg: Config, device: torch.device, out: Path,
                         lock_wait_s: float = 3.0) -> dict:
    """The loop a real job runs: take the checkpoint folder (waiting up to `lock_wait_s` for a
    run that is still ending), resume from the newest checkpoint that verifies and is this run's
    (run id in `out`), save every --save-every steps into a new folder (never over the last good
    one), each with its manifest written last."""
    ckpt_dir, own_lock = Path(cfg.ckpt_dir), not is_main_script(__file__)
    if own_lock:  # called in process (a test, a notebook): run as a script, parse_config has
        # locked --ckpt-dir on global rank 0 before any process group, until the process ends
        lock_ckpt_dir(ckpt_dir, lock_wait_s)
    try:
        run = new_run(cfg, device, cfg.seed)
        rid, shapes = run_id(out), training_shapes(run["model"], run["opt"])
        path, _ = newest_checkpoint(ckpt_dir, rid, shapes, dist.get_world_size())
        if path is not None:
            if dist.get_rank() == 0:  # folders newer than it failed: kept, never saved over
                set_aside([p for p in step_folders(ckpt_dir) if p.name > path.name])
            dist.barrier()
            load_training_state(path, run)
            log.info("resumed from %s at step %d", path.name, run["step"])
        first, losses, end = run["step"], [], cfg.kill_at or cfg.steps
        while run["step"] < end:
            losses += train(cfg, run, min(end, (run["step"] // cfg.save_every + 1) * cfg.save_every))
            if run["step"] % cfg.save_every == 0:
                save_dcp(training_state(run), ckpt_dir / f"step_{run['step']:06d}", run_id=rid,
                         step=run["step"], shapes=shapes, world=dist.get_world_size())
                log.info("saved step %d", run["step"])
    finally:
        if own_lock and dist.get_rank() == 0:  # never parse_config's lock (re-entrant, not counted)
            unlock_folder(ckpt_dir)
    return {"first_step": first, "losses": losses}


def main(cfg: Config) -> int:
    make_deterministic(cfg.deterministic)  # before any CUDA work
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        if cfg.ckpt_dir:
            out = run_with_checkpoints(cfg, info.device, rec.out)
            rec.figure("resumed from step", out["first_step"])
            losses = {"first_step": out["first_step"], "losses": gather_losses(out["losses"])}
        else:
            losses = record_resume(cfg, info, rec)
            for step, (loss, lr) in enumerate(zip(losses["resumed"][0], losses.pop("lrs"))):
                rec.metrics(step, loss=loss, lr=lr)  # rank 0's resumed run
        if info.is_main:
            save_checkpoint(rec.out / "losses.pt", losses)  # for the tests: every rank's losses
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
