"""Model and pipeline parallelism: the layers are split across ranks, activations travel by send/recv.

Naive model parallelism runs one batch through the stages in turn, so all but one rank idle;
GPipe cuts the batch into m micro-batches so the stages work on different micro-batches at
once, leaving a bubble of (p−1)/(m+p−1). This script computes one step's loss and gradients
four ways (naive split, hand-written GPipe, `torch.distributed.pipelining` with ScheduleGPipe
and Schedule1F1B), checks each against the unsplit model, trains with the hand-written GPipe,
and measures the wall-clock bubble with real layers beside the formula.

Pipeline parallelism needs at least two ranks (one stage each); without torchrun the script
prints the command to use and exits with status 1.

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch04_model_parallel/train.py   # 2 CPU stages (gloo)
    torchrun --standalone --nproc_per_node=4 chapters/ch04_model_parallel/train.py   # 4 stages
    torchrun --standalone --nproc_per_node=4 chapters/ch04_model_parallel/train.py \\
        --time-width 2048 --time-batch 1024                                          # 4 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch04_model_parallel/train.py                                        # two nodes
    srun --ntasks=4 --ntasks-per-node=2 python chapters/ch04_model_parallel/train.py  # Slurm
"""

import copy
import json
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from chapters.ch04_model_parallel.schedule import bubble_formula
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Config(RunConfig):
    batch_size: int = 16
    """Samples per optimizer step (the whole batch that enters the first stage)."""
    micro_batches: int = 4
    """Micro-batches m the batch is cut into (GPipe, 1F1B); must divide --batch-size."""
    n_layers: int = 12
    """Linear layers of the MLP; the stages get equal, contiguous runs of them."""
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
    time_batch: int = 256
    """Batch size of that measurement."""
    time_repeats: int = 3
    """Timed GPipe steps per micro-batch count (median reported, after one warm-up)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        require_at_least_one(self, "batch_size", "micro_batches", "n_layers", "time_batch", "time_repeats")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"--micro-batches {self.micro_batches} does not divide "
                             f"--batch-size {self.batch_size} into equal micro-batches")


def layout_error(cfg: Config, world_size: int) -> str | None:
    """Why this world size cannot pipeline this model, in one sentence (None if it can)."""
    if world_size < 2:
        return ("pipeline parallelism needs at least 2 ranks, one stage each; run: "
                "torchrun --standalone --nproc_per_node=2 chapters/ch04_model_parallel/train.py")
    if cfg.n_layers % world_size:
        return f"--n-layers {cfg.n_layers} does not split into {world_size} equal stages"
    if cfg.micro_batches < world_size:
        return (f"1F1B needs at least as many micro-batches as stages: "
                f"--micro-batches {cfg.micro_batches} < {world_size}")
    return None


def build_stage(model: MLP, rank: int, n_stages: int) -> nn.Sequential:
    """Stage `rank` of `n_stages`: an equal, contiguous run of the MLP's Linear(+ReLU) layers.
    The modules are shared with `model`, so gradients land in `model`'s parameters."""
    children = list(model)
    per_stage = (len(children) + 1) // 2 // n_stages  # Linear layers per stage
    return nn.Sequential(*children[2 * per_stage * rank: 2 * per_stage * (rank + 1)])


def send_forward(act: torch.Tensor, rank: int) -> dist.Work:
    """Send asynchronously: a blocking send would hold this stage until the next one posts
    its receive, and the stages would move in lock-step instead of overlapping."""
    return dist.isend(act.contiguous(), dst=rank + 1)


def recv_forward(like: torch.Tensor, rank: int) -> torch.Tensor:
    act = torch.empty_like(like)
    dist.recv(act, src=rank - 1)
    return act.requires_grad_()  # so its .grad can be sent back to the previous stage


def send_backward(grad: torch.Tensor, rank: int) -> dist.Work:
    return dist.isend(grad.contiguous(), dst=rank - 1)


def recv_backward(like: torch.Tensor, rank: int) -> torch.Tensor:
    grad = torch.empty_like(like)
    dist.recv(grad, src=rank + 1)
    return grad


def stage_forward(stage, x, y, rank, world, act_like, loss_scale, pending, events=None, mb=0):
    """Receive (or read) the input, run the stage, send the output on (the send's handle goes
    to `pending`). Returns (input, output): on the last stage the output is the loss times
    `loss_scale`, ready for backward."""
    inp = x if rank == 0 else recv_forward(act_like, rank)
    t0 = time.perf_counter()
    out = stage(inp)
    if rank == world - 1:
        out = F.mse_loss(out, y) * loss_scale
    if events is not None:
        events.append(("F", mb, t0, time.perf_counter()))
    if rank < world - 1:
        pending.append(send_forward(out.detach(), rank))
    return inp, out


def stage_backward(inp, out, rank, world, pending, events=None, mb=0) -> None:
    """Receive the output's gradient (the loss needs none), backpropagate, send the input's back."""
    grad = None if rank == world - 1 else recv_backward(out, rank)
    t0 = time.perf_counter()
    out.backward(grad)
    if events is not None:
        events.append(("B", mb, t0, time.perf_counter()))
    if rank > 0:
        pending.append(send_backward(inp.grad, rank))


def naive_step(stage, x, y, rank, world, act_like) -> float:
    """Naive model parallelism: the whole batch forward through the stages, then backward."""
    pending: list[dist.Work] = []
    inp, out = stage_forward(stage, x, y, rank, world, act_like, 1.0, pending)
    stage_backward(inp, out, rank, world, pending)
    for work in pending:
        work.wait()
    return out.item() if rank == world - 1 else 0.0


def gpipe_step(stage, x, y, rank, world, act_like, n_micro, loss_scale=None, events=None) -> float:
    """GPipe: all m micro-batches forward, then all backward; gradients add up in .grad.
    Each micro-batch loss is scaled by 1/m so the sum is the whole batch's mean loss."""
    scale = 1.0 / n_micro if loss_scale is None else loss_scale
    xs, ys = x.chunk(n_micro), y.chunk(n_micro)
    act_like = act_like[: len(xs[0])]
    pending: list[dist.Work] = []
    saved = [stage_forward(stage, xs[i], ys[i], rank, world, act_like, scale, pending, events, i)
             for i in range(n_micro)]
    for i, (inp, out) in enumerate(saved):
        stage_backward(inp, out, rank, world, pending, events, i)
    for work in pending:
        work.wait()
    return sum(out.item() for _, out in saved) / (scale * n_micro) if rank == world - 1 else 0.0


def pipelining_step(stage, x, y, info, n_micro, schedule_cls) -> float:
    """The same step with torch.distributed.pipelining: a PipelineStage and a schedule."""
    pipe_stage = PipelineStage(stage, info.rank, info.world_size, info.device)
    schedule = schedule_cls(pipe_stage, n_microbatches=n_micro, loss_fn=F.mse_loss)
    if info.rank == 0:
        schedule.step(x)
    elif info.rank == info.world_size - 1:
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses)
        return torch.stack(losses).mean().item()
    else:
        schedule.step()
    return 0.0


def stage_diff(model: nn.Module, stage: nn.Module, reference: nn.Module, grads: bool = True) -> float:
    """Largest |grad − reference grad| (or |param − reference param|) over this stage's
    parameters, maximised over ranks; a parameter that got no gradient counts as zero."""
    ref = dict(reference.named_parameters())
    mine = {id(p) for p in stage.parameters()}
    diff = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        if id(p) in mine:
            a, b = (p.grad if p.grad is not None else torch.zeros_like(p), ref[name].grad) if grads else (p, ref[name])
            diff = torch.maximum(diff, (a - b).abs().max().double().cpu())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def last_rank_value(value: float, info) -> float:
    """Broadcast a number known on the last stage (the loss) to every rank."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, src=info.world_size - 1)
    return t.item()


def train_gpipe(stage, reference, X, Y, cfg: Config, info, act_like, rec) -> float:
    """SGD with the hand-written GPipe beside the unsplit model, step for step; returns the
    largest difference between their losses."""
    opt = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=cfg.lr)
    max_loss_diff = 0.0
    for step in range(cfg.steps):
        opt.zero_grad()
        loss = gpipe_step(stage, X[step], Y[step], info.rank, info.world_size, act_like, cfg.micro_batches)
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
        error = layout_error(cfg, info.world_size)
        if error:
            raise SystemExit(f"error: {error}")
        rec = RunRecorder(cfg, __file__, info)
        rank, world, m = info.rank, info.world_size, cfg.micro_batches
        dtype = DTYPES[cfg.dtype]
        seed_everything(cfg.seed)
        X, Y = regression_data(cfg.steps * cfg.batch_size, cfg.d_in, 1, seed=cfg.seed, dtype=dtype)
        X, Y = X.view(cfg.steps, cfg.batch_size, -1).to(info.device), Y.view(cfg.steps, cfg.batch_size, -1).to(info.device)
        model = MLP(cfg.d_in, cfg.d_hidden, 1, cfg.n_layers).to(info.device, dtype)  # same on every rank
        act_like = torch.empty(cfg.batch_size, cfg.d_hidden, device=info.device, dtype=dtype)
        log.info("%d stages x %d layers, batch %d = %d micro-batches of %d, on %s/%s",
                 world, cfg.n_layers // world, cfg.batch_size, m, cfg.batch_size // m,
                 info.device, info.backend)

        reference = copy.deepcopy(model)  # the unsplit model, on every rank (it is tiny)
        ref_loss = F.mse_loss(reference(X[0]), Y[0])
        ref_loss.backward()
        methods = {
            "naive split": lambda s, x, y: naive_step(s, x, y, rank, world, act_like),
            "hand GPipe": lambda s, x, y: gpipe_step(s, x, y, rank, world, act_like, m),
            "pipelining ScheduleGPipe": lambda s, x, y: pipelining_step(s, x, y, info, m, ScheduleGPipe),
            "pipelining Schedule1F1B": lambda s, x, y: pipelining_step(s, x, y, info, m, Schedule1F1B),
        }
        tol = 1e-12 if cfg.dtype == "float64" else 1e-5
        for name, step in methods.items():
            copy_ = copy.deepcopy(model)
            stage = build_stage(copy_, rank, world)
            loss = last_rank_value(step(stage, X[0], Y[0]), info)
            rec.check(f"{name}: loss == unsplit", "parity", abs(loss - ref_loss.item()), 0.0, tol)
            rec.check(f"{name}: grads == unsplit (max |dgrad|)", "parity",
                      stage_diff(copy_, stage, reference), 0.0, tol)

        stage = build_stage(model, rank, world)
        max_loss_diff = train_gpipe(stage, reference, X, Y, cfg, info, act_like, rec)
        rec.check("GPipe training: losses == unsplit (max diff)", "parity", max_loss_diff, 0.0, 1e3 * tol)
        rec.check("GPipe training: params == unsplit (max |dparam|)", "parity",
                  stage_diff(model, stage, reference, grads=False), 0.0, 1e3 * tol)

        from chapters.ch04_model_parallel.wallclock import measure_bubble  # imports this module

        for n_micro in sorted({1, 2, m, 2 * m}):
            bubble, timeline = measure_bubble(cfg, info, n_micro)
            rec.figure(f"wall-clock bubble, m={n_micro}", bubble, float(bubble_formula(world, n_micro)))
            if n_micro == m and info.is_main:
                (rec.out / "timeline.json").write_text(json.dumps([e.__dict__ for e in timeline]))
        mine = {id(p) for p in stage.parameters()}
        params = {n: p.detach() for n, p in model.named_parameters() if id(p) in mine}
        gathered = [None] * world
        dist.all_gather_object(gathered, params)
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt",
                            {"params": {n: t for d in gathered for n, t in d.items()}})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
