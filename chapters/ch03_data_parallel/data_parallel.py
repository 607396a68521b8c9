"""Data parallelism itself, as chapter 03 writes it: each rank's shard of the global batch, the
gradient average by hand (one all-reduce per parameter tensor), and DDP with its all-reduce
registered as a hook that `AllReduceTap` can see. train.py and token_loss.py train with these;
later chapters import `all_reduce_gradients` from here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def micro_batches(x: torch.Tensor, rank: int, world_size: int, k: int) -> list[torch.Tensor]:
    """This rank's contiguous shard of a global batch, cut into k equal micro-batches."""
    shard = x.chunk(world_size)[rank]
    return list(shard.chunk(k))


def all_reduce_gradients(model: nn.Module, world_size: int) -> None:
    """The whole of data parallelism: average every gradient over the ranks (one all-reduce
    per parameter tensor; `AllReduceTap` counts them where they are made)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size


def wrap_ddp(model: nn.Module, info) -> DDP:
    """DDP, with its default all-reduce registered as a Python communication hook (the same
    division by W and SUM that its C++ reducer does) so that `AllReduceTap` sees it."""
    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest difference between two models' parameters: every parity check's measure."""
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
