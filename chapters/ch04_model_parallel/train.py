"""Model and pipeline parallelism: the layers are split across ranks, activations travel by send/recv.

Naive model parallelism runs one batch through the stages in turn, so all but one rank idle;
GPipe cuts the batch into m micro-batches so the stages work on different micro-batches at
once, leaving a bubble of (p−1)/(m+p−1). This script computes one step's loss and gradients
five ways (naive split, hand-written GPipe, the same micro-batches run one after another with
no overlap, `torch.distributed.pipelining` with ScheduleGPipe and Schedule1F1B), checks each
against the unsplit model, trains with the hand-written GPipe, then times GPipe steps: on real
layers (the bubble and the cost of messages), and on stages whose work is a fixed sleep (the
schedule alone decides the time, so the measured bubble tracks (p−1)/(m+p−1)).

Pipeline parallelism needs at least two ranks (one stage each): a world of one is refused in
one line that gives the torchrun command.

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch04_model_parallel/train.py   # 2 CPU stages (gloo)
    torchrun --standalone --nproc_per_node=4 chapters/ch04_model_parallel/train.py   # 4 stages
    torchrun --standalone --nproc_per_node=8 chapters/ch04_model_parallel/train.py \\
        --time-width 2048 --time-micro-batch-size 512                                # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch04_model_parallel/train.py                                        # two nodes
    srun --ntasks=4 --ntasks-per-node=2 python chapters/ch04_model_parallel/train.py  # Slurm
"""

import copy
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from chapters.ch04_model_parallel import checks, wallclock
from chapters.ch04_model_parallel.checks import PARITY_TOL
from chapters.ch04_model_parallel.gpipe import build_stage, gpipe_step, naive_step, serial_step
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import regression_data
from common.distributed import broadcast_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything

DTYPES = {"float64": torch.float64, "float32": torch.float32}
RUN_TWO = "torchrun --standalone --nproc_per_node=2 chapters/ch04_model_parallel/train.py"


@dataclass
class Config(RunConfig):
    micro_batch_size: int = 4
    """Samples per micro-batch; a step's batch is m of them."""
    micro_batches: int = 0
    """Micro-batches m per step (GPipe, 1F1B); 0: twice the number of stages (1F1B needs m >= stages)."""
    layers_per_stage: int = 6
    """Linear layers per stage: the MLP has stages x this many, so every world splits it equally."""
    d_in: int = 16
    """Input features."""
    d_hidden: int = 32
    """Width of every hidden layer (and of every activation sent between stages)."""
    lr: float = 0.05
    """Learning rate of SGD."""
    dtype: str = "float64"
    """float64 makes the parity checks exact to ~1e-15; float32 needs ~1e-6."""
    time_width: int = 256
    """Hidden width of the float32 model whose wall-clock bubble is measured."""
    time_micro_batch_size: int = 64
    """Samples per micro-batch of that measurement (fixed, so the compute per micro-batch is too)."""
    time_repeats: int = 3
    """Timed GPipe steps per micro-batch count (median reported, after one warm-up)."""
    sleep_ms: float = 30.0
    """Fixed-sleep stages: each forward and each backward of a micro-batch sleeps this long (0: skip)."""
    sleep_band: float = 0.1
    """How far (absolute) the fixed-sleep bubble may sit from (p-1)/(m+p-1): the timing check's band."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        require_at_least_one(self, "micro_batch_size", "layers_per_stage", "d_in", "d_hidden",
                             "time_width", "time_micro_batch_size", "time_repeats")
        if self.micro_batches < 0:
            raise ValueError("--micro-batches must be at least 0 (0: twice the number of stages)")
        if self.sleep_ms < 0 or self.sleep_band <= 0:
            raise ValueError("--sleep-ms must be at least 0 and --sleep-band positive")
        if self.device == "cuda" and self.backend == "gloo":
            raise ValueError("the stages send CUDA tensors point to point, which gloo cannot carry "
                             "(its send/recv have no CUDA path): use NCCL, one GPU per rank")


def n_micro_batches(cfg: Config, world_size: int) -> int:
    """The micro-batch count m of this run: --micro-batches, or twice the number of stages."""
    return cfg.micro_batches or 2 * world_size


def validate(cfg: Config, world_size: int) -> None:
    """Refuse, in one sentence, a world this pipeline cannot run on."""
    if world_size < 2:
        raise ValueError(f"pipeline parallelism needs at least 2 ranks, one stage each: {RUN_TWO}")
    m = n_micro_batches(cfg, world_size)
    if m < world_size:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: "
                         f"--micro-batches {m} < {world_size} stages")


def last_rank_value(value: float, info) -> float:
    """Every rank gets a number known on the last stage (the loss)."""
    return broadcast_number(float(value), src=info.world_size - 1)


def train_gpipe(stage, reference, X, Y, cfg: Config, info, act_like, rec) -> float:
    """SGD with the hand-written GPipe beside the unsplit model, step for step; returns the
    largest difference between their losses."""
    m = n_micro_batches(cfg, info.world_size)
    opt = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=cfg.lr)
    max_loss_diff = 0.0
    for step in range(cfg.steps):
        opt.zero_grad()
        loss = gpipe_step(stage, X[step], Y[step], info.rank, info.world_size, act_like, m)
        loss = last_rank_value(loss, info)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(reference(X[step]), Y[step])
        ref_loss.backward()
        ref_opt.step()
        max_loss_diff = max(max_loss_diff, abs(loss - ref_loss.item()))
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            rec.metrics(step, loss=loss, lr=cfg.lr)
            log.info("step %3d  loss %.5f", step, loss)
    return max_loss_diff


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        rank, world = info.rank, info.world_size
        m = n_micro_batches(cfg, world)
        batch, n_layers = m * cfg.micro_batch_size, world * cfg.layers_per_stage
        dtype = DTYPES[cfg.dtype]
        seed_everything(cfg.seed)
        X, Y = regression_data(cfg.steps * batch, cfg.d_in, 1, seed=cfg.seed, dtype=dtype)
        X, Y = X.view(cfg.steps, batch, -1).to(info.device), Y.view(cfg.steps, batch, -1).to(info.device)
        model = MLP(cfg.d_in, cfg.d_hidden, 1, n_layers).to(info.device, dtype)  # same on every rank
        act_like = torch.empty(batch, cfg.d_hidden, device=info.device, dtype=dtype)
        log.info("%d stages x %d layers, batch %d = %d micro-batches of %d, on %s/%s",
                 world, cfg.layers_per_stage, batch, m, cfg.micro_batch_size, info.device, info.backend)

        reference = copy.deepcopy(model)  # the unsplit model, on every rank (it is tiny)
        methods = {
            "naive split": lambda s, x, y: naive_step(s, x, y, rank, world, act_like),
            "hand GPipe": lambda s, x, y: gpipe_step(s, x, y, rank, world, act_like, m),
            "serial micro-batches (control)": lambda s, x, y: serial_step(s, x, y, rank, world, act_like, m),
            "pipelining ScheduleGPipe": lambda s, x, y: checks.pipelining_step(s, x, y, info, m, ScheduleGPipe),
            "pipelining Schedule1F1B": lambda s, x, y: checks.pipelining_step(s, x, y, info, m, Schedule1F1B),
        }
        tol = PARITY_TOL[cfg.dtype]
        checks.record_step_parity(rec, model, reference, X[0], Y[0], methods, build_stage, info, tol)

        stage = build_stage(model, rank, world)
        max_loss_diff = train_gpipe(stage, reference, X, Y, cfg, info, act_like, rec)
        checks.record_training_parity(rec, max_loss_diff, model, stage, reference, cfg.steps, tol)

        wallclock.record_timings(cfg, info, rec, m)
        checks.save_final_params(rec, model, stage, info)  # for the tests
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
