"""Sharded checkpoints with DCP: every rank writes its own shard, any world size reads them back.

`torch.distributed.checkpoint` (DCP) saves a sharded model and optimizer as one file per rank
plus a metadata file describing the global tensors, so a checkpoint written by 2 ranks loads onto
1, 4 or 8. This script trains an FSDP2 model, saves it blocking and asynchronously (training goes
on while the write runs), reloads both and compares, writes a delta checkpoint of a sparsely
updated embedding, and puts every size beside its formula.

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
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from chapters.ch12_checkpointing import delta as deltas
from common.checkpoint import load_checkpoint, save_checkpoint
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import seed_everything

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
    load_from: str = ""
    """Only load this DCP checkpoint (written with any world size) and compare it to its full_state.pt."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.async_steps < 1 or self.touched_tokens < 1:
            raise ValueError("--async-steps and --touched-tokens must be at least 1")
        if self.touched_tokens > self.vocab:
            raise ValueError(f"--touched-tokens cannot exceed --vocab={self.vocab}")


def shard_model(cfg: Config, device: torch.device) -> MLP:
    """The same MLP on every world size, each Linear sharded by FSDP2 (dim 0 over the ranks)."""
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def build_sharded(cfg: Config, device: torch.device):
    model = shard_model(cfg, device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_steps(model, opt, data, steps: int) -> float:
    X, Y = data
    for _ in range(steps):
        loss = F.mse_loss(model(X), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


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


def load_sharded(path, model, opt) -> None:
    """Read a DCP checkpoint into this world's shards, whatever world size wrote it."""
    state = sharded_state(model, opt)  # the template: which pieces this rank needs
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def max_state_diff(a, b) -> float:
    """Max |a − b| over every tensor of two nested state dicts (inf if their structure differs)."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return float("inf")
        return max([max_state_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return float("inf")
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return 0.0 if a == b else float("inf")


def adam_template(model) -> dict:
    """Adam's state has each parameter's shape and sharding, so the load template can be built
    without an optimizer (get_state_dict would create one with a zero-lr step)."""
    return {"state": {n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                          "step": torch.tensor(0.0)} for n, p in model.named_parameters()}}


def reshard_check(path, cfg: Config | None = None) -> dict:
    """Load `path` (written by any world size) onto this world's shards; compare the gathered
    whole with full_state.pt. Returns this rank's shard rows and (rank 0) the max difference."""
    cfg = cfg or Config()
    cuda = torch.cuda.is_available()
    model = shard_model(cfg, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    state = {"model": get_model_state_dict(model), "optim": adam_template(model)}
    dcp.load(state, checkpoint_id=str(path))  # each rank reads only the bytes of its shards
    set_model_state_dict(model, state["model"])
    whole = snapshot(tree_map_only(DTensor, lambda t: t.full_tensor().cpu(), state))  # collectives
    shards = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return {"shards": shards}
    saved = load_checkpoint(Path(path).parent / "full_state.pt")
    saved["optim"].pop("param_groups")  # hyper-parameters, not tensors: not in the template
    return {"shards": shards, "max_diff": max_state_diff(whole, saved)}


def load_into_one_process(path, cfg: Config | None = None) -> dict:
    """No process group at all: a plain model and optimizer read the whole sharded checkpoint
    (what evaluation or export does). Returns the loaded state."""
    cfg = cfg or Config()
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = sharded_state(model, opt)  # plain tensors: one "shard" holding everything
    with warnings.catch_warnings():  # "no process group: assuming one process" is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return snapshot(sharded_state(model, opt))


def save_local_shards(model, path: Path, rank: int) -> Path:
    """What plain torch.save gives you under FSDP: this rank's slice of every tensor, and
    nothing saying how the slices fit together (the limit DCP's metadata removes)."""
    return save_checkpoint(path / f"rank{rank}.pt",
                           {n: p.to_local().clone() for n, p in model.named_parameters()})


def dcp_payload_bytes(path) -> int:
    """Tensor bytes the checkpoint's metadata describes (global shapes × dtype sizes)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    return sum(m.size.numel() * m.properties.dtype.itemsize
               for m in meta.state_dict_metadata.values() if hasattr(m, "size"))


def expected_bytes(n_params: int, n_tensors: int, dtype_bytes: int = 4) -> int:
    """params × dtype (weights) + 2 × params × dtype (Adam's m and v) + one step scalar per tensor."""
    return n_params * dtype_bytes * 3 + n_tensors * 4


def files_bytes(path: Path, pattern: str) -> list[int]:
    return [p.stat().st_size for p in sorted(path.glob(pattern))]


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        if cfg.load_from:  # reshard a checkpoint written by any world size onto this one
            res = reshard_check(cfg.load_from, cfg)
            rec.check(f"loaded on {info.world_size} ranks == saved state", "parity",
                      res.get("max_diff", 0.0), 0.0)
            return rec.finish()
        seed_everything(cfg.seed)
        X, Y = regression_data(cfg.batch_size * info.world_size, cfg.d_in, 1, seed=cfg.seed)
        data = (X.chunk(info.world_size)[info.rank].to(info.device),
                Y.chunk(info.world_size)[info.rank].to(info.device))
        model, opt = build_sharded(cfg, info.device)
        loss = train_steps(model, opt, data, cfg.steps)
        log.info("world %d: trained %d steps, loss %.4f; saving", info.world_size, cfg.steps, loss)

        # 1. Blocking sharded save, with the whole state beside it for checking.
        saved = full_state(model, opt)
        if info.is_main:
            save_checkpoint(rec.out / "full_state.pt", saved)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sharded_state(model, opt), checkpoint_id=str(rec.out / "dcp"))
        t_block = time.perf_counter() - t0
        save_local_shards(model, rec.out / "torch_save_per_rank", info.rank)

        # 2. Asynchronous save: returns after staging a copy; training goes on during the write.
        async_pg = dist.new_group(backend="gloo")  # the writer's collectives stay off training's group
        t0 = time.perf_counter()
        future = dcp.async_save(sharded_state(model, opt), checkpoint_id=str(rec.out / "dcp_async"),
                                process_group=async_pg)
        t_async = time.perf_counter() - t0
        train_steps(model, opt, data, cfg.async_steps)
        future.result()
        t_async_total = time.perf_counter() - t0
        moved_on = full_state(model, opt)

        # 3. Reload both into fresh sharded models and compare with the state at save time.
        fresh, fresh_opt = build_sharded(cfg, info.device)
        load_sharded(rec.out / "dcp", fresh, fresh_opt)
        reloaded = full_state(fresh, fresh_opt)  # a collective: outside any `if rank == 0`
        load_sharded(rec.out / "dcp_async", fresh, fresh_opt)
        reloaded_async = full_state(fresh, fresh_opt)
        blocking_diff = max_state_diff(reloaded, saved) if info.is_main else 0.0
        async_diff = max_state_diff(reloaded_async, saved) if info.is_main else 0.0
        drift = max_state_diff(moved_on["model"], saved["model"]) if info.is_main else 1.0
        rec.check("DCP reload == saved state (max |diff|)", "parity", blocking_diff, 0.0)
        rec.check("async DCP reload == state at save time", "parity", async_diff, 0.0)
        rec.check("training moved on during the async write", "parity", drift, 0.0, compare=">")

        # 4. Sizes beside the formula.
        n_params = sum(p.numel() for p in model.parameters())
        n_tensors = len(list(model.parameters()))
        expected = expected_bytes(n_params, n_tensors)
        rec.check("DCP tensor bytes = params x 4 x (1 + 2 Adam) + steps", "formula",
                  dcp_payload_bytes(rec.out / "dcp"), expected)
        shard_files = files_bytes(rec.out / "dcp", "*.distcp")
        rec.figure("DCP shard files", shard_files, expected=expected / info.world_size, unit="bytes")
        rec.figure("DCP all files", sum(files_bytes(rec.out / "dcp", "*")), expected=expected, unit="bytes")
        rec.figure("torch.save of the full state", (rec.out / "full_state.pt").stat().st_size
                   if info.is_main else 0, expected=expected, unit="bytes")
        rec.figure("blocking save", t_block * 1e3, unit="ms")
        rec.figure("async save: time training waits", t_async * 1e3, unit="ms")
        rec.figure("async save: until written", t_async_total * 1e3, unit="ms")
        rec.check("async blocks training less than a blocking save", "timing", t_async * 1e3,
                  t_block * 1e3, compare="<")
        if info.is_main:
            deltas.record_delta(cfg, rec, rec.out)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
