"""A small CLIP trained data-parallel, its contrastive loss taking negatives from every rank.

Each rank embeds its b = B / W image/caption pairs, all-gathers the embeddings so that every
image meets all B captions (an all-gather that carries gradients: by hand and with
`torch.distributed.nn.functional.all_gather`), and computes either the whole B x B loss or only
its own b x B rows (the "local loss"). The script first proves, in float64, that the loss and
the gradients equal one process on the global batch for both gathers and both losses, that a
gather without gradients is rejected by the same check, and that the logits a rank builds are
B² or 2·b·B bytes as counted; then it trains with DDP on shapes and their captions and asks the
model to retrieve captions for colour/shape pairs it never saw in training (zero-shot).

Run:
    python chapters/ch26_multimodal/train.py                                      # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch26_multimodal/train.py    # 2 CPU processes
    torchrun --standalone --nproc_per_node=4 chapters/ch26_multimodal/train.py --no-local-loss
    torchrun --standalone --nproc_per_node=8 chapters/ch26_multimodal/train.py \\
        --global-batch-size 1024 --steps 100                                      # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch26_multimodal/train.py --global-batch-size 1024 --steps 100   # on each node
    srun --ntasks=8 --ntasks-per-node=8 --gpus-per-node=8 python chapters/ch26_multimodal/train.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch26_multimodal import checks, contrastive, data
from chapters.ch26_multimodal.checks import (
    FIRST_STEP_TOLERANCE,
    eval_set,
    first_step_gap,
    zero_shot,
)
from chapters.ch26_multimodal.contrastive import distributed_clip_loss
from chapters.ch26_multimodal.data import shard
from chapters.ch26_multimodal.model import CLIP
from common.config import RunConfig, check_global_batch, parse_config, require_at_least_one
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, progress, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything


@dataclass
class Config(RunConfig):
    steps: int = 200
    """Optimizer steps of the CLIP training."""
    global_batch_size: int = 48
    """Image/caption pairs per step over all ranks (B); each rank embeds B / world of them."""
    embed_dim: int = 32
    """Size of the shared embedding space both towers project to."""
    image_size: int = 16
    """Side of the generated images in pixels (a multiple of 4)."""
    lr: float = 2e-3
    """Learning rate of Adam."""
    gather: str = "torch"
    """All-gather used in training: torch (torch.distributed.nn.functional.all_gather), hand, or
    nograd (no gradient through the gather: the wrong one, for the exercises)."""
    local_loss: bool = True
    """Train on each rank's b x B rows of the logits (open_clip's local_loss) instead of all B x B."""
    eval_pairs: int = 256
    """Held-out images for zero-shot retrieval (colour/shape pairs never seen in training)."""
    margin: float = 0.2
    """Zero-shot accuracy must beat chance (1/64) by at least this much."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "global_batch_size", "embed_dim", "eval_pairs")
        if self.image_size < 4 or self.image_size % 4:
            raise ValueError(f"--image-size must be a positive multiple of 4, got {self.image_size}")
        if self.gather not in contrastive.GATHERS:
            raise ValueError(f"--gather must be one of {', '.join(contrastive.GATHERS)}, "
                             f"not {self.gather!r}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")


def validate(cfg: Config, world_size: int) -> None:
    """Every rank embeds the same number of pairs, and the gathers' backward reduce-scatters."""
    check_global_batch(cfg.global_batch_size, world_size)
    on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if world_size > 1 and cfg.backend == "gloo" and on_gpus:
        raise ValueError("the all-gather's backward reduce-scatters, which gloo runs on CUDA tensors "
                         "as an all-reduce of the whole input (untested): use NCCL (one GPU per "
                         "rank) or --device cpu")


def train_clip(cfg: Config, info, rec: RunRecorder) -> CLIP:
    """DDP training on the training combinations: each step, this rank's shard of the global
    batch, the distributed contrastive loss, Adam."""
    rank, world, B = info.rank, info.world_size, cfg.global_batch_size
    train_combos, held = data.split_combinations()
    log.info("generating %d image/caption pairs (%d of 64 combinations; %d held out)",
             cfg.steps * B, len(train_combos), len(held))
    images, ids, _ = data.make_pairs(cfg.steps * B, cfg.seed + 1, train_combos, cfg.image_size)
    held_images, held_truth = eval_set(cfg, held, cfg.seed + 2)
    seed_everything(cfg.seed)
    model = CLIP(cfg.embed_dim, cfg.image_size).to(info.device)
    rec.figure("zero-shot accuracy before training (held-out)",
               round(zero_shot(model, held_images, held_truth, info.device), 4))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg.lr)
    for step in progress(range(cfg.steps), total=cfg.steps, desc="train", enabled=info.is_main, every=50):
        rows = slice(step * B, (step + 1) * B)
        x = shard(images[rows], rank, world).to(info.device)
        t = shard(ids[rows], rank, world).to(info.device)
        loss = distributed_clip_loss(*ddp(x, t), cfg.gather, cfg.local_loss)
        opt.zero_grad()
        loss.backward()
        if step == 0:  # the gather and loss the loop really uses, checked where they run
            gap = first_step_gap(model, images[rows].to(info.device), ids[rows].to(info.device))
            rec.check(f"first training step, {cfg.gather} gather: gradient == one process "
                      "(float32, relative)", "parity", gap, 0.0, tolerance=FIRST_STEP_TOLERANCE)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            mean = reduce_number(loss.detach()) / world  # the global-batch loss
            acc = zero_shot(model, held_images, held_truth, info.device)
            rec.metrics(step, loss=mean, lr=cfg.lr, zero_shot=acc, temperature=1 / model.scale().item())
    rec.figure("final loss (global batch); expected: its floor", round(mean, 4),
               expected=round(data.loss_floor(ids[rows]), 4))
    return model


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        b = cfg.global_batch_size // info.world_size
        log.info("CLIP on %d rank(s), %s/%s: B=%d pairs per step, b=%d per rank, %s gather, %s loss",
                 info.world_size, info.device, info.backend, cfg.global_batch_size, b, cfg.gather,
                 "local" if cfg.local_loss else "global")
        checks.check_parity(rec, cfg, info)
        model = train_clip(cfg, info, rec)
        checks.check_zero_shot(rec, cfg, model, info)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
