"""Loss normalisation when ranks and micro-batches hold different numbers of tokens.

With padded sequences, each micro-batch holds a different number of real tokens. The loss one
process would compute is the mean over *all* tokens of the global batch. Taking the mean per
micro-batch and letting DDP average over ranks weights every micro-batch equally instead, so
tokens in short micro-batches count more: a silent bug that still trains, just wrongly.
The fix: divide each micro-batch's summed loss by the global token count (one all-reduce of an
integer per step), times world_size because DDP averages gradients over the ranks. The
micro-batches accumulate under `no_sync`, as in train.py: the gradients add up locally and only
the last micro-batch's backward all-reduces them, which changes nothing in the sum.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist

from chapters.ch03_data_parallel.data_parallel import max_param_diff, micro_batches, wrap_ddp
from chapters.ch03_data_parallel.tap import AllReduceTap
from common.models import MLP

SEQ_LEN = 8


def token_batches(cfg, device: torch.device):
    """Per-token regression on padded sequences: x (steps, B, T, d), y (steps, B, T, 1) and a
    mask (steps, B, T) of real tokens; lengths are random in 1..T, so counts differ."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    dtype = getattr(torch, cfg.dtype)
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


def micro_batch_loss(ddp, xb, yb, mb, normalise: str, local_tokens, global_tokens, k: int,
                     world_size: int) -> torch.Tensor:
    """One micro-batch's share of the step's loss, by the chosen normalisation."""
    if normalise == "global":  # the fix: x W, because DDP divides the summed gradients by W
        return summed_token_loss(ddp, xb, yb, mb) * world_size / global_tokens
    if normalise == "local":
        return summed_token_loss(ddp, xb, yb, mb) / local_tokens
    if normalise == "naive":
        return summed_token_loss(ddp, xb, yb, mb) / mb.sum() / k
    raise ValueError(f"normalise must be global, local or naive, not {normalise!r}")


def train_tokens_ddp(model, x, y, mask, cfg, info, normalise: str) -> dict:
    """DDP over micro-batches, the first k-1 under `no_sync`; `normalise` is "global" (the fix:
    the global token count), "naive" (a mean per micro-batch) or "local" (the rank's own token
    count, exercise 4). Returns this rank's token count at each step and the all-reduces the
    tap saw during each micro-batch."""
    ddp = wrap_ddp(model, info)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.base_lr)
    k, counts, calls_per_micro = cfg.grad_accum_steps, [], []
    with AllReduceTap() as tap:
        for step in range(cfg.steps):
            parts = [micro_batches(t[step], info.rank, info.world_size, k) for t in (x, y, mask)]
            local_tokens = sum(m.sum() for m in parts[2])
            global_tokens = local_tokens.clone()
            dist.all_reduce(global_tokens)  # every rank needs the same denominator
            counts.append(int(local_tokens))
            opt.zero_grad()
            for j, (xb, yb, mb) in enumerate(zip(*parts)):
                before = tap.calls
                with nullcontext() if j == k - 1 else ddp.no_sync():  # accumulate locally
                    micro_batch_loss(ddp, xb, yb, mb, normalise, local_tokens, global_tokens, k,
                                     info.world_size).backward()
                calls_per_micro.append(tap.calls - before)
            opt.step()
    return {"tokens": counts, "calls_per_micro": calls_per_micro}


def compare(cfg, info, modes=("global", "naive")) -> dict:
    """Max |Δparam| against one process for each normalisation in `modes`, each rank's token
    count at each step, and the trained parameters ("states": mode -> state_dict; a test
    compares them with a reference of its own)."""
    x, y, mask = token_batches(cfg, info.device)
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, 16, 1, n_layers=2).to(info.device, getattr(torch, cfg.dtype))
    reference = copy.deepcopy(model)
    train_tokens_single(reference, x, y, mask, cfg)
    result, states, k = {}, {}, cfg.grad_accum_steps
    for normalise in modes:
        replica = copy.deepcopy(model)
        log = train_tokens_ddp(replica, x, y, mask, cfg, info, normalise)
        result[normalise] = max_param_diff(replica, reference)
        states[normalise] = {n: v.detach().cpu() for n, v in replica.state_dict().items()}
        if normalise == "global":  # the fix's collectives: none inside no_sync, a bucket after
            calls = log["calls_per_micro"]
            result["calls_inside_no_sync"] = sum(c for i, c in enumerate(calls) if i % k != k - 1)
            result["calls_last_micro"] = sum(c for i, c in enumerate(calls) if i % k == k - 1)
    result["states"] = states
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, log["tokens"])
    result["tokens_per_rank"] = gathered  # [rank][step]
    return result
