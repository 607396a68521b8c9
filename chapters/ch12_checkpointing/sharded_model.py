"""The model `train.py` checkpoints: the same MLP on every world size, each Linear sharded by
FSDP2, with AdamW, and the steps that train it between saves. Nothing here is about checkpoints;
`train.py` is.

Helper module of chapter 12 (no main guard); `train.py` imports it (the tests reach it through
`train`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from common.models import MLP


def shard_model(cfg, device: torch.device) -> MLP:
    """The same MLP on every world size, each Linear sharded by FSDP2 (dim 0 over the ranks)."""
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def build_sharded(cfg, device: torch.device):
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
