"""Sharded checkpoints with DCP: every rank writes its own shard, any world size reads them back.

`torch.distributed.checkpoint` (DCP) saves a sharded model and optimizer as one file per rank
plus a metadata file describing the global tensors, so a checkpoint written by 2 ranks loads onto
1, 4 or 8. This script trains an FSDP2 model, saves it blocking and asynchronously (training goes
on while the write runs), reloads both and compares, writes a delta checkpoint of a sparsely
updated embedding, and puts every size beside its formula. DCP checks no checksum and un-pickles
its `.metadata`: every folder here gets a SHA-256 manifest (written last, after an async save's
future completes), is verified before it is loaded, and is read through a restricted unpickler
(`common.checkpoint`); the time to hash and to verify is measured beside the save's.

Run:
    python chapters/ch12_checkpointing/train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch12_checkpointing/train.py
    torchrun --standalone --nproc_per_node=4 chapters/ch12_checkpointing/train.py \\
        --load-from runs/ch12_checkpointing/train/dcp     # reshard a 2-rank checkpoint onto 4
    torchrun --standalone --nproc_per_node=8 chapters/ch12_checkpointing/train.py --d-hidden 4096  # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch12_checkpointing/train.py --out /shared/fs/ch12     # --out on a shared file system
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch12_checkpointing/train.py --out /shared/fs/ch12
"""

import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from chapters.ch12_checkpointing import checks
from chapters.ch12_checkpointing import delta as deltas
from chapters.ch12_checkpointing.checks import max_state_diff, planned_reads, save_local_shards
from chapters.ch12_checkpointing.sharded_model import build_sharded, train_steps
from common.checkpoint import (
    CheckpointError,
    check_identity,
    commit_dcp_manifest,
    error_line,
    load_checkpoint,
    load_dcp,
    run_id,
    save_checkpoint,
    training_shapes,
    verify_dcp,
)
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors on rank 0, {} elsewhere


@dataclass
class Config(RunConfig):
    steps: int = 4
    """Training steps before the blocking save."""
    async_steps: int = 3
    """Training steps run while the asynchronous save writes in the background."""
    d_in: int = 32
    """Input features of the MLP."""
    d_hidden: int = 256
    """Hidden width of the MLP (its parameters dominate the checkpoint)."""
    batch_size: int = 32
    """Samples per step, on every rank."""
    vocab: int = 8192
    """Rows of the embedding table of the delta demonstration."""
    touched_tokens: int = 64
    """Tokens (rows) the sparse fine-tuning updates between base and delta."""
    save_repeats: int = 3
    """Timed saves of each kind, after one untimed warm-up save of each kind (first-call costs)."""
    load_from: str = ""
    """Only load this DCP checkpoint (written with any world size, by the run whose --out this is) and compare it to its full_state.pt."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.async_steps < 1 or self.touched_tokens < 1 or self.save_repeats < 1:
            raise ValueError("--async-steps, --touched-tokens and --save-repeats must be at least 1")
        if self.touched_tokens > self.vocab:
            raise ValueError(f"--touched-tokens cannot exceed --vocab={self.vocab}")


def validate(cfg: Config, world_size: int) -> None:
    """Nothing depends on the world size: the batch is per rank, FSDP2 shards rows unevenly when
    the world does not divide them (the 1-row output layer lives on rank 0 alone), and DCP
    reshards a checkpoint onto any world."""


def sharded_state(model, opt) -> dict:
    """Model and optimizer as DTensor shards keyed by parameter name (DCP's input)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def full_state(model, opt) -> dict:
    """Whole tensors gathered on rank 0 (a collective: every rank calls it)."""
    model_sd, optim_sd = get_state_dict(model, opt, options=FULL)
    return snapshot({"model": model_sd, "optim": optim_sd})


def snapshot(state):
    """A deep copy: unsharded tensors (Adam's `step`) come back as the LIVE tensors, not copies."""
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    return state.detach().clone() if isinstance(state, torch.Tensor) else state


def verified(path, rid: str, shapes: dict) -> dict:
    """Verify a DCP folder before anything reads it: every file against its manifest (collective:
    the ranks share the hashing), then whose it is (run id, global shapes: any world size passes).
    Returns the manifest."""
    manifest = verify_dcp(path)
    check_identity(manifest, rid, shapes, path)
    return manifest


def load_sharded(path, model, opt, rid: str) -> None:
    """Verify, then read a DCP checkpoint into this world's shards, whatever world size wrote it."""
    verified(path, rid, training_shapes(model, opt))
    state = sharded_state(model, opt)  # the template: which pieces this rank needs
    load_dcp(state, path)  # .metadata through the restricted unpickler, bytes with weights_only
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def adam_template(model) -> dict:
    """Adam's state has each parameter's shape and sharding, so the load template can be built
    without an optimizer (get_state_dict would create one with a zero-lr step)."""
    return {"state": {n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                          "step": torch.tensor(0.0)} for n, p in model.named_parameters()}}


def reshard_check(path, rid: str, cfg: Config | None = None, device: torch.device | None = None) -> dict:
    """Verify `path` (written by any world size, by run `rid`), load it onto this world's shards on
    `device` (default: the CPU); compare the gathered whole with full_state.pt. Returns this
    rank's shard rows, the bytes it read per file and (rank 0) the max difference."""
    cfg = cfg or Config()
    model, opt = build_sharded(cfg, device or torch.device("cpu"))  # opt: for its shapes only
    verified(path, rid, training_shapes(model, opt))
    state = {"model": get_model_state_dict(model), "optim": adam_template(model)}
    reads = planned_reads(state, path)
    load_dcp(state, path)  # each rank reads only the chunks its shards need
    set_model_state_dict(model, state["model"])
    whole = snapshot(tree_map_only(DTensor, lambda t: t.full_tensor().cpu(), state))  # collectives
    shards = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return {"shards": shards, "reads": reads}
    saved = load_checkpoint(Path(path).parent / "full_state.pt")
    saved["optim"].pop("param_groups")  # hyper-parameters, not tensors: not in the template
    return {"shards": shards, "reads": reads, "max_diff": max_state_diff(whole, saved)}


def load_into_one_process(path, rid: str, cfg: Config | None = None) -> dict:
    """No process group at all: a plain model and optimizer read the whole sharded checkpoint
    (what evaluation or export does), verified first. Returns the loaded state."""
    cfg = cfg or Config()
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    verified(path, rid, training_shapes(model, opt))  # one process hashes every file
    state = sharded_state(model, opt)  # plain tensors: one "shard" holding everything
    with warnings.catch_warnings():  # "no process group: assuming one process" is the intent here
        warnings.simplefilter("ignore", UserWarning)
        load_dcp(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return snapshot(sharded_state(model, opt))


@contextmanager
def saving(target):
    """A DCP save that fails (a full disk ends as "failed on ranks 0, 1: No space left on device",
    no path) as one collective CheckpointError naming the folder, as `save_dcp` does. DCP's
    CheckpointException is a BaseException: caught by name."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"saving {target} {error_line(e)}", collective=True) from e


def timed_saves(cfg: Config, model, opt, data, out: Path, info, async_pg, meta: dict) -> dict:
    """Blocking and asynchronous DCP saves of the same state, each kind warmed up once first: the
    first save of a process pays one-time costs (planner and writer set-up, thread pool, first
    files) that would otherwise be charged to whichever kind runs first. Times are the slowest
    rank's (the next collective waits for it), device synchronised. The first timed blocking save
    is `dcp`, the first timed async one `dcp_async` (both hold the state at that moment). Each
    folder gets its manifest once its save has finished (`save_dcp` is `dcp.save` then
    `commit_dcp_manifest`; split here to time the two); an async save's manifest is written after
    its future completes, when every file exists. The blocking saves' manifests and a
    verification of each are timed too."""
    def stall(t) -> float:
        return reduce_number(t.elapsed, "max")

    times = {"block": [], "async": [], "async_total": [], "manifest": [], "verify": []}
    with Timer(info.device) as t, saving(out / "warmup" / "block"):
        dcp.save(sharded_state(model, opt), checkpoint_id=str(out / "warmup" / "block"))
    times["block_cold"] = stall(t)
    commit_dcp_manifest(out / "warmup" / "block", **meta)
    with Timer(info.device) as t, saving(out / "warmup" / "async"):
        dcp.async_save(sharded_state(model, opt), checkpoint_id=str(out / "warmup" / "async"),
                       process_group=async_pg).result()
    times["async_cold"] = stall(t)
    commit_dcp_manifest(out / "warmup" / "async", **meta)
    for i in range(cfg.save_repeats):
        target = out / ("dcp" if i == 0 else f"timing/block{i}")
        with Timer(info.device) as t, saving(target):
            dcp.save(sharded_state(model, opt), checkpoint_id=str(target))
        times["block"].append(stall(t))
        with Timer(info.device) as t:  # each rank hashes its own file; rank 0 writes the manifest
            commit_dcp_manifest(target, **meta)
        times["manifest"].append(stall(t))
        with Timer(info.device) as t:  # the ranks share the files; every file is read and hashed
            verify_dcp(target)
        times["verify"].append(stall(t))
    for i in range(cfg.save_repeats):
        target = out / ("dcp_async" if i == 0 else f"timing/async{i}")
        with Timer(info.device) as staged, saving(target):  # returns once the state is copied aside
            future = dcp.async_save(sharded_state(model, opt), checkpoint_id=str(target),
                                    process_group=async_pg)
        with Timer(info.device) as total:
            train_steps(model, opt, data, cfg.async_steps)  # training goes on during the write
            with saving(target):
                future.result()
        times["async"].append(stall(staged))
        times["async_total"].append(reduce_number(staged.elapsed + total.elapsed, "max"))
        commit_dcp_manifest(target, **{**meta, "step": meta["step"] + i * cfg.async_steps})
    return times


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        if cfg.load_from:  # reshard a checkpoint written by any world size onto this one
            res = reshard_check(cfg.load_from, run_id(rec.out), cfg, info.device)
            checks.record_reshard(rec, res, info.world_size)
            return rec.finish()
        seed_everything(cfg.seed)
        X, Y = regression_data(cfg.batch_size * info.world_size, cfg.d_in, 1, seed=cfg.seed)
        data = (X.chunk(info.world_size)[info.rank].to(info.device),
                Y.chunk(info.world_size)[info.rank].to(info.device))
        model, opt = build_sharded(cfg, info.device)
        loss = train_steps(model, opt, data, cfg.steps)
        log.info("world %d: trained %d steps, loss %.4f; saving", info.world_size, cfg.steps, loss)

        # 1. The whole state beside the sharded saves, for checking; then the timed saves.
        saved = full_state(model, opt)
        if info.is_main:
            save_checkpoint(rec.out / "full_state.pt", saved)
        save_local_shards(model, rec.out / "torch_save_per_rank", info.rank)
        # The writer's collectives stay off training's group; on GPUs async_save also refuses a
        # group without a CPU backend, and an NCCL default group has none.
        async_pg = dist.new_group(backend="gloo")
        rid = run_id(rec.out)  # kept in --out: a later --load-from with this --out is this run
        meta = {"run_id": rid, "step": cfg.steps, "shapes": training_shapes(model, opt)}
        times = timed_saves(cfg, model, opt, data, rec.out, info, async_pg, meta)
        moved_on = full_state(model, opt)

        # 2. Reload both into fresh sharded models (verified first) and compare with the state
        # at save time.
        fresh, fresh_opt = build_sharded(cfg, info.device)
        load_sharded(rec.out / "dcp", fresh, fresh_opt, rid)
        reloaded = full_state(fresh, fresh_opt)  # a collective: outside any `if rank == 0`
        load_sharded(rec.out / "dcp_async", fresh, fresh_opt, rid)
        reloaded_async = full_state(fresh, fresh_opt)
        checks.record_reload(rec, saved, reloaded, reloaded_async, moved_on, info.is_main)

        # 3. Sizes beside the formula, times with their spread.
        checks.record_sizes_and_times(rec, model, times, info.world_size, info.is_main)
        if info.is_main:
            deltas.record_delta(cfg, rec, rec.out)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
