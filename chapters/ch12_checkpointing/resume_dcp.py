"""Multi-rank full resume with DCP: every rank continues exactly where it stopped.

Each rank trains an FSDP2-sharded MLP with dropout (its own dropout stream) on its
DistributedSampler shard, with AdamW and a cosine schedule. At --stop-at the whole state is saved
with one `dcp.save`: sharded model and optimizer, scheduler, data position, and each rank's RNG
state under a rank-keyed entry; then everything is rebuilt from other seeds (as a new process
would), loaded and continued. Every rank's losses and final shards must equal the uninterrupted
run's bit for bit (same machine, same world). DCP treats a plain tensor that every rank saves
under one key as replicated and stores one rank's copy: the negative controls show per-rank state
cross-wired that way, and resumes without the RNG, the data position or the loader's own generator.
Every DCP folder gets a SHA-256 manifest written last (`save_dcp`) and is verified before it is
loaded; DCP's pickled `.metadata` is read through a restricted unpickler only (`load_dcp`,
`read_dcp_metadata`): DCP itself checks no checksum and un-pickles whatever the folder holds.

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch12_checkpointing/resume_dcp.py
    python chapters/ch12_checkpointing/resume_dcp.py                               # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch12_checkpointing/resume_dcp.py \\
        --ckpt-dir /tmp/ck12 --save-every 4 --kill-at 10   # ends after step 10, as a crash would
    torchrun --standalone --nproc_per_node=2 chapters/ch12_checkpointing/resume_dcp.py \\
        --ckpt-dir /tmp/ck12 --save-every 4                # resumes from step 8, ends at --steps
    torchrun --standalone --nproc_per_node=8 chapters/ch12_checkpointing/resume_dcp.py   # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch12_checkpointing/resume_dcp.py --out /shared/fs/ch12r   # --out on a shared file system
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch12_checkpointing/resume_dcp.py --out /shared/fs/ch12r
"""

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from chapters.ch12_checkpointing.resume import make_deterministic, set_aside
from common.checkpoint import (
    CheckpointError,
    FolderInUseError,
    check_identity,
    load_dcp,
    lock_folder,
    newest_verified,
    read_dcp_metadata,
    run_id,
    save_checkpoint,
    save_dcp,
    training_shapes,
    unlock_folder,
    verify_dcp,
)
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import (
    all_gather_single,
    comm_device,
    gather_numbers,
    reduce_number,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.results import RunRecorder, is_main_script
from common.seed import capture_rng_state, restore_rng_state, seed_everything

D_IN = 16


@dataclass
class Config(RunConfig):
    steps: int = 16
    """Optimizer steps of the whole run (crosses an epoch boundary after --stop-at on 2+ ranks)."""
    stop_at: int = 5
    """Demo: the step after which the run is saved, rebuilt from other seeds, loaded and continued."""
    ckpt_dir: str = ""
    """Folder of step_NNNNNN DCP checkpoints; when set, resume from its newest one that verifies and train to --steps."""
    save_every: int = 4
    """With --ckpt-dir: save after every this many steps."""
    kill_at: int = 0
    """With --ckpt-dir: stop after this step without finishing, as a crash would (0: run to --steps)."""
    batch_size: int = 4
    """Samples per rank per step (DistributedSampler gives each rank its share of every epoch)."""
    n_samples: int = 96
    """Samples in the data set."""
    d_hidden: int = 64
    """Hidden width of the MLP."""
    dropout: float = 0.2
    """Dropout probability: makes every rank's RNG state part of the training state."""
    lr: float = 3e-3
    """Peak learning rate of AdamW (cosine schedule over --steps)."""
    deterministic: bool = True
    """Deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG): a GPU rerun is bit-exact only with them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.stop_at < self.steps:
            raise ValueError(f"--stop-at must lie strictly between 0 and --steps={self.steps}")
        if self.save_every < 1 or self.batch_size < 1 or self.n_samples < 1:
            raise ValueError("--save-every, --batch-size and --n-samples must be at least 1")
        if not 0 <= self.kill_at < self.steps:
            raise ValueError(f"--kill-at must lie in [0, --steps={self.steps})")
        if not 0 <= self.dropout < 1:
            raise ValueError("--dropout must lie in [0, 1)")


def validate(cfg: Config, world_size: int) -> None:
    """The batch is per rank and DistributedSampler pads the data set to a multiple of the world
    (any world from 1 to 16 and beyond runs). Nothing in --ckpt-dir is read here: a folder is
    read only once it has verified, and its metadata only through the restricted unpickler (an
    earlier version read `.metadata` here with DCP's plain reader, so a crafted file ran code
    before the run had even started). The world a checkpoint was saved by is checked after
    verification (`check_world`)."""


def mlp(cfg: Config) -> nn.Sequential:
    """The model, unsharded: an MLP with dropout."""
    return nn.Sequential(nn.Linear(D_IN, cfg.d_hidden), nn.ReLU(), nn.Dropout(cfg.dropout),
                         nn.Linear(cfg.d_hidden, cfg.d_hidden), nn.ReLU(), nn.Dropout(cfg.dropout),
                         nn.Linear(cfg.d_hidden, 1))


def build(cfg: Config, device: torch.device, seed: int):
    """The MLP, each Linear sharded by FSDP2 (dim 0 over the ranks), AdamW and a cosine schedule;
    the weights are drawn from `seed` (the same on every rank)."""
    torch.manual_seed(seed)
    model = mlp(cfg).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps)


def new_run(cfg: Config, device: torch.device, seed: int, own_loader_rng: bool = True) -> dict:
    """A fresh training run as a new process builds it: model from `seed`, this rank's dropout
    stream from `seed + 1 + rank`, the data position at (epoch 0, batch 0).
    own_loader_rng=False is the broken variant: the DataLoader draws its workers' base seed
    from the global RNG each time an iterator starts, so a resume mid-epoch shifts the dropout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = build(cfg, device, seed)
    data = TensorDataset(*regression_data(cfg.n_samples, D_IN, 1, seed=cfg.seed))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(data, batch_size=cfg.batch_size, sampler=sampler,
                        generator=torch.Generator() if own_loader_rng else None)
    seed_everything(seed + 1 + rank)
    return {"model": model, "opt": opt, "sched": sched, "sampler": sampler, "loader": loader,
            "pos": {"epoch": 0, "index": 0}, "step": 0, "device": device, "lrs": []}


def batches(cfg: Config, run: dict):
    """This rank's batches from the data position on: (epoch, index) names the next batch."""
    sampler, loader, pos = run["sampler"], run["loader"], run["pos"]
    while True:
        sampler.set_epoch(pos["epoch"])  # the epoch's shuffle, the same on every rank
        if loader.generator is not None:  # worker seeds: a function of the epoch, not of history
            loader.generator.manual_seed(cfg.seed * 1000 + pos["epoch"])
        skip = pos["index"]
        for i, batch in enumerate(loader):
            if i >= skip:  # batches consumed before the checkpoint are skipped
                yield batch
        pos["epoch"], pos["index"] = pos["epoch"] + 1, 0


def train(cfg: Config, run: dict, until: int) -> list[float]:
    """Train from run["step"] to `until`; returns this rank's losses."""
    model, opt, sched, dev = run["model"], run["opt"], run["sched"], run["device"]
    stream, losses = batches(cfg, run), []
    while run["step"] < until:
        x, y = next(stream)
        loss = F.mse_loss(model(x.to(dev)), y.to(dev))
        opt.zero_grad()
        loss.backward()  # FSDP2 reduce-scatters the gradients
        opt.step()
        sched.step()
        losses.append(loss.item())
        run["lrs"].append(sched.get_last_lr()[0])
        run["pos"]["index"] += 1
        run["step"] += 1
    return losses


def training_state(run: dict, per_rank_key: bool = True) -> dict:
    """Everything the next step depends on, as one DCP state dict. Sharded: model and optimizer
    (DTensors). Replicated (equal on every rank, stored once): scheduler, step, data position.
    Per rank: the RNG state, under a key holding the rank; per_rank_key=False is the broken
    variant (one key on every rank: DCP keeps one rank's copy and loads it everywhere)."""
    model_sd, optim_sd = get_state_dict(run["model"], run["opt"])
    state = {"model": model_sd, "optim": optim_sd, "scheduler": run["sched"].state_dict(),
             "progress": {"step": run["step"], **run["pos"]}}
    if per_rank_key:
        state["per_rank"] = {f"rank{dist.get_rank()}": {"rng": capture_rng_state()}}
    else:
        state["rng"] = capture_rng_state()
    return state


def load_training_state(path, run: dict, rng: bool = True, data: bool = True,
                        per_rank_key: bool = True) -> None:
    """Load a checkpoint into freshly built objects (rng/data=False: the broken variants).
    The template is the state dict of the fresh run: DCP fills each tensor in place, on its
    device (RNG states are CPU tensors in the template, so they come back on the CPU)."""
    state = training_state(run, per_rank_key)
    load_dcp(state, path)  # restricted unpickler, weights_only=True; verify_dcp(path) comes first
    set_state_dict(run["model"], run["opt"], model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    run["sched"].load_state_dict(state["scheduler"])
    run["step"] = state["progress"]["step"]
    if data:
        run["pos"] = {"epoch": state["progress"]["epoch"], "index": state["progress"]["index"]}
    if rng:
        restore_rng_state(state["per_rank"][f"rank{dist.get_rank()}"]["rng"] if per_rank_key
                          else state["rng"])


def shard_diff(a: nn.Module, b: nn.Module) -> float:
    """Max |a − b| over this rank's parameter shards."""
    return max((p.to_local().double() - q.to_local().double()).abs().max().item()
               if p.to_local().numel() else 0.0 for p, q in zip(a.parameters(), b.parameters()))


def loss_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


def gather_losses(losses: list[float]) -> list[list[float]]:
    """Every rank's losses, in rank order (a tensor collective on the communication device)."""
    t = torch.tensor(losses, dtype=torch.float64, device=comm_device())
    out = torch.empty(dist.get_world_size() * len(losses), dtype=t.dtype, device=t.device)
    all_gather_single(out, t)
    return out.view(dist.get_world_size(), -1).tolist()


def shared_key_demo(folder: Path) -> dict:
    """Each rank saves {"pos": tensor([rank])} with DCP, once under one key and once under a
    rank-keyed entry, and loads both back (verified first). Returns the values this rank got."""
    rank = dist.get_rank()
    save_dcp({"pos": torch.tensor([rank])}, folder / "one_key")
    save_dcp({"per_rank": {f"rank{rank}": {"pos": torch.tensor([rank])}}}, folder / "rank_keyed")
    shared = {"pos": torch.tensor([-1])}
    verify_dcp(folder / "one_key")
    load_dcp(shared, folder / "one_key")
    keyed = {"per_rank": {f"rank{rank}": {"pos": torch.tensor([-1])}}}
    verify_dcp(folder / "rank_keyed")
    load_dcp(keyed, folder / "rank_keyed")
    return {"one_key": int(shared["pos"]), "rank_keyed": int(keyed["per_rank"][f"rank{rank}"]["pos"])}


def stored_keys(path, suffix: str) -> list[str]:
    """Keys of a DCP checkpoint's metadata that end with `suffix` (one per stored entry), read
    through the restricted unpickler (`read_dcp_metadata`): listing keys runs no code."""
    return sorted(k for k in read_dcp_metadata(path).state_dict_metadata if k.endswith(suffix))


def stored_files(path, key: str) -> list[str]:
    """The data files (one per writing rank: __<rank>_0.distcp) that hold entry `key`."""
    meta = read_dcp_metadata(path)
    return sorted({info.relative_path for index, info in meta.storage_data.items() if index.fqn == key})


def dropout_rng_key(device: torch.device) -> str:
    """The entry of capture_rng_state() this rank's dropout draws from, as DCP names it: the CPU
    generator, or on a GPU that device's own generator (`rng.cuda.<i>`: one entry per device,
    each deduplicated on its own, so which rank's copy survives can differ from device to device)."""
    return f"rng.cuda.{device.index}" if device.type == "cuda" else "rng.torch"


def writer_rank(path, key: str) -> int:
    """The rank whose data file (__<rank>_0.distcp) holds the one stored copy of `key`."""
    files = stored_files(path, key)
    if len(files) != 1:
        raise ValueError(f"{key} is stored in {len(files)} files of {path}, not once")
    return int(files[0].split("_")[2])


def batches_per_epoch(cfg: Config, world_size: int) -> int:
    """DistributedSampler gives each rank ceil(n / world) samples (padding); the last batch may be short."""
    return math.ceil(math.ceil(cfg.n_samples / world_size) / cfg.batch_size)


def resume_variants(cfg: Config, device: torch.device, folder: Path, own_loader_rng: bool = True,
                    variants=("full",)) -> dict:
    """Uninterrupted run; then a run saved at --stop-at and, for each variant, rebuilt from other
    seeds (a new process), loaded and continued. Returns this rank's losses and shard diffs."""
    reference = new_run(cfg, device, cfg.seed, own_loader_rng)
    ref_losses = train(cfg, reference, cfg.steps)
    head_run = new_run(cfg, device, cfg.seed, own_loader_rng)
    head = train(cfg, head_run, cfg.stop_at)
    save_dcp(training_state(head_run), folder / "rank_keyed")
    save_dcp(training_state(head_run, per_rank_key=False), folder / "one_key")
    verify_dcp(folder / "rank_keyed")  # what this run loads, it verifies first
    verify_dcp(folder / "one_key")
    out = {"reference": ref_losses, "lrs": reference["lrs"]}
    for name in variants:
        run = new_run(cfg, device, cfg.seed + 1000, own_loader_rng)  # other weights, other streams
        load_training_state(folder / ("one_key" if name == "one key" else "rank_keyed"), run,
                            rng=name != "no RNG", data=name != "no data position",
                            per_rank_key=name != "one key")
        losses = head + train(cfg, run, cfg.steps)
        out[name] = {"losses": losses, "loss_diff": loss_diff(losses, ref_losses),
                     "first_differs": int(losses[cfg.stop_at] != ref_losses[cfg.stop_at]),
                     "shard_diff": shard_diff(run["model"], reference["model"])}
    return out


def record_resume(cfg: Config, info, rec: RunRecorder) -> dict:
    """The demonstration: full resume, its negative controls, and the one-key demo."""
    folder, world = rec.out / "ckpt", info.world_size
    res = resume_variants(cfg, info.device, folder,
                          variants=("full", "one key", "no RNG", "no data position"))
    full = res["full"]
    rec.check("resumed losses == uninterrupted (all ranks)", "parity",
              reduce_number(full["loss_diff"], "max"), 0.0)
    rec.check("resumed final shards == uninterrupted", "parity",
              reduce_number(full["shard_diff"], "max"), 0.0)
    for name in ("no RNG", "no data position"):
        rec.check(f"resume without {name.removeprefix('no ')} == uninterrupted (must not)", "parity",
                  reduce_number(res[name]["loss_diff"], "max"), 0.0, compare=">")
    rec.check("rank-keyed RNG entries = world size", "count",
              len(stored_keys(folder / "rank_keyed", ".rng.torch")), world)
    rec.figure("one key: file holding the single rng.torch",
               stored_files(folder / "one_key", "rng.torch"))
    # Which ranks resume with another rank's stream is read off the metadata (theory), then
    # compared with the losses (measurement). On the CPU one entry, one kept copy: W - 1 ranks.
    key = dropout_rng_key(info.device)
    foreign = reduce_number(int(writer_rank(folder / "one_key", key) != info.rank))
    rec.figure(f"one key: ranks whose {key} was stored by another rank", foreign,
               expected=world - 1 if info.device.type == "cpu" else None)
    rec.check("one key: ranks diverging at once = ranks given another's stream", "count",
              reduce_number(res["one key"]["first_differs"]), foreign)
    demo = shared_key_demo(folder / "pos")
    got = {k: gather_numbers(v) for k, v in demo.items()}
    rec.figure("pos loaded by each rank, one key", got["one_key"], expected=list(range(world)))
    rec.figure("pos loaded by each rank, rank-keyed", got["rank_keyed"], expected=list(range(world)))
    rec.check("one key: ranks loading another rank's pos = W-1", "count",
              sum(v != r for r, v in enumerate(got["one_key"])), world - 1)
    rec.check("rank-keyed: ranks loading another rank's pos", "count",
              sum(v != r for r, v in enumerate(got["rank_keyed"])), 0)
    # The DataLoader's base-seed draw: a fresh pair of runs with the broken loader.
    per_epoch = batches_per_epoch(cfg, world)
    if cfg.stop_at % per_epoch:  # mid-epoch: the resumed loader starts an iterator the run did not
        bad = resume_variants(cfg, info.device, rec.out / "ckpt_loader", own_loader_rng=False)
        rec.check("loader on the global RNG: resume == uninterrupted (must not)",
                  "parity", reduce_number(bad["full"]["loss_diff"], "max"), 0.0, compare=">")
    else:
        rec.figure("loader on the global RNG", "n/a: --stop-at ends an epoch")
    rec.figure("batches per epoch per rank", per_epoch)
    return {"reference": gather_losses(res["reference"]), "resumed": gather_losses(full["losses"]),
            "lrs": res["lrs"]}


STEP_FOLDER = re.compile(r"step_\d{6}")


def step_folders(ckpt_dir: Path) -> list[Path]:
    """The folder's step_NNNNNN checkpoints, oldest first."""
    return sorted(p for p in Path(ckpt_dir).glob("step_*") if STEP_FOLDER.fullmatch(p.name))


def newest_checkpoint(ckpt_dir: Path, rid: str, shapes: dict,
                      world_size: int | None = None) -> tuple[Path | None, dict | None]:
    """(folder, manifest) of the newest step_NNNNNN folder that verifies (`verify_dcp`: every
    file against its SHA-256 in manifest.json, which a save writes last, so a save that did not
    finish has none); each damaged one skipped is logged in one line. That folder must be this
    run's (`check_identity` on the manifest's run id and shapes): another run's or another
    model's is refused in one line, not walked past as damage. With `world_size`, it must also
    have been saved by that many ranks (`check_world`). Collective: every rank walks the same
    folders to the same verdicts."""
    path, manifest = newest_verified(step_folders(ckpt_dir), verify_dcp, describe=lambda p: p.name)
    if path is not None:
        check_identity(manifest, rid, shapes, path)
        if world_size is not None:
            check_world(path, world_size)
    return path, manifest


def check_world(path: Path, world_size: int) -> None:
    """A --ckpt-dir checkpoint resumes on the world that saved it: its RNG streams and data
    positions are per rank. Counted in the (verified, safely read) metadata: one rank-keyed RNG
    entry per saving rank. Collective verdict: every rank reads the same metadata."""
    saved = len(stored_keys(path, ".rng.torch"))
    if saved != world_size:
        raise CheckpointError(f"{path} was saved by {saved} ranks and resume_dcp.py resumes on the "
                              f"same number, not {world_size} (per-rank RNG and data positions; "
                              f"chapter 13 resumes on any world)", collective=True)


def lock_ckpt_dir(ckpt_dir: Path, wait_s: float = 3.0) -> None:
    """Global rank 0 takes the folder's lock (one run at a time; several nodes of one job never
    refuse each other) and every rank learns the verdict, so that no rank touches a folder that
    another run holds and rank 0 alone says so, in one line."""
    problem = None
    if dist.get_rank() == 0:
        try:
            lock_folder(ckpt_dir, "--ckpt-dir", wait_s=wait_s)
        except FolderInUseError as e:
            problem = str(e)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        error = FolderInUseError(box[0])
        error.collective = True  # common.log.one_line_errors: rank 0 alone prints it
        raise error


def run_with_checkpoints(cfg: Config, device: torch.device, out: Path,
                         lock_wait_s: float = 3.0) -> dict:
    """The loop a real job runs: take the checkpoint folder (waiting up to `lock_wait_s` for a
    run that is still ending), resume from the newest checkpoint that verifies and is this run's
    (run id in `out`), save every --save-every steps into a new folder (never over the last good
    one), each with its manifest written last."""
    ckpt_dir, own_lock = Path(cfg.ckpt_dir), not is_main_script(__file__)
    if own_lock:  # called in process (a test, a notebook): run as a script, parse_config has
        # locked --ckpt-dir on global rank 0 before any process group, until the process ends
        lock_ckpt_dir(ckpt_dir, lock_wait_s)
    try:
        run = new_run(cfg, device, cfg.seed)
        rid, shapes = run_id(out), training_shapes(run["model"], run["opt"])
        path, _ = newest_checkpoint(ckpt_dir, rid, shapes, dist.get_world_size())
        if path is not None:
            if dist.get_rank() == 0:  # folders newer than it failed: kept, never saved over
                set_aside([p for p in step_folders(ckpt_dir) if p.name > path.name])
            dist.barrier()
            load_training_state(path, run)
            log.info("resumed from %s at step %d", path.name, run["step"])
        first, losses, end = run["step"], [], cfg.kill_at or cfg.steps
        while run["step"] < end:
            losses += train(cfg, run, min(end, (run["step"] // cfg.save_every + 1) * cfg.save_every))
            if run["step"] % cfg.save_every == 0:
                save_dcp(training_state(run), ckpt_dir / f"step_{run['step']:06d}", run_id=rid,
                         step=run["step"], shapes=shapes, world=dist.get_world_size())
                log.info("saved step %d", run["step"])
    finally:
        if own_lock and dist.get_rank() == 0:  # never parse_config's lock (re-entrant, not counted)
            unlock_folder(ckpt_dir)
    return {"first_step": first, "losses": losses}


def main(cfg: Config) -> int:
    make_deterministic(cfg.deterministic)  # before any CUDA work
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        if cfg.ckpt_dir:
            out = run_with_checkpoints(cfg, info.device, rec.out)
            rec.figure("resumed from step", out["first_step"])
            losses = {"first_step": out["first_step"], "losses": gather_losses(out["losses"])}
        else:
            losses = record_resume(cfg, info, rec)
            for step, (loss, lr) in enumerate(zip(losses["resumed"][0], losses.pop("lrs"))):
                rec.metrics(step, loss=loss, lr=lr)  # rank 0's resumed run
        if info.is_main:
            save_checkpoint(rec.out / "losses.pt", losses)  # for the tests: every rank's losses
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
