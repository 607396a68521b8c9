"""Loss normalisation when ranks and micro-batches hold different numbers of tokens.

With padded sequences, each micro-batch holds a different number of real tokens. The loss one
process would compute is the mean over *all* tokens of the global batch. Taking the mean per
micro-batch and letting DDP average over ranks weights every micro-batch equally instead, so
tokens in short micro-batches count more: a silent bug that still trains, just wrongly.
The fix: divide each micro-batch's summed loss by the global token count (one all-reduce of an
integer per step), times world_size because DDP averages gradients over the ranks.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch03_data_parallel.train import DTYPES, max_param_diff, micro_batches
from common.models import MLP

SEQ_LEN = 8


def token_batches(cfg, device: torch.device):
    """Per-token regression on padded sequences: x (steps, B, T, d), y (steps, B, T, 1) and a
    mask (steps, B, T) of real tokens; lengths are random in 1..T, so counts differ."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    dtype = DTYPES[cfg.dtype]
    shape = (cfg.steps, cfg.global_batch_size, SEQ_LEN)
    x = torch.randn(*shape, cfg.d_in, generator=g, dtype=torch.float64)
    y = x.sum(-1, keepdim=True).sin() + 0.1 * torch.randn(*shape, 1, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, SEQ_LEN + 1, shape[:2], generator=g)
    mask = (torch.arange(SEQ_LEN) < lengths[..., None]).to(torch.float64)
    return x.to(device, dtype), y.to(device, dtype), mask.to(device, dtype)


def summed_token_loss(model, x, y, mask) -> torch.Tensor:
    """Squared error summed over the real tokens (padding masked out)."""
    return (((model(x) - y) ** 2).squeeze(-1) * mask).sum()


def train_tokens_single(model, x, y, mask, cfg) -> None:
    """Reference: one process, loss = mean over every real token of the global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=cfg.base_lr)
    for step in range(cfg.steps):
        opt.zero_grad()
        (summed_token_loss(model, x[step], y[step], mask[step]) / mask[step].sum()).backward()
        opt.step()


def train_tokens_ddp(model, x, y, mask, cfg, info, normalise: str) -> list[int]:
    """DDP over micro-batches; `normalise` is "global" (the fix: the global token count),
    "naive" (a mean per micro-batch) or "local" (the rank's own token count, exercise 4).
    Returns this rank's token count at each step."""
    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.base_lr)
    k, counts = cfg.grad_accum_steps, []
    for step in range(cfg.steps):
        parts = [micro_batches(t[step], info.rank, info.world_size, k) for t in (x, y, mask)]
        local_tokens = sum(m.sum() for m in parts[2])
        global_tokens = local_tokens.clone()
        dist.all_reduce(global_tokens)  # every rank needs the same denominator
        counts.append(int(local_tokens))
        opt.zero_grad()
        for xb, yb, mb in zip(*parts):
            if normalise == "global":
                loss = summed_token_loss(ddp, xb, yb, mb) * info.world_size / global_tokens
            elif normalise == "local":
                loss = summed_token_loss(ddp, xb, yb, mb) / local_tokens
            elif normalise == "naive":
                loss = summed_token_loss(ddp, xb, yb, mb) / mb.sum() / k
            else:
                raise ValueError(f"normalise must be global, local or naive, not {normalise!r}")
            loss.backward()
        opt.step()
    return counts


def compare(cfg, info, modes=("global", "naive")) -> dict:
    """Max |Δparam| against one process for each normalisation in `modes`, each rank's token
    count at each step, and the trained parameters ("states": mode -> state_dict; a test
    compares them with a reference of its own)."""
    x, y, mask = token_batches(cfg, info.device)
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, 16, 1, n_layers=2).to(info.device, DTYPES[cfg.dtype])
    reference = copy.deepcopy(model)
    train_tokens_single(reference, x, y, mask, cfg)
    result, states = {}, {}
    for normalise in modes:
        replica = copy.deepcopy(model)
        counts = train_tokens_ddp(replica, x, y, mask, cfg, info, normalise)
        result[normalise] = max_param_diff(replica, reference)
        states[normalise] = {k: v.detach().cpu() for k, v in replica.state_dict().items()}
    result["states"] = states
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, counts)
    result["tokens_per_rank"] = gathered  # [rank][step]
    return result
