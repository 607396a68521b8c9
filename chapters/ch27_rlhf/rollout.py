"""A batch of rollouts from its sampling to its score, the path opposite to `sync.py`'s weight
push: a generating rank samples groups of completions and packs them as float64 rows
(`rollouts`), the rows are gathered on the trainer (`exchange`), which unpacks and scores them
(`unpack`): by the program's reward, or by the Bradley–Terry reward model (`reward_model`,
trained on rank 0 and placed where rollouts are scored).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chapters.ch27_rlhf import rl, sync
from common.distributed import broadcast_from_rank0
from common.results import RunRecorder


def rollouts(model, cfg, gen: torch.Generator, version: int, device) -> torch.Tensor:
    """`prompts_per_rank` targets, each repeated group_size times, sampled from `model`; packed
    as float64 rows [target, digits, old log-probs, weights version] for the trip to the trainer."""
    targets = torch.randint(0, rl.MAX_TARGET + 1, (cfg.prompts_per_rank,), generator=gen)
    targets = targets.repeat_interleave(cfg.group_size).to(device)
    digits, logp = rl.sample(model, targets, gen)
    v = torch.full_like(targets, version)
    return torch.cat([targets[:, None], digits, logp, v[:, None]], dim=1).to(torch.float64)


def exchange(mine, cfg, info) -> list | None:
    """Generators send their rollouts to the trainer (a gather); the trainer receives them all."""
    rows = cfg.prompts_per_rank * cfg.group_size
    send = mine if mine is not None else torch.zeros(rows, 2 + 2 * cfg.length, dtype=torch.float64,
                                                      device=info.device)
    parts = [torch.empty_like(send) for _ in range(info.world_size)] if info.is_main else None
    dist.gather(send, parts, dst=sync.TRAINER)
    return parts


def unpack(rows: torch.Tensor, cfg, rm=None) -> dict:
    """Rows back to a batch; `rewards` is the program's reward (what the lesson measures),
    `scores` what drives RL (the same, or the reward model's score)."""
    L = cfg.length
    batch = {"targets": rows[:, 0].long(), "digits": rows[:, 1:1 + L].long(),
             "old_logp": rows[:, 1 + L:1 + 2 * L].float(), "version": rows[:, -1].long()}
    batch["rewards"] = rl.reward(batch["targets"], batch["digits"])
    if rm is None:
        batch["scores"] = batch["rewards"]
    else:
        with torch.no_grad():
            batch["scores"] = rm(batch["targets"], batch["digits"]).float()
    return batch


def reward_model(rec: RunRecorder, cfg, info, where: str):
    """Bradley–Terry on preference pairs labelled by the verifiable reward, trained on rank 0 and
    checked by its ranking accuracy; returned where it scores rollouts (`--reward model`): on the
    trainer, and on every rank when colocated (broadcast from rank 0)."""
    if not cfg.rm_steps:
        return None
    if info.rank == 0:
        rm, accuracy = rl.train_reward_model(cfg.rm_steps, cfg.length, cfg.seed)
        rec.check("reward model ranks held-out pairs (accuracy) >= 0.8", "count", round(accuracy, 4),
                  0.8, compare=">=")
    else:
        rm = rl.RewardModel(cfg.length)
    if cfg.reward != "model":
        return None
    rm = rm.to(info.device).requires_grad_(False)
    if where == "colocated" and info.world_size > 1:
        broadcast_from_rank0(rm)
    return rm
