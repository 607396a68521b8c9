"""Every rank reads its own shard of a memory-mapped token file through DataLoader and
DistributedSampler, and the job proves the shards are disjoint and cover the data.

Each rank trains a bigram language model (data-parallel, as in chapter 03) on windows of the
int16 token file that data/build.py writes (built into the run's folder if missing). After each
epoch the ranks all-gather the window indices they saw: together they must cover every window,
repeating exactly DistributedSampler's documented padding, and `set_epoch` must reshuffle.

Run:
    python chapters/ch11_data_loading/train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch11_data_loading/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch11_data_loading/train.py --drop-last
    torchrun --standalone --nproc_per_node=8 chapters/ch11_data_loading/train.py --num-workers 4   # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch11_data_loading/train.py --num-workers 4                       # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch11_data_loading/train.py   # Slurm
"""

import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from chapters.ch03_data_parallel.train import all_reduce_gradients
from chapters.ch11_data_loading.datasets import TokenWindows, ensure_tokens, read_tokens
from chapters.ch11_data_loading.sampling import ShardSampler, check_shards, epoch_shards
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import REPO_ROOT, RunRecorder
from common.seed import seed_everything


@dataclass
class Config(RunConfig):
    steps: int = 1_000_000
    """Cap on optimizer steps per epoch (default: no cap; the cover checks need whole epochs)."""
    epochs: int = 2
    """Passes over the windows; each calls sampler.set_epoch(epoch) first."""
    tokens: str = str(REPO_ROOT / "data" / "cache" / "tokens.bin")
    """int16 token file from data/build.py; built into <out>/data if it does not exist."""
    block_size: int = 32
    """Tokens per training window."""
    windows: int = 203
    """Windows to use from the file (0: all); 203 is prime, so 2, 3 and 4 ranks need padding."""
    batch_size: int = 8
    """Windows per batch on each rank (micro_batch_size)."""
    drop_last: bool = False
    """DistributedSampler(drop_last=...): drop the tail instead of padding by repeating the head."""
    num_workers: int = 0
    """DataLoader worker processes per rank (each opens its own memory map)."""
    lr: float = 20.0
    """SGD learning rate of the bigram model."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "epochs", "block_size", "batch_size")
        if self.windows < 0 or self.num_workers < 0:
            raise ValueError("--windows and --num-workers must not be negative")


def prepare_tokens(cfg: Config, rank: int, out) -> str:
    """Rank 0 builds the file if it is missing; every rank waits at the barrier (all reach it)."""
    if rank == 0:
        path = ensure_tokens(cfg.tokens, out / "data")
    dist.barrier()
    return str(ensure_tokens(cfg.tokens, out / "data")) if rank else str(path)


def make_loader(dataset, cfg: Config, rank: int, world_size: int):
    """DistributedSampler shards and shuffles; the DataLoader only batches (shuffle=False)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed, drop_last=cfg.drop_last)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available(),
                        persistent_workers=cfg.num_workers > 0)
    return sampler, loader


def gather_indices(seen: list[int], world_size: int, device) -> list[list[int]]:
    """Every rank's list of indices (all the same length: DistributedSampler equalises them)."""
    mine = torch.tensor(seen, dtype=torch.long, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def train_epoch(model, loader, source: torch.Tensor, cfg: Config, info) -> dict:
    """One epoch: read, check each window against the source tokens, bigram SGD step."""
    seen, losses, mismatched, wait = [], [], 0, 0.0
    t = time.perf_counter()
    for step, (idx, x, y) in enumerate(loader):
        wait += time.perf_counter() - t
        if step >= cfg.steps:
            break
        for i, xi, yi in zip(idx.tolist(), x, y):  # the memmap window == the file's tokens
            ref = source[i * cfg.block_size:i * cfg.block_size + cfg.block_size + 1].long()
            mismatched += int(not (torch.equal(xi, ref[:-1]) and torch.equal(yi, ref[1:])))
        x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.zero_grad()
        loss.backward()
        all_reduce_gradients(model, info.world_size)  # chapter 03: average over the ranks
        with torch.no_grad():
            for p in model.parameters():
                p -= cfg.lr * p.grad
        seen += idx.tolist()
        losses.append(loss.item())
        t = time.perf_counter()
    return {"seen": seen, "losses": losses, "mismatched": mismatched, "wait_s": wait}


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        path = prepare_tokens(cfg, info.rank, rec.out)
        dataset = TokenWindows(path, cfg.block_size, cfg.windows)
        source = read_tokens(path)  # a second reader, for the window check
        n, world = len(dataset), info.world_size
        if cfg.drop_last and n < world:
            raise SystemExit(f"error: {n} windows cannot be split over {world} ranks with --drop-last")
        sampler, loader = make_loader(dataset, cfg, info.rank, world)
        log.info("%s: %d windows of %d tokens, %d ranks x %d windows per epoch, %d workers per rank",
                 path, n, cfg.block_size, world, len(sampler), cfg.num_workers)
        vocab = int(source.max()) + 1
        model = torch.nn.Embedding(vocab, vocab).to(info.device)  # bigram: logits of the next token
        torch.nn.init.zeros_(model.weight)  # uniform predictions: loss starts at ln(vocab)
        orders, mismatched, step = [], 0, 0
        for epoch in range(cfg.epochs):
            sampler.set_epoch(epoch)  # forget this and every epoch repeats epoch 0's order
            out = train_epoch(model, loader, source, cfg, info)
            for loss in out["losses"]:
                if step % cfg.log_every == 0:
                    rec.metrics(step, loss=loss, lr=cfg.lr, epoch=epoch)
                step += 1
            log.info("epoch %d: %d steps, loss %.3f -> %.3f, waited %.3f s for data", epoch,
                     len(out["losses"]), out["losses"][0], out["losses"][-1], out["wait_s"])
            shards = gather_indices(out["seen"], world, info.device)  # every rank reaches it
            orders.append(shards)
            mismatched += out["mismatched"]
            whole = len(out["seen"]) == len(sampler)
            verdict = check_shards(shards, n, cfg.drop_last)
            hand = epoch_shards(lambda r: ShardSampler(n, world, r, seed=cfg.seed,
                                                       drop_last=cfg.drop_last), world, epoch)
            rec.check(f"epoch {epoch}: ranks whose shard != hand sampler's", "count",
                      sum(a != b[:len(a)] for a, b in zip(shards, hand)), 0)
            if whole:
                rec.check(f"epoch {epoch}: repeated windows (padding)", "count",
                          verdict["repeats"], verdict["expected_repeats"])
                rec.check(f"epoch {epoch}: windows nobody read (dropped)", "count",
                          verdict["missing"], verdict["expected_missing"])
        rec.check("memmap windows == source tokens (mismatches)", "count", mismatched, 0)
        if cfg.epochs > 1:
            rec.check("set_epoch reshuffles (epoch 0 order != epoch 1)", "count",
                      int(orders[0] != orders[1]), 1)
        rec.figure("windows per rank per epoch", len(sampler), expected=verdict["per_rank"])
        rec.figure("final loss", out["losses"][-1], unit="nats")
        rec.figure("uniform loss ln(vocab)", float(torch.tensor(float(vocab)).log()), unit="nats")
        if info.is_main:
            save_checkpoint(rec.out / "indices.pt", {"orders": orders, "n": n, "path": path})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
