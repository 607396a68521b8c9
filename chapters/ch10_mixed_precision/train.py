"""Mixed precision: compute in bf16 or fp16, keep fp32 master weights, scale the loss so fp16
gradients do not underflow, and reduce gradients in a chosen dtype under DDP and FSDP2.

The script prints the range and precision of fp32/bf16/fp16/fp8 beside their bit-layout
formulas, shows FP8 per-tensor scaling and an fp16 gradient underflow cured by loss scaling,
checks a hand-written dynamic loss scaler against `torch.amp.GradScaler` decision by decision,
then trains the same MLP data-parallel in fp32 and in `--precision`, and with FSDP2 and a
`MixedPrecisionPolicy` (bf16 params for compute, fp32 storage and reduction).

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
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch10_mixed_precision import formats
from chapters.ch10_mixed_precision.loss_scaler import DynamicLossScaler, scaler_trace
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer

LOW = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Final-loss tolerance against fp32, relative (justified in the lesson): a few units of each
# format's rounding error eps/2, accumulated over a short run of a well-conditioned problem.
LOSS_TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}
TRACE_GROWTH_INTERVAL = 3  # the scaler trace grows the scale often, to show every decision


@dataclass
class Config(RunConfig):
    steps: int = 30
    """Optimizer steps to train."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Compute dtype of the mixed-precision run (autocast); fp16 adds dynamic loss scaling."""
    global_batch_size: int = 64
    """Samples per step, summed over the ranks."""
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
        if self.global_batch_size < 1 or self.lr <= 0:
            raise ValueError("--global-batch-size must be at least 1 and --lr positive")
        if self.init_scale <= 0 or self.growth_interval < 1:
            raise ValueError("--init-scale must be positive and --growth-interval at least 1")


def autocast(precision: str, device: torch.device):
    """The forward pass under autocast in the low dtype: matmuls run in bf16/fp16 while the
    parameters (the master weights) stay fp32. fp32: no autocast at all."""
    if LOW[precision] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=LOW[precision])


def counting_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce in `state["dtype"]` (the reduce dtype), counting the bytes sent."""
    buf = bucket.buffer()
    state["bytes"] += buf.numel() * torch.finfo(state["dtype"]).bits // 8
    if state["dtype"] == torch.bfloat16:
        return default_hooks.bf16_compress_hook(None, bucket)
    if state["dtype"] == torch.float16:
        return default_hooks.fp16_compress_hook(None, bucket)
    return default_hooks.allreduce_hook(None, bucket)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size)[rank]


def train_ddp(model: nn.Module, X, Y, cfg: Config, info, precision: str,
              master_weights: bool = True) -> dict:
    """DDP + autocast(precision); gradients reduced in the compute dtype through a comm hook;
    fp16 scales the loss with the hand-written dynamic scaler. `master_weights=False` is the
    broken variant: the parameters themselves are stored (and updated) in the low dtype."""
    if not master_weights:
        model, X = model.to(LOW[precision]), X.to(LOW[precision])
    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    hook = {"bytes": 0, "dtype": LOW[precision] or torch.float32}
    ddp.register_comm_hook(hook, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
    scaler = DynamicLossScaler(cfg.init_scale, growth_interval=cfg.growth_interval)
    losses, skipped = [], []
    for step in range(cfg.steps):
        opt.zero_grad()
        with autocast(precision, info.device):
            out = ddp(shard(X[step], info.rank, info.world_size))
        loss = F.mse_loss(out.float(), shard(Y[step], info.rank, info.world_size))
        if precision == "fp16":
            scaler.scale_loss(loss).backward()
            if scaler.step(opt):  # every rank sees the same all-reduced grads: same decision
                skipped.append(step)
        else:
            loss.backward()
            opt.step()
        losses.append(global_mean(loss.detach()))
    return {"losses": losses, "skipped": skipped, "bytes": hook["bytes"], "dtype_bytes":
            torch.finfo(hook["dtype"]).bits // 8}


def global_mean(x: torch.Tensor) -> float:
    x = x.clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def train_fsdp(model: nn.Module, X, Y, cfg: Config, info, mixed: bool) -> dict:
    """FSDP2: each layer's parameters sharded over the ranks. With `mixed`, a
    MixedPrecisionPolicy all-gathers them as bf16 for forward/backward, reduce-scatters the
    gradients in fp32 and keeps the sharded fp32 parameters as master weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed else MixedPrecisionPolicy()
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for layer in linears:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    seen = {"weight": set(), "output": set()}  # dtypes the forward really used
    # FSDP2's own pre-forward hook (all-gather, cast) runs first; its post-forward reshards.
    pre = linears[0].register_forward_pre_hook(lambda m, a: seen["weight"].add(str(m.weight.dtype)))
    post = linears[0].register_forward_hook(lambda m, a, out: seen["output"].add(str(out.dtype)))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        opt.zero_grad()
        out = model(shard(X[step], info.rank, info.world_size))
        loss = F.mse_loss(out.float(), shard(Y[step], info.rank, info.world_size))
        loss.backward()
        opt.step()
        losses.append(global_mean(loss.detach()))
    pre.remove()
    post.remove()
    stored = sorted({str(p.to_local().dtype) for p in model.parameters()})
    full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return {"losses": losses, "stored": stored, "seen": {k: sorted(v) for k, v in seen.items()},
            "params": full}


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def curve_gap(losses: list[float], reference: list[float]) -> float:
    """The largest relative gap between two loss curves, step by step."""
    return max(rel(a, b) for a, b in zip(losses, reference))


def record_formats(rec: RunRecorder, device: torch.device) -> None:
    """Range/precision table, FP8 per-tensor scaling, fp16 underflow with and without scaling."""
    mismatches = 0
    for row in formats.format_table():
        for key in ("max", "eps", "tiny"):
            rec.figure(f"{row['name']} {key}", row[key], expected=row["formula"][key])
            mismatches += row[key] != row["formula"][key]
    rec.check("torch.finfo == bit-layout formula (5 formats x max, eps, tiny)", "count", mismatches, 0)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-4  # gradient-sized
    raw = formats.fp8_roundtrip_error(x, torch.float8_e4m3fn, per_tensor_scale=False)
    scaled = formats.fp8_roundtrip_error(x, torch.float8_e4m3fn, per_tensor_scale=True)
    rec.figure("e4m3 round trip rel. error, unscaled", raw["rel_error"])
    rec.figure("e4m3 round trip rel. error, per-tensor scale", scaled["rel_error"],
               expected=torch.finfo(torch.float8_e4m3fn).eps / 4, unit="~eps/4")
    rec.check("e4m3 per-tensor scaling: rel. error < eps/2", "formula", scaled["rel_error"],
              torch.finfo(torch.float8_e4m3fn).eps / 2, compare="<")
    ref = formats.underflow_grads(1.0, device, half=False)
    plain = formats.underflow_grads(1.0, device)
    scaled_g = formats.underflow_grads(2.0**16, device)
    rec.check("fp16 grads flushed to zero, no loss scaling", "count",
              int((plain == 0).sum()), ref.numel())
    rec.check("fp16 grads flushed to zero, loss scale 2^16", "count", int((scaled_g == 0).sum()), 0)
    rec.check("scaled fp16 grad == fp32 grad (rel. norm)", "parity",
              ((scaled_g - ref).norm() / ref.norm()).item(), 0.0, 5e-3)


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        if cfg.global_batch_size % info.world_size:
            raise SystemExit(f"error: --global-batch-size {cfg.global_batch_size} must divide "
                             f"into {info.world_size} ranks")
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        record_formats(rec, info.device)

        X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed)
        X = X.view(cfg.steps, -1, cfg.d_in).to(info.device)
        Y = Y.view(cfg.steps, -1, 1).to(info.device)
        model = MLP(cfg.d_in, cfg.d_hidden, 1).to(info.device)  # fp32: the master weights

        inf_steps = {5, 6, 12}  # injected overflows: both scalers must back off and skip there
        hand_scaler = DynamicLossScaler(cfg.init_scale, growth_interval=TRACE_GROWTH_INTERVAL)
        torch_scaler = torch.amp.GradScaler(info.device.type, init_scale=cfg.init_scale,
                                            growth_interval=TRACE_GROWTH_INTERVAL)
        hand = scaler_trace(model, X, Y, hand_scaler, inf_steps)
        ref = scaler_trace(model, X, Y, torch_scaler, inf_steps)
        rec.check("hand scaler == GradScaler: scale at every step", "count",
                  sum(a != b for a, b in zip(hand["scales"], ref["scales"])), 0)
        rec.check("hand scaler == GradScaler: skipped steps", "count", hand["skipped"], ref["skipped"])
        rec.figure("skipped steps (injected inf at 5, 6, 12)", hand["skipped"])

        timers, runs = {}, {}
        for precision in dict.fromkeys(["fp32", cfg.precision]):
            with Timer(info.device) as timers[precision]:
                runs[precision] = train_ddp(copy.deepcopy(model), X, Y, cfg, info, precision)
        for step in range(0, cfg.steps):
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                values = {f"loss_{p}": r["losses"][step] for p, r in runs.items()}
                rec.metrics(step, loss=runs[cfg.precision]["losses"][step], lr=cfg.lr, **values)
                log.info("step %3d  %s", step, "  ".join(f"{k} {v:.5f}" for k, v in values.items()))
        fp32, low = runs["fp32"]["losses"][-1], runs[cfg.precision]["losses"][-1]
        rec.check(f"DDP {cfg.precision} loss curve == fp32 (max rel. gap)", "parity",
                  curve_gap(runs[cfg.precision]["losses"], runs["fp32"]["losses"]), 0.0,
                  LOSS_TOL[cfg.precision])
        if cfg.precision == "bf16" and cfg.steps >= 20:  # control: no fp32 master copy (it
            # drifts as updates smaller than half a bf16 ulp of the weight are rounded away)
            pure = train_ddp(copy.deepcopy(model), X, Y, cfg, info, "bf16", master_weights=False)
            gap = curve_gap(pure["losses"], runs["fp32"]["losses"])
            rec.check("control: bf16 weights without fp32 master copy rejected", "parity", gap,
                      LOSS_TOL["bf16"], compare=">")
        n_params = sum(p.numel() for p in model.parameters())
        mixed = runs[cfg.precision]
        rec.check(f"DDP bytes reduced in {cfg.precision} = steps x params x bytes", "formula",
                  mixed["bytes"], cfg.steps * n_params * mixed["dtype_bytes"])
        if cfg.precision == "fp16":
            rec.figure("DDP fp16 skipped steps", mixed["skipped"])

        fsdp32 = train_fsdp(copy.deepcopy(model), X, Y, cfg, info, mixed=False)
        with Timer(info.device) as timers["FSDP2 bf16"]:
            fsdp16 = train_fsdp(copy.deepcopy(model), X, Y, cfg, info, mixed=True)
        rec.check("FSDP2 fp32 final loss == DDP fp32 (rel.)", "parity",
                  rel(fsdp32["losses"][-1], fp32), 0.0, LOSS_TOL["fp32"])
        rec.check("FSDP2 bf16 policy final loss == fp32 (rel.)", "parity",
                  rel(fsdp16["losses"][-1], fsdp32["losses"][-1]), 0.0, LOSS_TOL["bf16"])
        rec.check("FSDP2 bf16: stored parameter dtypes", "count", fsdp16["stored"], ["torch.float32"])
        rec.check("FSDP2 bf16: forward weight/output dtypes", "count",
                  fsdp16["seen"]["weight"] + fsdp16["seen"]["output"], ["torch.bfloat16"] * 2)

        rec.figure("final loss fp32", fp32)
        rec.figure(f"final loss {cfg.precision}", low)
        for name, t in timers.items():
            rec.figure(f"time per step {name}", t.elapsed / cfg.steps * 1e3, unit="ms")
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt", {
                "fsdp_fp32": fsdp32["params"], "fsdp_bf16": fsdp16["params"],
                "losses": {p: torch.tensor(r["losses"]) for p, r in runs.items()},
                "fsdp_losses": {"fp32": torch.tensor(fsdp32["losses"]), "bf16": torch.tensor(fsdp16["losses"])}})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
