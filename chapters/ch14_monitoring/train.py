"""Monitoring a data-parallel run: JSON metrics with a schema, TensorBoard, offline W&B, and
per-rank step times gathered on rank 0 to find the straggler that slows everybody down.

A synchronous all-reduce makes every rank's step as slow as the slowest rank, so whole step
times look equal everywhere; this script times each rank's compute (up to the all-reduce) and
its wait (inside it), gathers both with all_gather, and flags ranks slower than the others
beyond noise (median and MAD). `--slow-rank 1 --slow-ms 30` plays a straggler on purpose.

Run:
    python chapters/ch14_monitoring/train.py                                     # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch14_monitoring/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch14_monitoring/train.py --slow-rank 1 --slow-ms 30
    torchrun --standalone --nproc_per_node=8 chapters/ch14_monitoring/train.py --straggler-min-gap-ms 0.5  # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch14_monitoring/train.py                                        # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch14_monitoring/train.py   # Slurm
    tensorboard --logdir runs/ch14_monitoring/train/tb                           # look at the curves
"""

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch03_data_parallel.data_parallel import all_reduce_gradients
from chapters.ch14_monitoring import monitor
from common.checkpoint import save_checkpoint
from common.config import RunConfig, config_dict, parse_config
from common.data import regression_data
from common.distributed import (
    all_gather_single,
    comm_device,
    reduce_number,
    setup_distributed,
    teardown_distributed,
)
from common.log import library_output, log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import mfu, peak_flops, synchronize


@dataclass
class Config(RunConfig):
    steps: int = 40
    """Optimizer steps to train (enough steps for robust medians of the step times)."""
    log_every: int = 2
    """Log a metrics line (JSONL, TensorBoard, W&B) every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to <out>/tb (needs the tensorboard package)."""
    wandb: bool = True
    """Also log to Weights & Biases in offline mode under <out>/wandb (skipped with a note if wandb is missing)."""
    batch_size: int = 64
    """Samples per rank per step (the global batch is world_size times larger)."""
    lr: float = 0.05
    """Peak learning rate of SGD, reached after the warm-up, then cosine decay to a tenth of it."""
    warmup_steps: int = 5
    """Steps of linear learning-rate warm-up."""
    d_hidden: int = 64
    """Hidden width of the MLP."""
    slow_rank: int = -1
    """Rank that sleeps --slow-ms every step to play a straggler (-1: none)."""
    slow_ms: float = 30.0
    """Extra milliseconds of 'compute' per step on --slow-rank."""
    straggler_factor: float = 1.5
    """Flag a rank whose median compute time exceeds the others' median by this factor (and the noise)."""
    straggler_min_gap_ms: float = 5.0
    """...and by at least this many milliseconds (a floor against flagging sub-millisecond gaps on a CPU; lower it on GPUs)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slow_rank < -1:
            raise ValueError(f"--slow-rank must be a rank or -1 for none, got {self.slow_rank}")
        if self.slow_ms < 0:
            raise ValueError(f"--slow-ms must be at least 0, got {self.slow_ms}")
        if self.straggler_factor <= 1:
            raise ValueError(f"--straggler-factor must be above 1, got {self.straggler_factor}")
        if self.batch_size < 1 or self.warmup_steps < 1:
            raise ValueError("--batch-size and --warmup-steps must be at least 1")
        if self.straggler_min_gap_ms < 0:
            raise ValueError(f"--straggler-min-gap-ms must be at least 0, got {self.straggler_min_gap_ms}")


def validate(cfg: Config, world_size: int) -> None:
    """The slowed rank must exist; everything else is per rank (the batch) or world-independent."""
    if cfg.slow_rank >= world_size:
        raise ValueError(f"--slow-rank {cfg.slow_rank} does not exist in a world of {world_size} "
                         f"ranks; use -1 to {world_size - 1}")


def learning_rate(step: int, cfg: Config) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak: a curve worth plotting."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def grad_norm(model: nn.Module) -> float:
    """L2 norm of all gradients together (what clip_grad_norm_ computes before clipping)."""
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))


def timed_step(model, x, y, lr, info, cfg: Config) -> dict:
    """One data-parallel SGD step, timed in two parts: compute up to the all-reduce (where
    ranks differ) and the wait inside it (where the fast ranks wait for the slow one). The device
    is synchronised before every clock reading: CUDA kernels and NCCL collectives return at launch."""
    synchronize(info.device)
    t0 = time.perf_counter()
    loss = F.mse_loss(model(x), y)
    model.zero_grad()
    loss.backward()
    if info.rank == cfg.slow_rank:
        time.sleep(cfg.slow_ms / 1e3)  # a slow GPU, a noisy neighbour, a thermal throttle...
    synchronize(info.device)
    t1 = time.perf_counter()
    all_reduce_gradients(model, info.world_size)  # chapter 03
    synchronize(info.device)
    t2 = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    synchronize(info.device)
    return {"loss": loss.detach(), "compute_s": t1 - t0, "wait_s": t2 - t1,
            "step_s": time.perf_counter() - t0}


def gather_per_rank(values: list[float], info) -> list[list[float]]:
    """All-gather one list of floats per rank: every rank gets [world_size][len(values)]. The
    tensor lives where the backend needs it (`comm_device`: CUDA under NCCL, CPU under gloo).
    Every rank must call it (a collective under `if rank == 0:` hangs the others)."""
    mine = torch.tensor(values, dtype=torch.float64, device=comm_device())
    everyone = torch.empty(info.world_size * len(values), dtype=torch.float64, device=mine.device)
    all_gather_single(everyone, mine)
    return everyone.view(info.world_size, len(values)).tolist()


def global_mean(value: torch.Tensor, info) -> float:
    """The mean of a scalar over the ranks: the rank-aggregated loss."""
    return reduce_number(value.detach().double().item()) / info.world_size


def median_ms(rows: list[list[float]]) -> list[float]:
    """Each rank's median time in milliseconds."""
    return [round(statistics.median(r) * 1e3, 3) for r in rows]


def log_step(rec, run, step: int, line: dict) -> None:
    """One metrics line: metrics.jsonl (+ TensorBoard) through RunRecorder, and W&B offline."""
    rec.metrics(step, **line)
    if run is not None:
        run.log({k: v for k, v in line.items() if isinstance(v, (int, float))}, step=step)


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def wandb_matches_jsonl(rec, keys=("loss", "lr", "grad_norm", "samples_per_s")) -> float:
    """Max |difference| between the W&B offline history and metrics.jsonl (inf if rows differ)."""
    jsonl = [json.loads(t) for t in (rec.out / "metrics.jsonl").read_text().splitlines()]
    history = monitor.read_wandb_history(rec.out)
    if [h.get("_step") for h in history] != [j["step"] for j in jsonl]:
        return math.inf
    return max(abs(h[k] - j[k]) for h, j in zip(history, jsonl) for k in keys)


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        if cfg.tensorboard and not tensorboard_available():
            log.info("tensorboard is not installed: continuing without it (pip install tensorboard)")
            cfg.tensorboard = False
        rec = RunRecorder(cfg, __file__, info)
        run = monitor.wandb_offline_init(rec.out, config_dict(cfg)) if cfg.wandb and info.is_main else None
        seed_everything(cfg.seed)
        model = MLP(16, cfg.d_hidden, 1).to(info.device)  # same seed: same weights everywhere
        n_params = sum(p.numel() for p in model.parameters())
        global_batch = cfg.batch_size * info.world_size
        X, Y = regression_data(cfg.steps * global_batch, 16, 1, seed=cfg.seed)
        X, Y = X.view(cfg.steps, info.world_size, cfg.batch_size, 16), Y.view(cfg.steps, info.world_size, cfg.batch_size, 1)
        # MFU's denominator: the datasheet peak on a known GPU; on a CPU a measured 256x256 fp32
        # matmul at the ranks' thread count (a noisy stand-in, not a peak the hardware promises).
        peak, peak_source = peak_flops(info.device, torch.float32, matmul_size=256)
        log.info("world %d on %s/%s, global batch %d, slow rank %s", info.world_size, info.device,
                 info.backend, global_batch, cfg.slow_rank if cfg.slow_rank >= 0 else "none")

        history = {"compute_s": [], "wait_s": [], "step_s": []}
        for step in range(cfg.steps):
            lr = learning_rate(step, cfg)
            x, y = X[step, info.rank].to(info.device), Y[step, info.rank].to(info.device)
            out = timed_step(model, x, y, lr, info, cfg)
            for k in history:
                history[k].append(out[k])
            if step % cfg.log_every == 0 or step == cfg.steps - 1:  # same steps on every rank
                per_rank = gather_per_rank([out["compute_s"], out["wait_s"]], info)
                line = {"loss": global_mean(out["loss"], info), "lr": lr, "grad_norm": grad_norm(model),
                        "samples_per_s": global_batch / out["step_s"], "step_time_s": out["step_s"],
                        "mfu": mfu(6 * n_params * global_batch / info.world_size, out["step_s"], peak),
                        "compute_s": [r[0] for r in per_rank], "wait_s": [r[1] for r in per_rank]}
                log_step(rec, run, step, line)
                log.info("step %3d  loss %.4f  lr %.4f  |g| %.3f  %.0f samples/s", step,
                         line["loss"], lr, line["grad_norm"], line["samples_per_s"])

        compute = gather_per_rank(history["compute_s"], info)  # [world][steps] on every rank
        whole = gather_per_rank(history["step_s"], info)
        wait = gather_per_rank(history["wait_s"], info)
        min_gap = cfg.straggler_min_gap_ms / 1e3
        found = monitor.find_stragglers(compute, factor=cfg.straggler_factor, min_gap_s=min_gap)
        for r in found["flagged"]:
            log.info("straggler: rank %d computes for %.1f ms per step, threshold %.1f ms", r,
                     found["medians"][r] * 1e3, found["thresholds"][r] * 1e3)
        expected = [cfg.slow_rank] if cfg.slow_rank >= 0 and info.world_size > 1 else []
        rec.check("stragglers flagged (median/MAD of compute times)", "timing", found["flagged"], expected)
        # The same detector on whole step times: the all-reduce makes every rank as slow as the
        # slowest, so it flags nobody, while the check above, same rule and run, flags the straggler.
        hidden = monitor.find_stragglers(whole, cfg.straggler_factor, min_gap_s=min_gap)
        rec.check("stragglers flagged from whole step times (hidden)", "timing", hidden["flagged"], [])
        rec.check("step times gathered: ranks x steps", "count", [len(compute), len(compute[0])],
                  [info.world_size, cfg.steps])
        total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf).item()
        # float64 sum of squares vs torch's float32 per-tensor norms: torch's CPU kernel keeps 8
        # (or 16) running float32 sums, each of at most 4096/8 squares, so its norm is within
        # gamma_520 / 2 = 1.6e-5 relative in the worst case (the lesson); allow 2e-5.
        rec.check("grad norm == clip_grad_norm_'s total norm", "formula", grad_norm(model), total,
                  2e-5, relative=True)
        if run is not None:
            with library_output():  # wandb's closing summary goes to the library log
                run.finish()
        if info.is_main:
            save_checkpoint(rec.out / "step_times.pt", {k: torch.tensor(v) for k, v in
                                                        (("compute", compute), ("wait", wait), ("whole", whole))})
            rec.check("metrics.jsonl lines breaking the schema", "count",
                      len(monitor.validate_file(rec.out / "metrics.jsonl")), 0)
            # The sibling that proves the validator counts: the last line, lr removed and the loss
            # a NaN, breaks the schema twice.
            broken = json.loads((rec.out / "metrics.jsonl").read_text().splitlines()[-1])
            del broken["lr"]
            broken["loss"] = "nan"
            rec.check("errors in a broken line (lr missing, loss 'nan')", "count",
                      len(monitor.validate_line(json.dumps(broken))), 2)
            if run is not None:
                rec.check("W&B offline history == metrics.jsonl (max |diff|)", "parity",
                          wandb_matches_jsonl(rec), 0.0)

        rec.figure("median compute per rank", median_ms(compute), unit="ms")
        rec.figure("median wait in all-reduce per rank", median_ms(wait), unit="ms")
        rec.figure("median whole step per rank", median_ms(whole), unit="ms")
        rec.figure("straggler threshold per rank", [round(t * 1e3, 3) for t in found["thresholds"]], unit="ms")
        rec.figure("whole-step threshold per rank", [round(t * 1e3, 3) for t in hidden["thresholds"]],
                   unit="ms")
        rec.figure("throughput, median", global_batch / statistics.median(history["step_s"]), unit="samples/s")
        rec.figure("peak used for MFU", peak / 1e9, unit="GFLOP/s")
        rec.figure("peak source", peak_source)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
