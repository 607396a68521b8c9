"""Survive a spot preemption: SIGTERM, every rank agrees to stop, one checkpoint to object storage
within the grace period, a clean exit, and a restarted job that resumes bit-identically.

A cloud that reclaims a spot/preemptible machine first sends SIGTERM, then SIGKILL once its grace
period is over (GCP spot/preemptible: 30 s; Kubernetes: terminationGracePeriodSeconds, 30 s by
default; SageMaker's StopTrainingJob: 120 s). Behind torchrun the ranks have at most its
--shutdown-timeout (30 s by default): it SIGKILLs them that long after it forwarded the SIGTERM,
so --grace-s is the smaller of the two (SageMaker's template: 110 s of its 120). AWS spot gives
its two minutes' notice in the instance metadata instead, and SIGTERM only at the shutdown that
ends them: with `--spot-notice`, a thread on each node's local rank 0 polls it
(IMDSv2: a token by PUT, then GET spot/instance-action). The signal handler and the poller only
set a flag; at every step boundary the ranks all-reduce that flag (MAX), so every rank stops at
the same step even if only one node was told, and they write one checkpoint together, timed
against the deadline (`--grace-s` after the notice). Checkpoints go through fsspec to a URL
(a local path, `file://`, `s3://`, `gs://`, `oss://` where its fsspec package is installed): every
object is written whole, and a step counts only once its `manifest.json`, written last, exists.
Each rank then exits with code 143 (128 + SIGTERM), never 0, so that the launcher restarts it
(torchrun, if it started the ranks, exits 1 itself); the restarted run (the same command, the same
--out, which holds the run id) takes the newest step that verifies: every object read once and
checked against the manifest's size and SHA-256 and its own zip CRC-32s, loaded with
`weights_only=True`, the run id and shapes this run's. A step that fails is skipped in one line
for the one before; none left is refused in one line, as is another run's checkpoint. One run per
folder: global rank 0 locks --out and a local --ckpt-url. The training loop, data position and
per-rank noise are chapter 13's.

Run:
    python chapters/ch24_cloud/train.py                                       # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch24_cloud/train.py     # no preemption
    torchrun --standalone --nproc_per_node=2 chapters/ch24_cloud/train.py --steps 200 \\
        --step-seconds 0.1 --ckpt-url /tmp/ch24-bucket --out runs/ch24a   # then: kill -TERM <pid>
    torchrun --standalone --nproc_per_node=2 chapters/ch24_cloud/train.py --steps 200 \\
        --ckpt-url /tmp/ch24-bucket --out runs/ch24a                       # resumes where it stopped
    torchrun --nnodes=2 --nproc_per_node=8 --shutdown-timeout 110 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=job24 chapters/ch24_cloud/train.py \\
        --ckpt-url s3://BUCKET/ckpt --grace-s 110 --spot-notice aws        # AWS spot, 2 nodes
"""

# The preemption notice and the stop agreement are in preemption.py, AWS's spot notice poller in
# spot_notice.py, the checkpoints on object storage in object_store.py, the proofs the run records
# in checks.py. This file: the config, the loop that checks for a notice before every step, main().

import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chapters.ch13_fault_tolerance.elastic import (
    all_reduce_mean_,
    batch_at,
    noise_seed,
    restart_count,
    sgd_momentum_step,
)
from chapters.ch24_cloud.checks import record_checks
from chapters.ch24_cloud.object_store import ObjectStoreCheckpoints, run_identity
from chapters.ch24_cloud.preemption import Preemption, seconds_to_commit, stop_agreed
from chapters.ch24_cloud.spot_notice import SpotNoticePoller, spot_notice_url
from common.checkpoint import lock_folder, save_checkpoint, unlock_folder
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import capture_rng_state, restore_rng_state, seed_everything

STATE_PARTS = ("model", "optimizer", "rng", "data")
PREEMPTED_EXIT = 143  # 128 + SIGTERM: "stopped by a signal", never 0 ("done, do not restart")


@dataclass
class Config(RunConfig):
    ckpt_url: str = ""
    """Checkpoint location, an fsspec URL or a path (default: <out>/ckpt). A run resumes from its newest checkpoint that verifies and is this run's (the run id in --out); a local one is locked for the run."""
    ckpt_every: int = 5
    """Also checkpoint after every this many steps (a preemption can come without notice)."""
    grace_s: float = 30.0
    """Seconds from the notice until the job is killed (30 s: GCP spot, Kubernetes' default; 120 s: SageMaker's StopTrainingJob, AWS's spot notice before the time it names), and no more than torchrun's --shutdown-timeout, after which torchrun SIGKILLs the ranks. The save on notice is timed against it (a warning and a failed timing check when late), and a periodic save slower than it is reported at once."""
    spot_notice: str = ""
    """Poll AWS's spot interruption notice (IMDSv2) from each node's local rank 0: 'aws' (the real endpoint, http://169.254.169.254), 'auto' (the real one if this machine says it is EC2, else off), a URL (another endpoint, such as a test's), or '' (off)."""
    spot_poll_s: float = 5.0
    """Seconds between two polls of the spot notice (AWS recommends every 5 s)."""
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
    """Sleep this long every step: time to send the signal by hand."""
    pause_save_at: int = -1
    """Test hook: in the save of this step, after the data objects and before the manifest, write <out>/paused and wait until killed (-1: off)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ckpt_every < 1:
            raise ValueError(f"--ckpt-every must be at least 1, got {self.ckpt_every}")
        if self.grace_s <= 0:
            raise ValueError(f"--grace-s must be positive, got {self.grace_s}")
        if self.spot_poll_s <= 0:
            raise ValueError(f"--spot-poll-s must be positive, got {self.spot_poll_s}")
        if self.spot_notice not in ("", "aws", "auto") and not self.spot_notice.startswith(
                ("http://", "https://")):
            raise ValueError(f"--spot-notice takes '', 'aws', 'auto' or an http:// URL, "
                             f"not {self.spot_notice!r}")
        unknown = set(self.restore) - set(STATE_PARTS)
        if unknown or "model" not in self.restore:
            raise ValueError(f"--restore takes 'model' and any of {STATE_PARTS[1:]}, not {self.restore}")
        if self.pause_save_at >= 0 and (self.pause_save_at == 0 or self.pause_save_at % self.ckpt_every):
            raise ValueError(f"--pause-save-at needs a step that is saved: a multiple of "
                             f"--ckpt-every {self.ckpt_every}")


def validate(cfg: Config, world_size: int) -> None:
    """Any world size works: the batch is per rank and the data position is global."""


# --- the training loop ------------------------------------------------------------------------

def new_model(cfg: Config, device) -> MLP:
    seed_everything(cfg.seed)  # same initial model on every rank
    return MLP(8, 32, 1).to(device, torch.float64)


def resume(cfg: Config, state: dict, model, buffers, rank: int) -> int:
    """Put a loaded checkpoint back; return the data cursor. Parts left out of --restore stay as
    a fresh run would have them (the negative controls)."""
    model.load_state_dict(state["model"])
    if "optimizer" in cfg.restore:
        for b, s in zip(buffers, state["optimizer"]):
            b.copy_(s)
    if "rng" in cfg.restore and state["rng"] is not None:
        restore_rng_state(state["rng"])
    elif "rng" in cfg.restore:  # another world size: streams re-derived as chapter 13 does
        seed_everything(noise_seed(cfg, rank, state["step"]))
    return state["cursor"] if "data" in cfg.restore else 0


def train(cfg: Config, info, store: ObjectStoreCheckpoints, notice: Preemption, out,
          rec=None) -> dict:
    """Chapter 13's data-parallel SGD, checking for a preemption notice before every step. `out`
    is the run's folder: its run id (`run_identity`) goes into every manifest, and a checkpoint
    is resumed only if it carries the same."""
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=torch.float64)
    X, Y = X.to(info.device), Y.to(info.device)
    model = new_model(cfg, info.device)
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    seed_everything(noise_seed(cfg, info.rank))  # each rank its own noise stream
    identity = run_identity(out, model, buffers)
    start, cursor = 0, 0
    state = store.load_latest(info.rank, info.world_size, identity)
    if state is not None:
        start = state["step"]
        cursor = resume(cfg, state, model, buffers, info.rank)
        log.info("resumed from step %d of %s, restoring %s", start, store.url, ", ".join(cfg.restore))

    def save(step: int) -> None:
        pause = pause_until_killed(out, cfg.timeout) if step == cfg.pause_save_at else None
        store.save(step, {"step": step, "cursor": cursor, "model": model.state_dict(),
                          "optimizer": [b.clone() for b in buffers]},
                   capture_rng_state(), info.rank, meta=identity, pause=pause)

    losses, preempted_at, committed_time, step_s, save_s = [], None, None, [], []
    last_saved, previous, warned = start, start, False
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        if stop_agreed(notice, step, info.device):
            previous = last_saved  # what a restart finds if this save does not finish in time
            if step != last_saved:  # every rank holds the same value: no listing to disagree on
                t = time.perf_counter()
                save(step)
                save_s.append(time.perf_counter() - t)
            preempted_at, committed_time = step, time.time()
            break
        x, y = batch_at(X, Y, cursor, info.rank, info.world_size, cfg)
        cursor += cfg.batch_size * info.world_size
        x = x + cfg.noise * torch.randn_like(x)
        loss = F.mse_loss(model(x), y)
        grads = list(torch.autograd.grad(loss, params))
        all_reduce_mean_(grads, info.world_size)
        sgd_momentum_step(params, grads, buffers, cfg)
        losses.append(loss.item())
        time.sleep(cfg.step_seconds)
        step_s.append(time.perf_counter() - t0)
        if rec is not None and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            rec.metrics(step, loss=loss.item(), lr=cfg.lr, restart=restart_count())
            log.info("step %3d  loss %.5f (rank 0's shard)", step, loss.item())
        if (step + 1) % cfg.ckpt_every == 0 or step == cfg.steps - 1:
            t = time.perf_counter()
            save(step + 1)
            save_s.append(time.perf_counter() - t)
            last_saved = step + 1
            worst = seconds_to_commit(max(step_s), max(save_s))
            if worst > notice.grace_s and not warned and info.is_main:
                log.warning("a step takes %.3f s and a save %.3f s: a save on notice would end "
                            "after --grace-s %g s", max(step_s), max(save_s), notice.grace_s)
                log.warning("  (a preemption would fall back to the last periodic checkpoint)")
                warned = True
    return {"model": model, "start": start, "losses": losses, "preempted_at": preempted_at,
            "signal_time": notice.signal_time, "allowed_s": notice.allowed_s(),
            "committed_time": committed_time, "previous_commit": previous,
            "step_s": step_s, "save_s": save_s}


def pause_until_killed(out, timeout_s: float):
    """The test hook: announce the pause in <out>/paused, then wait (a save slower than the grace)."""
    def pause() -> None:
        from pathlib import Path
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "paused").write_text(str(time.time()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise TimeoutError(f"--pause-save-at: nobody killed this run within {timeout_s:.0f} s")
    return pause


def main(cfg: Config) -> int:
    notice = Preemption(cfg.grace_s).install()  # before anything slow: a notice can come any time
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    poller = ckpt_lock = None
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        store = ObjectStoreCheckpoints(cfg.ckpt_url or str(rec.out / "ckpt"))
        if store.local and info.rank == 0:  # one run per checkpoint folder, as per --out
            ckpt_lock = lock_folder(store.root, "--ckpt-url")
        log.info("world %d on %s/%s, checkpoints in %s, grace %g s", info.world_size,
                 info.device, info.backend, store.url, cfg.grace_s)
        url = spot_notice_url(cfg.spot_notice)
        if url is not None and info.local_rank == 0:  # one poller per node
            poller = SpotNoticePoller(url, notice, cfg.spot_poll_s).start()
            log.info("polling the spot interruption notice at %s every %g s", url, cfg.spot_poll_s)
        elif cfg.spot_notice == "auto" and url is None:
            log.info("--spot-notice auto: this machine does not say it is EC2, no notice to poll")
        result = train(cfg, info, store, notice, rec.out, rec)
        record_checks(rec, cfg, result, notice, poller)
        if result["preempted_at"] is not None:
            code = rec.finish() or PREEMPTED_EXIT
            log.info("exit code %d: stopped by the preemption notice, resume from %s", code, store.url)
            return code
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt",
                            {"model": result["model"].state_dict(), "start": result["start"]})
        return rec.finish()
    finally:
        if poller is not None:
            poller.stop()
        if ckpt_lock is not None:
            unlock_folder(ckpt_lock)
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
