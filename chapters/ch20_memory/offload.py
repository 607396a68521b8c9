"""CPU offload: keep optimizer state (and parameters) in host memory, train the same model.

ZeRO-Offload keeps the optimizer's master weights and Adam moments on the host and runs the
optimizer step there; FSDP2's CPUOffloadPolicy keeps the parameter shards, their gradients and
so the optimizer state on the host too. This script trains the same model on device, with a
hand-written optimizer offload and with FSDP2 with and without CPU offload, checks the trained
parameters agree, counts the bytes the hand offload copies each way per step where they are
copied (`CopyTap`, a TorchDispatchMode that sees every copy operation), checks every tensor sits
where its policy says (on a GPU) and records the per-rank memory formula. On a machine without
CUDA host and device are the same memory: nothing moves.

Run:
    python chapters/ch20_memory/offload.py                                      # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch20_memory/offload.py
    torchrun --standalone --nproc_per_node=8 chapters/ch20_memory/offload.py \\
        --d-model 1024 --d-ff 4096 --tokens 4096 --dtype float32               # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch20_memory/offload.py                                         # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch20_memory/offload.py  # Slurm
"""

import copy
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from chapters.ch03_data_parallel.data_parallel import all_reduce_gradients
from chapters.ch20_memory.copytap import CopyTap, nbytes, working_tensors
from chapters.ch20_memory.data_shard import rank_rows, regression_shard
from chapters.ch20_memory.recompute import ResidualMLP
from chapters.ch20_memory.train import max_diff
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything

DTYPES = {"float64": torch.float64, "float32": torch.float32}
HOST = torch.device("cpu")


@dataclass
class Config(RunConfig):
    steps: int = 5
    """Adam steps per training variant."""
    d_model: int = 32
    """Width of the residual stream."""
    d_ff: int = 128
    """Hidden width of each feed-forward block."""
    n_layers: int = 4
    """Number of feed-forward blocks (FSDP2 shards each one as a unit)."""
    tokens: int = 64
    """Tokens per rank per step."""
    lr: float = 1e-2
    """Learning rate of Adam."""
    dtype: str = "float64"
    """float64 makes the parity checks exact; float32 works the same way."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        require_at_least_one(self, "d_model", "d_ff", "n_layers", "tokens")


def train_on_device(model, X, Y, cfg: Config, info):
    """The reference: data parallel (chapter 03's all-reduce) with Adam on the device."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        opt.zero_grad()
        F.mse_loss(model(X[step]), Y[step]).backward()  # X[step]: this rank's rows
        all_reduce_gradients(model, info.world_size)
        opt.step()
    return model, opt


def train_zero_offload(model, X, Y, cfg: Config, info, copy_back: bool = True):
    """ZeRO-Offload by hand: the device keeps the weights only; master weights, gradients and
    Adam moments live on the host. Each step copies the gradients device→host (and drops them
    from the device), steps there, copies the weights host→device. Returns the model and the
    host optimizer; what was copied is counted outside, by `CopyTap`."""
    master = [p.detach().to(HOST, copy=True) for p in model.parameters()]  # copy: even on CPU
    opt = torch.optim.Adam(master, lr=cfg.lr)
    for step in range(cfg.steps):
        model.zero_grad()
        F.mse_loss(model(X[step]), Y[step]).backward()  # X[step]: this rank's rows
        all_reduce_gradients(model, info.world_size)
        for p, m in zip(model.parameters(), master):
            m.grad = p.grad.to(HOST, copy=True)
            p.grad = None  # the device keeps the weights only (ZeRO-Offload's layout)
        opt.step()
        if copy_back:  # the negative control forgets this: the device model never learns
            with torch.no_grad():
                for p, m in zip(model.parameters(), master):
                    p.copy_(m)
    return model, opt


def shard_model(model, info, offload: bool):
    """FSDP2: each block is one unit (all-gathered for its forward/backward), then the root.
    Offloaded shards live in pinned host memory on CUDA (asynchronous copies); pinning needs
    CUDA, so a CPU run cannot pin."""
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    pin = info.device.type == "cuda"
    policy = CPUOffloadPolicy(pin_memory=pin) if offload else OffloadPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    return fully_shard(model, mesh=mesh, offload_policy=policy)


def train_fsdp(model, X, Y, cfg: Config, info):
    """FSDP2 training; the input goes to the compute device even when parameters are on the host."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        opt.zero_grad()
        F.mse_loss(model(X[step]), Y[step]).backward()  # X[step]: this rank's rows
        opt.step()
    return model, opt


def full_params(model) -> list[torch.Tensor]:
    """Whole parameters on every rank (FSDP2's are DTensors: all-gather them). An offloaded
    shard lives on the host while its mesh is on the GPU, and NCCL gathers device tensors only:
    move it to the mesh's device first, as torch's own state-dict gathering does."""
    full = []
    for p in model.parameters():
        p = p.detach()
        if hasattr(p, "full_tensor"):
            p = p.to(p.device_mesh.device_type).full_tensor()
        full.append(p.cpu())
    return full


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def training_state(model, opt) -> list[torch.Tensor]:
    """This rank's persistent training state: parameters, gradients, Adam's two moments."""
    params = [local(p) for p in opt.param_groups[0]["params"]]
    grads = [local(p.grad) for p in opt.param_groups[0]["params"]]
    moments = [local(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return params + grads + moments


def misplaced(tensors: list[torch.Tensor], device_type: str) -> int:
    return sum(t.device.type != device_type for t in tensors)


def per_rank_bytes(psi: int, elem: int, world: int) -> dict[str, tuple[int, int]]:
    """(device, host) bytes per rank of parameters, gradients and Adam's two moments (4Ψ
    elements of `elem` bytes). FSDP2 also all-gathers one unit at a time on the device."""
    full = 4 * psi * elem
    return {"DDP on device": (full, 0),
            "ZeRO-Offload by hand": (psi * elem, full),  # device: the weights; host: all 4
            "FSDP2 on device": (full // world, 0),
            "FSDP2 + CPUOffloadPolicy": (0, full // world)}


def shared_storage(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """How many tensors of `a` share their memory with the matching tensor of `b` (a "copy"
    that is not one)."""
    return sum(p.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() for p, q in zip(a, b))


def record_hand_offload(rec, tap: CopyTap, hand, hand_opt, model_bytes: int, steps: int,
                        dev: str, cuda_held: int) -> None:
    """ZeRO-Offload's traffic as the copy operations counted it: the master weights host-ward
    once, then each step the gradients down and the updated weights back, Ψ·b bytes each way;
    and what each side holds after training, read from the tensors (the device: the weights
    only; the host: master weights, gradients, 2 moments)."""
    rec.check("hand offload: bytes copied to host = (steps + 1) x params x bytes", "formula",
              tap.nbytes("to host"), (steps + 1) * model_bytes)
    rec.check("hand offload: bytes copied to device = steps x params x bytes", "formula",
              tap.nbytes("to device"), steps * model_bytes)
    rec.check("hand offload: bytes the device model holds = params x bytes (no grads)", "formula",
              nbytes(working_tensors(hand)()), model_bytes)
    rec.check("hand offload: bytes of host state = 4 x params x bytes", "formula",
              nbytes(training_state(hand, hand_opt)), 4 * model_bytes)
    if dev == "cuda":  # a copy that stays on one device moved nothing over PCIe
        rec.check("hand offload: copies that did not cross host<->device", "count",
                  sum(c.src == c.dst for c in tap.copies), 0)
        rec.figure("hand offload: CUDA bytes allocated by the trained model (allocator)",
                   cuda_held, model_bytes, unit="bytes")  # plus the allocator's block rounding
    else:
        rec.figure("hand offload: copies that did not cross host<->device", "n/a on CPU")


def validate(cfg: Config, world_size: int) -> None:
    """Nothing here depends on the world size: --tokens is per rank, and FSDP2 pads uneven shards."""


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        return run(cfg, info)
    finally:
        teardown_distributed()


def run(cfg: Config, info) -> int:
    """Train on device, with the hand offload, with FSDP2 and with FSDP2 + CPU offload; check."""
    setup_logging(info.rank, info.world_size)
    rec = RunRecorder(cfg, __file__, info)
    seed_everything(cfg.seed)
    dtype, n = DTYPES[cfg.dtype], cfg.tokens * info.world_size
    base = ResidualMLP(cfg.d_model, cfg.d_ff, cfg.n_layers).to(info.device, dtype)
    # this rank's rows of every step only (data_shard.regression_shard, as in train.py: the same
    # numbers as the whole data's chunk(world)[rank], without building the other ranks' rows)
    rows = rank_rows(cfg.steps, cfg.tokens, info.rank, info.world_size)
    X, Y = regression_shard(cfg.steps * n, cfg.d_model, cfg.d_model, rows, seed=cfg.seed, dtype=dtype)
    shape = (cfg.steps, cfg.tokens, cfg.d_model)
    X, Y = X.view(shape).to(info.device), Y.view(shape).to(info.device)
    log.info("world %d on %s/%s, host %s: %d blocks %dx%d, Adam, %d steps", info.world_size,
             info.device, info.backend, HOST, cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.steps)
    if info.device == HOST:
        log.info("device and host are the same memory here: offload moves nothing; the checks")
        log.info("below test the bookkeeping and the numbers, the savings are GPU figures")

    ref, ref_opt = train_on_device(copy.deepcopy(base), X, Y, cfg, info)
    cuda_before = torch.cuda.memory_allocated() if info.device.type == "cuda" else 0
    hand = copy.deepcopy(base)
    with CopyTap(working_tensors(hand)) as tap:  # counts the copies where they happen
        hand, hand_opt = train_zero_offload(hand, X, Y, cfg, info)
    cuda_held = torch.cuda.memory_allocated() - cuda_before if info.device.type == "cuda" else 0
    fsdp, fsdp_opt = train_fsdp(shard_model(copy.deepcopy(base), info, False), X, Y, cfg, info)
    off, off_opt = train_fsdp(shard_model(copy.deepcopy(base), info, True), X, Y, cfg, info)

    # Parity: the same arithmetic in another place or order. Adam on the host and on a GPU
    # may round differently, FSDP2 reduce-scatters where DDP all-reduces (another order of
    # the same sums): a few ulps per step, and Adam divides by sqrt(v), which magnifies the
    # rounding of small gradient elements. 1e-12 in float64, 1e-5 in float32 (the lesson).
    tol = 1e-12 if cfg.dtype == "float64" else 1e-5
    reference, dev = full_params(ref), info.device.type
    rec.check("ZeRO-Offload by hand == on device (max |dparam|)", "parity",
              max_diff(full_params(hand), reference), 0.0, tol)
    rec.check("FSDP2 on device == DDP on device (max |dparam|)", "parity",
              max_diff(full_params(fsdp), reference), 0.0, tol)
    rec.check("FSDP2 + CPU offload == FSDP2 on device (max |dparam|)", "parity",
              max_diff(full_params(off), full_params(fsdp)), 0.0, tol)
    # A host copy must be a copy, even where host and device are the same memory.
    rec.check("hand offload: master weights sharing the working weights' memory", "count",
              shared_storage(hand_opt.param_groups[0]["params"], list(hand.parameters())), 0)

    placements = {
        "hand offload: master weights, grads, Adam state not on host":
            misplaced(training_state(hand, hand_opt), HOST.type),
        "hand offload: working weights not on device": misplaced(list(hand.parameters()), dev),
        "FSDP2 on device: state not on device": misplaced(training_state(fsdp, fsdp_opt), dev),
        "FSDP2 + offload: params, grads, Adam state not on host":
            misplaced(training_state(off, off_opt), HOST.type),
    }
    for name, count in placements.items():
        if info.device == HOST:  # host and device are one memory: every count is 0 by itself
            rec.figure(name, "n/a on CPU")
        else:
            rec.check(name, "count", count, 0)
    # Pinned (page-locked) host memory lets the GPU copy shards asynchronously; only CUDA pins.
    if dev == "cuda":
        shards = [local(p) for p in off_opt.param_groups[0]["params"]]
        rec.check("FSDP2 + offload: parameter shards not pinned", "count",
                  sum(not t.is_pinned() for t in shards), 0)
    else:
        rec.figure("FSDP2 + offload: parameter shards not pinned", "n/a on CPU")

    psi, elem = sum(p.numel() for p in base.parameters()), torch.finfo(dtype).bits // 8
    record_hand_offload(rec, tap, hand, hand_opt, psi * elem, cfg.steps, dev, cuda_held)
    state = training_state(off, off_opt)
    held = sum(t.numel() * t.element_size() for t in state)  # what this rank holds
    rec.figure("FSDP2 + offload: state bytes, this rank", held,
               4 * psi * elem / info.world_size, unit="bytes")
    rec.check("FSDP2 + offload: state bytes summed over ranks = 4 x params x bytes", "formula",
              reduce_number(held), 4 * psi * elem)
    for name, (device_bytes, host_bytes) in per_rank_bytes(psi, elem, info.world_size).items():
        rec.figure(f"formula: per rank on device, {name}", "-", device_bytes, unit="bytes")
        rec.figure(f"formula: per rank on host, {name}", "-", host_bytes, unit="bytes")
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
