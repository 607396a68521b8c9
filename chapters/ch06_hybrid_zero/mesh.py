"""2D parallelism on a device mesh: FSDP2 (ZeRO-3) across one axis, tensor parallelism across the other.

The ranks are laid out as a dp × tp grid, rank = dp_index · tp + tp_index: ranks in a row (tp
consecutive ranks) split every matrix (Megatron's column then row split, chapter 05), ranks in
a column see different data and shard what the row left them with FSDP2 — ZeRO with TP. A rank
holds 1/(dp·tp) of the model states. The run is checked against single-process Adam: one
process training the whole model on the whole global batch (chapter 03 showed DDP + Adam equals
it), in float64. The mesh needs --tp to divide the world size, so an odd world is refused.

Run:
    torchrun --standalone --nproc_per_node=4 chapters/ch06_hybrid_zero/mesh.py            # 2 x 2 mesh
    torchrun --standalone --nproc_per_node=2 chapters/ch06_hybrid_zero/mesh.py            # 1 x 2 (TP only)
    torchrun --standalone --nproc_per_node=3 chapters/ch06_hybrid_zero/mesh.py  # refused: --tp 2 does not divide 3
    torchrun --standalone --nproc_per_node=8 chapters/ch06_hybrid_zero/mesh.py --tp 4     # 8 GPUs: 2 x 4
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch06_hybrid_zero/mesh.py --tp 8      # TP inside a node, FSDP across nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch06_hybrid_zero/mesh.py --tp 8
"""

import copy
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from chapters.ch06_hybrid_zero.zero import bytes_held
from common.config import RunConfig, check_global_batch, parse_config
from common.data import regression_data
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything


@dataclass
class Config(RunConfig):
    steps: int = 5
    """Optimizer steps to train."""
    tp: int = 2
    """Tensor-parallel degree: ranks per mesh row; the data-parallel degree is world / tp."""
    d_model: int = 16
    """Width of the model (hidden layers are 4x wider); a multiple of tp keeps shards even."""
    global_batch_size: int = 8
    """Samples per step over all data-parallel ranks."""
    lr: float = 1e-2
    """Adam learning rate."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tp < 1 or self.d_model < 1 or self.global_batch_size < 1:
            raise ValueError("--tp, --d-model and --global-batch-size must be at least 1")
        if self.d_model % self.tp:
            raise ValueError(f"--tp {self.tp} must divide --d-model {self.d_model} (TP splits the width)")


def validate(cfg: Config, world_size: int) -> None:
    """The mesh is dp x tp: tp must divide the world, and dp = world / tp the global batch."""
    if world_size % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must divide the world size {world_size} (a dp x tp mesh); "
                         f"use an even number of processes or --tp 1")
    check_global_batch(cfg.global_batch_size, world_size // cfg.tp)


def mesh_groups(world_size: int, tp: int) -> dict[str, list[list[int]]]:
    """Which ranks form each group of a ("dp", "tp") mesh, rank = dp_index * tp + tp_index:
    tp groups are rows of consecutive ranks (put them in one node), dp groups are columns."""
    grid = [list(range(row * tp, (row + 1) * tp)) for row in range(world_size // tp)]
    return {"tp": grid, "dp": [list(col) for col in zip(*grid)]}


def build_model(cfg: Config) -> nn.Sequential:
    """Two feed-forward blocks (Linear up, ReLU, Linear down), float64, the same on every rank."""
    seed_everything(cfg.seed)
    d = cfg.d_model
    return nn.Sequential(MLP(d, 4 * d, d, 2), MLP(d, 4 * d, d, 2)).double()


def tp_plan(model: nn.Sequential) -> dict:
    """Megatron's MLP in every block: column-split the up projection, row-split the down one
    (one all-reduce per block in forward, one in backward)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model)):
        plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    return plan


def parallelize(model: nn.Sequential, mesh) -> nn.Sequential:
    """TP on the mesh's "tp" axis first, then FSDP2 on its "dp" axis, block by block: each
    parameter becomes a 2D DTensor, sharded along dp and (if split) along tp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], tp_plan(model))
    for block in model:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def train(model: nn.Module, X, Y, cfg: Config, dp_rank: int, dp: int):
    """Adam on this data-parallel rank's shard; TP ranks of one row see the same shard."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses = []
    for x, y in zip(X, Y):
        opt.zero_grad()
        loss = F.mse_loss(model(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt


def train_reference(model: nn.Module, X, Y, cfg: Config) -> list[float]:
    """Single-process Adam: one process, the whole global batch, every rank computing it alone
    (chapter 03 checked that DDP + Adam ends where this ends)."""
    return train(model, X, Y, cfg, 0, 1)[0]


def expected_local_bytes(model: nn.Module, dp: int, tp: int) -> int:
    """Parameter bytes one rank holds: column-split weights and biases and row-split weights are
    1/tp of the whole, the row-split bias is whole on every tp rank; FSDP divides all by dp."""
    total = 0
    for name, p in model.named_parameters():
        split = tp if not name.endswith("2.bias") else 1
        total += p.numel() * p.element_size() // split // dp
    return total


def max_diff(model: nn.Module, reference: nn.Module) -> float:
    return max((p.full_tensor() - q).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        dp = info.world_size // cfg.tp
        from torch.distributed.device_mesh import init_device_mesh

        # FSDP2 warns about in-place changes of views of its outputs (our blocks make none), and
        # DTensor logs the two all-gathers that gathering a 2D DTensor for the check takes: both
        # go to the library log (common.log), which the run names at the end.
        rec = RunRecorder(cfg, __file__, info)
        mesh = init_device_mesh(info.device.type, (dp, cfg.tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh["dp"].get_local_rank()
        log.info("mesh %d (dp) x %d (tp) on %s/%s:\n%s", dp, cfg.tp, info.device, info.backend,
                 mesh.mesh.tolist())
        X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_model, cfg.d_model,
                               seed=cfg.seed, dtype=torch.float64)
        X = X.view(cfg.steps, cfg.global_batch_size, -1).to(info.device)
        Y = Y.view(cfg.steps, cfg.global_batch_size, -1).to(info.device)

        reference = build_model(cfg).to(info.device)
        ref_losses = train_reference(reference, X, Y, cfg)
        model = parallelize(copy.deepcopy(build_model(cfg)).to(info.device), mesh)
        losses, opt = train(model, X, Y, cfg, dp_rank, dp)
        for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
            rec.metrics(step, loss=ref, lr=cfg.lr, local_loss=loss)
        groups = mesh_groups(info.world_size, cfg.tp)
        mine = {axis: dist.get_process_group_ranks(mesh[axis].get_group()) for axis in ("dp", "tp")}
        rec.check("this rank's dp, tp groups = mesh_groups", "count",
                  [mine["dp"], mine["tp"]],
                  [next(g for g in groups[a] if info.rank in g) for a in ("dp", "tp")])
        rec.check(f"FSDP2 x TP ({dp}x{cfg.tp}) == single-process Adam (max |dparam|)", "parity",
                  reduce_number(max_diff(model, reference), "max"), 0.0, 1e-10)
        held = bytes_held(model, opt)
        p_bytes = expected_local_bytes(build_model(cfg), dp, cfg.tp)
        n_tensors = len(list(model.parameters()))
        rec.check("bytes [params, grads, optim] per rank = 1/(dp*tp) formula", "formula",
                  [held["params"], held["grads"], held["optim"]],
                  [p_bytes, p_bytes, 2 * p_bytes + 4 * n_tensors])
        if dp > 1:  # negative control: drop FSDP's reduce-scatter of gradients over dp
            broken = parallelize(build_model(cfg).to(info.device), mesh)
            broken.set_requires_gradient_sync(False)
            train(broken, X, Y, cfg, dp_rank, dp)
            diff = reduce_number(max_diff(broken, reference), "max")
            rec.check("negative control: no dp gradient sync differs", "parity", diff, 1e-6,
                      compare=">")
        whole = sum(p.numel() * p.element_size() for p in reference.parameters())
        rec.figure("parameter bytes per rank", held["params"], p_bytes, "bytes")
        rec.figure("whole model's parameter bytes", whole, unit="bytes")
        rec.figure("final loss", ref_losses[-1])
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
