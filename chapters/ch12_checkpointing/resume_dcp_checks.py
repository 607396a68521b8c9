"""What `resume_dcp.py`'s demonstration records: the full resume against the uninterrupted run
on every rank, bit for bit, and its negative controls (no RNG, no data position, per-rank state
under one shared key, a loader on the global RNG); which rank's copy DCP kept under one key, read
off the metadata (`stored_keys`, `stored_files`, through the restricted unpickler) and compared
with the losses; and the one-key demonstration with each rank's position.

Helper module of chapter 12 (no main guard); `resume_dcp.py` imports it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from chapters.ch12_checkpointing.resumable import (
    load_training_state,
    new_run,
    train,
    training_state,
)
from common.checkpoint import load_dcp, read_dcp_metadata, save_dcp, verify_dcp
from common.distributed import all_gather_single, comm_device, gather_numbers, reduce_number
from common.results import RunRecorder


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


def batches_per_epoch(cfg, world_size: int) -> int:
    """DistributedSampler gives each rank ceil(n / world) samples (padding); the last batch may be short."""
    return math.ceil(math.ceil(cfg.n_samples / world_size) / cfg.batch_size)


def resume_variants(cfg, device: torch.device, folder: Path, own_loader_rng: bool = True,
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


def record_resume(cfg, info, rec: RunRecorder) -> dict:
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
