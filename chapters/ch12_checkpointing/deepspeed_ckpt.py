"""A DeepSpeed ZeRO checkpoint: the files `engine.save_checkpoint` writes, and back to a plain state dict.

Each ZeRO stage trains a tiny MLP a few steps, saves with `engine.save_checkpoint(dir, tag)`,
lists the files (one model file, one optimizer partition per rank; ZeRO-3 one model file per rank)
and converts them with DeepSpeed's own `zero_to_fp32` on rank 0: the plain state dict must equal
the engine's whole parameters at save time, and differ from the initial ones (negative control).
DeepSpeed loads its files with `torch.load(weights_only=False)`, which runs whatever a pickle
says (its optimizer partitions hold DeepSpeed objects that `weights_only=True` refuses): the one
place this course lets a loader un-pickle, and only files this run wrote and then verified (a
SHA-256 manifest written right after the save, checked with the run id and shapes before
DeepSpeed reads anything, and no file in the folder outside it).
Needs `pip install deepspeed==0.19.8` (CPU works; the first run compiles a small op, then cached).

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch12_checkpointing/deepspeed_ckpt.py
    torchrun --standalone --nproc_per_node=3 chapters/ch12_checkpointing/deepspeed_ckpt.py --stages 3
    torchrun --standalone --nproc_per_node=8 chapters/ch12_checkpointing/deepspeed_ckpt.py --d-hidden 4096  # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch12_checkpointing/deepspeed_ckpt.py --out /shared/fs/ch12ds   # --out on a shared file system
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch12_checkpointing/deepspeed_ckpt.py --out /shared/fs/ch12ds
"""

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.checkpoint import (
    MANIFEST,
    CheckpointError,
    check_identity,
    file_entry,
    load_checkpoint,
    run_id,
    save_checkpoint,
    training_shapes,
    verify_manifest,
    write_manifest,
)
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import init_deepspeed, library_output, log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything


@dataclass
class Config(RunConfig):
    steps: int = 3
    """Training steps before the save."""
    stages: list[int] = field(default_factory=lambda: [2, 3])
    """DeepSpeed ZeRO stages to save and convert, one after another (zero_to_fp32 reads 1, 2 and 3)."""
    d_in: int = 16
    """Input features of the MLP."""
    d_hidden: int = 33
    """Hidden width of the MLP (odd: the flat partitions are uneven and padded)."""
    batch_size: int = 8
    """Samples per step, on every rank."""
    lr: float = 1e-2
    """Adam learning rate."""
    tag: str = "step3"
    """Checkpoint tag: the sub-folder of the save directory (DeepSpeed's default is global_step<N>)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.stages or any(s not in (1, 2, 3) for s in self.stages):
            raise ValueError(f"--stages must be among 1 2 3, got {self.stages}")
        if not self.tag or "/" in self.tag:
            raise ValueError("--tag must be a non-empty folder name without '/'")


def validate(cfg: Config, world_size: int) -> None:
    """Nothing depends on the world size: the micro-batch is per rank and ZeRO pads its flat
    partitions to any number of ranks."""


def ds_config(stage: int, micro_batch_size: int) -> dict:
    """DeepSpeed's JSON config (as in chapter 06): float32, no clipping, our torch optimizer."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips to norm 1.0 unless told otherwise
        "zero_optimization": {"stage": stage, "overlap_comm": False},
        "zero_allow_untested_optimizer": True,  # torch.optim.Adam: cpu_adam is not built
        "steps_per_print": 10**9,
    }


def whole_parameters(engine, stage: int) -> dict:
    """The engine's full parameters on every rank (ZeRO-3 gathers its shards; a collective)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}


def train_engine(stage: int, cfg: Config, info):
    """A fresh engine trained cfg.steps steps on this rank's shard; return it, the initial params
    and the training shapes (taken before DeepSpeed partitions the parameters)."""
    import deepspeed

    seed_everything(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1).to(info.device)
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    shapes = training_shapes(model, opt)
    with library_output():  # DeepSpeed prints its whole configuration here
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, cfg.batch_size))
    X, Y = regression_data(cfg.batch_size * info.world_size * cfg.steps, cfg.d_in, 1, seed=cfg.seed,
                           dtype=torch.float32)
    for x, y in zip(X.chunk(cfg.steps), Y.chunk(cfg.steps)):
        x, y = x.chunk(info.world_size)[info.rank], y.chunk(info.world_size)[info.rank]
        loss = F.mse_loss(engine(x.to(info.device)), y.to(info.device))
        engine.backward(loss)  # ZeRO reduce-scatters the gradients
        engine.step()          # each rank updates its partition of the fp32 master weights
    return engine, initial, shapes


def list_checkpoint(save_dir: Path) -> list[str]:
    """Every file under the save directory, relative to it (what you would copy or upload)."""
    return sorted(str(p.relative_to(save_dir)) for p in save_dir.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def commit_manifest(save_dir: Path, **meta) -> None:
    """Collective, right after `engine.save_checkpoint` and a barrier: the ranks share the hashing
    of every file in `save_dir`, global rank 0 writes `manifest.json` last, with `meta` (run id,
    shapes). Which rank wrote which file is DeepSpeed's business; each file is hashed once. Every
    file present is trusted as this save's: the caller empties `save_dir` before the save (a
    stale `zero_pp_rank_2_...` of an earlier 4-rank run would otherwise be hashed in, verify,
    and be un-pickled by DeepSpeed)."""
    files, rank, world = list_checkpoint(save_dir), dist.get_rank(), dist.get_world_size()
    mine = {name: file_entry(save_dir / name) for name in files[rank::world]}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        write_manifest(save_dir, {k: v for part in everyone for k, v in part.items()}, **meta)
    dist.barrier()  # nobody reads it back before it exists


def verify_written(save_dir: Path, rid: str, shapes: dict) -> None:
    """What must hold before DeepSpeed un-pickles anything in `save_dir`: every file matches the
    manifest this run wrote (SHA-256), the manifest is this run's (run id, shapes), and no file in
    the folder is outside it (DeepSpeed's loaders glob for `*_model_states.pt` and
    `*_optim_states.pt`: a file dropped in later would be un-pickled too)."""
    manifest = verify_manifest(save_dir)
    check_identity(manifest, rid, shapes, save_dir)
    extra = sorted(set(list_checkpoint(save_dir)) - set(manifest["files"]))
    if extra:
        raise CheckpointError(f"{save_dir / extra[0]} is not in the folder's {MANIFEST}: "
                              f"refusing to let DeepSpeed un-pickle it")


def convert(save_dir: Path, tag: str, rid: str, shapes: dict) -> dict:
    """DeepSpeed's own conversion: concatenate the partitions into one plain fp32 state dict.
    It un-pickles every file with `torch.load(..., weights_only=False)` (deepspeed/utils/
    zero_to_fp32.py; `engine.load_checkpoint` too, through TorchCheckpointEngine.load): the
    optimizer partitions hold DeepSpeed's own objects (a LossScaler under ZeRO-2, a ZeroStageEnum
    under ZeRO-3, DeepSpeed 0.19.8), which `weights_only=True` refuses. The one exception this
    course makes, and only for files this run wrote and verified first (`verify_written`): a
    manifest proves the bytes are the ones this run wrote, not that a stranger's are harmless."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    verify_written(save_dir, rid, shapes)
    return get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag)


def module_numel(save_dir: Path, tag: str) -> int:
    """Elements of the weights in rank 0's model file: whole under ZeRO-1/2, empty placeholders
    under ZeRO-3. The model file holds tensors, dicts and sizes only: `load_checkpoint` (its zip
    CRCs, then `weights_only=True`) reads it; no exception needed here."""
    name = "mp_rank_00_model_states.pt"
    path = save_dir / tag / name if (save_dir / tag / name).exists() else save_dir / tag / f"zero_pp_rank_0_{name}"
    return sum(t.numel() for t in load_checkpoint(path)["module"].values())


def max_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over matching tensors (inf if the names differ)."""
    if set(a) != set(b):
        return float("inf")
    return max((a[n].double() - b[n].double()).abs().max().item() for n in a)


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        init_deepspeed(info)  # its start-up noise goes to the library log
        rec = RunRecorder(cfg, __file__, info)
        rid = run_id(rec.out)
        for stage in cfg.stages:
            engine, initial, shapes = train_engine(stage, cfg, info)
            saved = whole_parameters(engine, stage)        # what the checkpoint must hold
            save_dir = rec.out / f"zero{stage}"
            if info.is_main:  # a reused --out: files of an earlier save (another world, another
                shutil.rmtree(save_dir, ignore_errors=True)  # tag) must not enter the manifest
            dist.barrier()  # gone before any rank writes (--out on a file system every rank sees)
            with library_output():  # DeepSpeed logs each file it writes
                engine.save_checkpoint(str(save_dir), tag=cfg.tag)  # a collective: every rank writes
            dist.barrier()                                  # all partitions on disk before hashing
            commit_manifest(save_dir, run_id=rid, shapes=shapes, tag=cfg.tag)
            files = list_checkpoint(save_dir)
            log.info("ZeRO-%d checkpoint %s:\n  %s", stage, save_dir, "\n  ".join(files))
            rec.figure(f"ZeRO-{stage} files", files)
            optim = [f for f in files if f.endswith("optim_states.pt")]
            rec.check(f"ZeRO-{stage}: one optimizer partition file per rank", "count",
                      len(optim), info.world_size)
            if info.is_main:
                save_checkpoint(rec.out / f"zero{stage}_params.pt", saved)  # for the tests
                with library_output():  # zero_to_fp32 prints what it reads
                    plain = convert(save_dir, cfg.tag, rid, shapes)  # verified, then un-pickled
                rec.figure(f"ZeRO-{stage} converted tensors", len(plain), len(saved))
                whole = sum(t.numel() for t in saved.values())
                rec.check(f"ZeRO-{stage}: weight elements in rank 0's model file", "count",
                          module_numel(save_dir, cfg.tag), 0 if stage == 3 else whole)
                rec.check(f"ZeRO-{stage}: zero_to_fp32 state dict == engine parameters at save",
                          "parity", max_diff(plain, saved), 0.0, 0.0)
                diff = max_diff(plain, initial)
                rec.check(f"negative control: ZeRO-{stage} converted != initial parameters", "parity",
                          diff, 0.0, compare=">")
            dist.barrier()
            engine.destroy()
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
