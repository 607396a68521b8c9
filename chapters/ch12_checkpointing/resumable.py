"""The training run `resume_dcp.py` checkpoints, and its state as one DCP state dict: an FSDP2
MLP with dropout (each rank its own dropout stream) on its DistributedSampler shard, AdamW and a
cosine schedule; the loop, whose data position (epoch, batch) names the next batch; and the
training state, sharded model and optimizer, replicated scheduler and progress, and each rank's
RNG state under a rank-keyed entry (one shared key is the broken variant).

Helper module of chapter 12 (no main guard); `resume_dcp.py`, its checks and the tests import it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common.checkpoint import load_dcp
from common.data import regression_data
from common.seed import capture_rng_state, restore_rng_state, seed_everything

D_IN = 16


def mlp(cfg) -> nn.Sequential:
    """The model, unsharded: an MLP with dropout."""
    return nn.Sequential(nn.Linear(D_IN, cfg.d_hidden), nn.ReLU(), nn.Dropout(cfg.dropout),
                         nn.Linear(cfg.d_hidden, cfg.d_hidden), nn.ReLU(), nn.Dropout(cfg.dropout),
                         nn.Linear(cfg.d_hidden, 1))


def build(cfg, device: torch.device, seed: int):
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


def new_run(cfg, device: torch.device, seed: int, own_loader_rng: bool = True) -> dict:
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


def batches(cfg, run: dict):
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


def train(cfg, run: dict, until: int) -> list[float]:
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
