"""Mixed precision: compute in bf16 or fp16, keep fp32 master weights, scale the loss so fp16
gradients do not underflow, and reduce gradients in a chosen dtype under DDP and FSDP2.

The script prints the range and precision of fp32/bf16/fp16/fp8 beside their bit-layout
formulas, shows FP8 per-tensor scaling and an fp16 gradient underflow cured by loss scaling,
checks a hand-written dynamic loss scaler against `torch.amp.GradScaler` decision by decision,
then trains the same MLP data-parallel in fp32 and in each `--precision` (bf16 and fp16 by
default), counts the updates that low-precision weights lose without an fp32 master copy, and
trains with FSDP2 and a `MixedPrecisionPolicy` (bf16 params for compute, fp32 storage and
reduction). The dtypes and bytes that reach the collectives are read off the tensors sent
(chapter 09's `WireTap`).

Run:
    python chapters/ch10_mixed_precision/train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch10_mixed_precision/train.py
    torchrun --standalone --nproc_per_node=2 chapters/ch10_mixed_precision/train.py --precision fp16
    torchrun --standalone --nproc_per_node=8 chapters/ch10_mixed_precision/train.py   # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch10_mixed_precision/train.py                                      # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch10_mixed_precision/train.py   # Slurm
"""


import contextlib
import copy
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch09_compression.wire import WireTap
from chapters.ch10_mixed_precision import checks
from chapters.ch10_mixed_precision.checks import UPDATE_COUNTS, count_updates
from chapters.ch10_mixed_precision.formats import LOW
from chapters.ch10_mixed_precision.loss_scaler import DynamicLossScaler
from common.checkpoint import save_checkpoint
from common.config import RunConfig, check_global_batch, parse_config
from common.data import regression_data
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer

WARMUP_STEPS = 3  # not timed: first-call allocations, DDP's bucket rebuild after step 0


@dataclass
class Config(RunConfig):
    steps: int = 80
    """Optimizer steps to train."""
    precision: tuple[str, ...] = ("bf16", "fp16")
    """Compute dtypes trained beside fp32 (autocast): bf16, fp16 (adds dynamic loss scaling)."""
    global_batch_size: int = 48
    """Samples per step, summed over the ranks (48: any world of 1, 2, 3, 4, 8, 16)."""
    lr: float = 0.02
    """Learning rate of SGD."""
    d_in: int = 16
    """Input features of the MLP."""
    d_hidden: int = 64
    """Hidden width of the MLP."""
    init_scale: float = 2.0**12
    """Initial loss scale of the fp16 scalers (GradScaler's default is 2^16)."""
    growth_interval: int = 2000
    """Clean steps before the fp16 run's loss scale doubles (GradScaler's default)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = sorted(set(self.precision) - {"bf16", "fp16"})
        if unknown or not self.precision:
            raise ValueError(f"--precision takes bf16 and/or fp16 (fp32 always runs), got {unknown}")
        if self.global_batch_size < 1 or self.lr <= 0:
            raise ValueError("--global-batch-size must be at least 1 and --lr positive")
        if self.init_scale <= 0 or self.growth_interval < 1:
            raise ValueError("--init-scale must be positive and --growth-interval at least 1")
        if self.steps <= WARMUP_STEPS:
            raise ValueError(f"--steps must be more than {WARMUP_STEPS} (warm-up, not timed)")


def validate(cfg: Config, world_size: int) -> None:
    """The global batch must split over the ranks."""
    check_global_batch(cfg.global_batch_size, world_size)


def autocast(precision: str, device: torch.device, enabled: bool = True):
    """The forward pass under autocast in the low dtype: matmuls run in bf16/fp16 while the
    parameters (the master weights) stay fp32. fp32: no autocast at all. `enabled=False` is the
    broken variant "autocast silently off" the tests must catch."""
    if LOW[precision] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=LOW[precision], enabled=enabled)


def reduce_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce in `state["dtype"]`, the reduce dtype: torch's bf16/fp16 compress hooks
    (cast, divide by the world size, all-reduce, cast back) or its plain fp32 all-reduce."""
    if state["dtype"] == torch.bfloat16:
        return default_hooks.bf16_compress_hook(None, bucket)
    if state["dtype"] == torch.float16:
        return default_hooks.fp16_compress_hook(None, bucket)
    return default_hooks.allreduce_hook(None, bucket)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size)[rank]


def train_ddp(model: nn.Module, X, Y, cfg: Config, info, precision: str,
              master_weights: bool = True, autocast_enabled: bool = True) -> dict:
    """DDP + autocast(precision); gradients reduced in the compute dtype through a comm hook;
    fp16 scales the loss with the hand-written dynamic scaler. `master_weights=False` is the
    broken variant: the parameters themselves are stored (and updated) in the low dtype.
    Returns the loss curve, the step-0 output, the skipped steps, the dtypes and bytes that
    reached the all-reduce (per step), the update counts and the step times after warm-up."""
    if not master_weights:
        model, X = model.to(LOW[precision]), X.to(LOW[precision])
    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    ddp.register_comm_hook({"dtype": LOW[precision] or torch.float32}, reduce_hook)
    params = list(ddp.parameters())
    opt = torch.optim.SGD(params, lr=cfg.lr)
    scaler = DynamicLossScaler(cfg.init_scale, growth_interval=cfg.growth_interval)
    out = {"losses": [], "skipped": [], "sent": [], "dtypes": set(), "step_ms": [],
           "updates": dict.fromkeys(UPDATE_COUNTS, 0)}
    for step in range(cfg.steps):
        with WireTap() as tap, Timer(info.device) as timer:  # the tap's set-up is not timed
            opt.zero_grad()
            with autocast(precision, info.device, autocast_enabled):
                y = ddp(shard(X[step], info.rank, info.world_size))
            loss = F.mse_loss(y.float(), shard(Y[step], info.rank, info.world_size))
            before = [p.detach().clone() for p in params]
            if precision == "fp16":
                scaler.scale_loss(loss).backward()
                skipped = scaler.step(opt)  # every rank sees the same all-reduced grads: same decision
            else:
                loss.backward()
                opt.step()
                skipped = False
        if step == 0:
            out["first_output"] = y.detach().float()
        if step >= WARMUP_STEPS:
            out["step_ms"].append(1e3 * timer.elapsed)
        if skipped:
            out["skipped"].append(step)
        else:
            for k, v in count_updates(before, params, cfg.lr, LOW[precision] or torch.float32).items():
                out["updates"][k] += v
        out["sent"].append(tap.nbytes("all_reduce"))
        out["dtypes"] |= set(tap.dtypes("all_reduce"))
        out["losses"].append(reduce_number(loss.detach(), "sum") / info.world_size)
    out["dtypes"] = sorted(out["dtypes"])
    return out


def train_fsdp(model: nn.Module, X, Y, cfg: Config, info, param_dtype=None,
               reduce_dtype=None) -> dict:
    """FSDP2: each linear layer's parameters sharded over the ranks, with
    `MixedPrecisionPolicy(param_dtype, reduce_dtype)` (None: keep fp32). With bf16/fp32 it
    all-gathers the parameters as bf16 for forward/backward, reduce-scatters the gradients in
    fp32 and keeps the sharded fp32 parameters as master weights. Returns the losses, the
    dtypes it used where they matter (see `checks.POLICY`), the bytes reduce-scattered per step and the
    full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for layer in linears:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    seen = {"forward weight": set(), "forward output": set(), "all-gather": set(),
            "reduce-scatter": set()}
    # FSDP2's own pre-forward hook (all-gather, cast) runs first; its post-forward reshards.
    pre = linears[0].register_forward_pre_hook(
        lambda m, a: seen["forward weight"].add(str(m.weight.dtype)))
    post = linears[0].register_forward_hook(
        lambda m, a, out: seen["forward output"].add(str(out.dtype)))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses, reduced, step_ms = [], [], []
    for step in range(cfg.steps):
        with WireTap() as tap, Timer(info.device) as timer:
            opt.zero_grad()
            out = model(shard(X[step], info.rank, info.world_size))
            loss = F.mse_loss(out.float(), shard(Y[step], info.rank, info.world_size))
            loss.backward()
            opt.step()
        if step >= WARMUP_STEPS:
            step_ms.append(1e3 * timer.elapsed)
        seen["all-gather"] |= set(tap.dtypes("all_gather"))
        seen["reduce-scatter"] |= set(tap.dtypes("reduce_scatter"))
        reduced.append(tap.nbytes("reduce_scatter"))
        losses.append(reduce_number(loss.detach(), "sum") / info.world_size)
    pre.remove()
    post.remove()
    seen["stored"] = {str(p.to_local().dtype) for p in model.parameters()}
    full = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    return {"losses": losses, "dtypes": {k: sorted(v) for k, v in seen.items()},
            "reduced": reduced, "step_ms": step_ms, "params": full}


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        checks.record_formats(rec, info.device)

        X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed)
        X = X.view(cfg.steps, -1, cfg.d_in).to(info.device)
        Y = Y.view(cfg.steps, -1, 1).to(info.device)
        model = MLP(cfg.d_in, cfg.d_hidden, 1).to(info.device)  # fp32: the master weights
        shapes = [p.shape for p in model.parameters()]
        n_params = sum(p.numel() for p in model.parameters())
        checks.record_scalers(rec, model, X, Y, cfg, info.device)

        runs = {p: train_ddp(copy.deepcopy(model), X, Y, cfg, info, p)
                for p in ["fp32", *cfg.precision]}
        for step in range(0, cfg.steps):
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                values = {f"loss_{p}": r["losses"][step] for p, r in runs.items()}
                rec.metrics(step, loss=runs[cfg.precision[0]]["losses"][step], lr=cfg.lr, **values)
                log.info("step %3d  %s", step, "  ".join(f"{k} {v:.5f}" for k, v in values.items()))
        checks.record_ddp(rec, cfg, runs, n_params)

        # Master weights: fp32 weights keep the updates that bf16 weights round away.
        pure = None
        if "bf16" in cfg.precision:  # control: no fp32 master copy
            pure = train_ddp(copy.deepcopy(model), X, Y, cfg, info, "bf16", master_weights=False)
        checks.record_master_weights(rec, cfg, runs, pure)
        for name, run in runs.items():
            checks.timing_figure(rec, f"DDP {name}", run["step_ms"])

        if info.backend == "gloo" and info.device.type == "cuda" and info.world_size > 1:
            rec.figure("FSDP2 stage", "n/a: not run under gloo on CUDA (untested; use NCCL)")
        else:
            fsdp32 = train_fsdp(copy.deepcopy(model), X, Y, cfg, info)
            fsdp16 = train_fsdp(copy.deepcopy(model), X, Y, cfg, info, torch.bfloat16, torch.float32)
            checks.record_fsdp(rec, cfg, info.world_size, runs["fp32"], fsdp32, fsdp16, shapes)
            if info.is_main:
                save_checkpoint(rec.out / "final_params.pt", {
                    "fsdp_fp32": fsdp32["params"], "fsdp_bf16": fsdp16["params"],
                    "losses": {p: torch.tensor(r["losses"]) for p, r in runs.items()},
                    "fsdp_losses": {"fp32": torch.tensor(fsdp32["losses"]),
                                    "bf16": torch.tensor(fsdp16["losses"])}})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
