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

import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from chapters.ch03_data_parallel.data_parallel import all_reduce_gradients
from chapters.ch11_data_loading.datasets import TokenWindows, ensure_tokens, read_tokens
from chapters.ch11_data_loading.sampling import ShardSampler, check_shards, epoch_shards
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import reduce_number, setup_distributed, teardown_distributed
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


def validate(cfg: Config, world_size: int) -> None:
    """With --drop-last every rank needs at least one window (with --windows 0 the file decides,
    and main checks it once the file is open)."""
    if cfg.drop_last and 0 < cfg.windows < world_size:
        raise ValueError(f"--windows {cfg.windows} cannot be split over {world_size} ranks with "
                         "--drop-last: every rank would get none")


def prepare_tokens(cfg: Config, local_rank: int, out) -> tuple[str, bool]:
    """The token file, built if missing by local rank 0 of every node (a second node need not
    share this one's disk), while the node's other ranks wait at a barrier that every rank of
    the job reaches. Returns (path, whether this rank built it)."""
    built = False
    if local_rank == 0:
        path, built = ensure_tokens(cfg.tokens, out / "data")
    dist.barrier()  # outside the `if`: a collective that only some ranks call hangs the others
    if local_rank != 0:
        path, _ = ensure_tokens(cfg.tokens, out / "data")  # finds what local rank 0 built
    return str(path), built


def make_loader(dataset, cfg: Config, rank: int, world_size: int, pin_memory: bool):
    """DistributedSampler shards and shuffles; the DataLoader only batches (shuffle=False).
    Pinned batches let the copy to a GPU run asynchronously; pinning needs CUDA."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed, drop_last=cfg.drop_last)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=pin_memory,
                        persistent_workers=cfg.num_workers > 0)
    return sampler, loader


def gather_indices(seen: list[int]) -> list[list[int]]:
    """Every rank's list of indices, in rank order, whatever their lengths (an object
    all-gather of plain lists: a rank that read more or less than the others shows as such,
    where a tensor all-gather would need equal sizes)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    return everyone


def shard_mismatches(shards: list[list[int]], expected: list[list[int]], length: int) -> int:
    """Ranks whose indices are not exactly the first `length` of the expected shard: wrong
    indices, or too few or too many of them."""
    if len(shards) != len(expected):
        raise ValueError(f"{len(shards)} shards against {len(expected)} expected")
    return sum(len(got) != length or got != want[:length] for got, want in zip(shards, expected))


def train_epoch(model, loader, source: torch.Tensor, cfg: Config, info) -> dict:
    """One epoch: read, check each window against the source tokens, bigram SGD step."""
    seen, losses, mismatched, compared, wait = [], [], 0, 0, 0.0
    t = time.perf_counter()
    for step, (idx, x, y) in enumerate(loader):
        wait += time.perf_counter() - t
        if step >= cfg.steps:
            break
        for i, xi, yi in zip(idx.tolist(), x, y):  # the memmap window == the file's tokens
            ref = source[i * cfg.block_size:i * cfg.block_size + cfg.block_size + 1].long()
            mismatched += int(not (torch.equal(xi, ref[:-1]) and torch.equal(yi, ref[1:])))
            compared += 1
        x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.zero_grad()
        loss.backward()
        all_reduce_gradients(model, info.world_size)  # chapter 03: average over the ranks
        with torch.no_grad():
            for p in model.parameters():
                p -= cfg.lr * p.grad
        seen += idx.tolist()
        losses.append(loss.item())  # .item() waits for the device: the step is done
        t = time.perf_counter()  # from here to the next batch, the loop waits for data only
    return {"seen": seen, "losses": losses, "mismatched": mismatched, "compared": compared,
            "wait_s": wait}


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        path, built = prepare_tokens(cfg, info.local_rank, rec.out)
        builders = reduce_number(int(built))  # one per node where the file was missing
        if builders:
            log.info("built %s on %d node(s), by each node's local rank 0", path, builders)
        else:
            log.info("tokens: %s", path)
        dataset = TokenWindows(path, cfg.block_size, cfg.windows)
        source = read_tokens(path)  # a second reader, for the window check
        n, world = len(dataset), info.world_size
        if cfg.drop_last and n < world:  # only with --windows 0: the file decided n
            raise SystemExit(f"error: {n} windows cannot be split over {world} ranks with --drop-last")
        pin = info.device.type == "cuda"
        sampler, loader = make_loader(dataset, cfg, info.rank, world, pin_memory=pin)
        rec.figure("pin_memory", pin if pin else "n/a on CPU")
        log.info("%d windows of %d tokens, %d ranks x %d windows per epoch, %d workers per rank",
                 n, cfg.block_size, world, len(sampler), cfg.num_workers)
        vocab = int(source.max()) + 1
        model = torch.nn.Embedding(vocab, vocab).to(info.device)  # bigram: logits of the next token
        torch.nn.init.zeros_(model.weight)  # uniform predictions: loss starts at ln(vocab)
        orders, mismatched, compared, expected_compared, step = [], 0, 0, 0, 0
        for epoch in range(cfg.epochs):
            sampler.set_epoch(epoch)  # forget this and every epoch repeats epoch 0's order
            out = train_epoch(model, loader, source, cfg, info)
            if epoch == 0:
                first_loss = out["losses"][0]
            for loss in out["losses"]:
                if step % cfg.log_every == 0:
                    rec.metrics(step, loss=loss, lr=cfg.lr, epoch=epoch)
                step += 1
            log.info("epoch %d: %d steps, loss %.3f -> %.3f, waited %.3f s for data", epoch,
                     len(out["losses"]), out["losses"][0], out["losses"][-1], out["wait_s"])
            shards = gather_indices(out["seen"])  # a collective: every rank reaches it
            orders.append(shards)
            mismatched += out["mismatched"]
            compared += out["compared"]
            # What each rank must have read, from the hand sampler (not from the sampler under
            # test): its whole shard, or the first --steps batches of it.
            hand = epoch_shards(lambda r: ShardSampler(n, world, r, seed=cfg.seed,
                                                       drop_last=cfg.drop_last), world, epoch)
            length = min(len(hand[info.rank]), cfg.steps * cfg.batch_size)
            whole = length == len(hand[info.rank])
            expected_compared += length
            verdict = check_shards(shards, n, cfg.drop_last)
            rec.check(f"epoch {epoch}: ranks whose shard != hand sampler's", "count",
                      shard_mismatches(shards, hand, length), 0)
            if whole:
                rec.check(f"epoch {epoch}: repeated windows (padding)", "count",
                          verdict["repeats"], verdict["expected_repeats"])
                rec.check(f"epoch {epoch}: windows nobody read (dropped)", "count",
                          verdict["missing"], verdict["expected_missing"])
        rec.check("memmap windows == source tokens (mismatches)", "count", mismatched, 0)
        # The sibling that proves the comparison ran: one per window this rank read.
        rec.check("windows compared with the source tokens", "count", compared, expected_compared)
        if cfg.epochs > 1:
            rec.check("set_epoch reshuffles (epoch 0 order != epoch 1)", "count",
                      int(orders[0] != orders[1]), 1)
        rec.figure("windows per rank per epoch", len(sampler), expected=verdict["per_rank"])
        rec.figure("first loss (uniform predictions: ln vocab)", first_loss,
                   expected=math.log(vocab), unit="nats")
        rec.figure("final loss", out["losses"][-1], unit="nats")
        if info.is_main:
            save_checkpoint(rec.out / "indices.pt", {"orders": orders, "n": n, "path": path})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
