"""FSDP2 against DDP on the same Llama, the same batches and the same optimizer, in float32.

Both wrap the model built from the same seed; each step every rank takes its slice of the same
global batch, clips the global gradient norm and takes an AdamW step. DDP all-reduces whole
gradients and keeps a whole copy of every parameter and optimizer state on every rank; FSDP2
reduce-scatters them and keeps a 1/N shard. The arithmetic differs only in the order of the
sums (the gradient reduction, the norm for clipping), so the two runs agree to a few float32
rounding errors per step (the lesson derives the tolerance). A negative control, DDP whose
gradients are never all-reduced (every backward under `no_sync`), is rejected by the same check.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch25_llm.model import apply_fsdp, build_model, lr_at

ADAM_EPS = 1e-8  # AdamW's epsilon (torch's default), part of the tolerance's derivation


def batch_starts(n_ids: int, step: int, global_size: int, seq_len: int, seed: int) -> list[int]:
    """Where the step's windows start: uniformly at random, with replacement, from the step's
    own generator (the same on every rank, a function of the step alone)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_ids - seq_len - 1, (global_size,), generator=g).tolist()


def global_batch(ids: torch.Tensor, step: int, global_size: int, seq_len: int, seed: int):
    """The step's global batch of (input, target) windows: the same on every rank, a function
    of the step alone (so a resumed run reads exactly the batches it would have read)."""
    starts = batch_starts(len(ids), step, global_size, seq_len, seed)
    x = torch.stack([ids[s:s + seq_len] for s in starts])
    y = torch.stack([ids[s + 1:s + 1 + seq_len] for s in starts])
    return x, y


def sequential_starts(n_ids: int, step: int, global_size: int, seq_len: int,
                      seed: int = 0) -> list[int]:
    """The control sampler: windows read in order, back to back, without replacement (a
    sequential sampler; `seed` unused): no target repeats within a pass over the corpus."""
    per_pass = (n_ids - 1) // seq_len
    return [((step * global_size + i) % per_pass) * seq_len for i in range(global_size)]


def seen_fraction(n_ids: int, steps: range, global_size: int, seq_len: int, seed: int,
                  starts=batch_starts) -> float:
    """Of the target tokens of the batches of `steps`, the fraction already a target in an earlier
    step's batch (counted position by position): how much of a training batch the model has
    already been trained on when it is scored. `starts` is the sampler (`batch_starts`, the
    run's; `sequential_starts`, the control's)."""
    covered = torch.zeros(n_ids, dtype=torch.bool)
    for step in range(steps.start):
        for s in starts(n_ids, step, global_size, seq_len, seed):
            covered[s + 1:s + 1 + seq_len] = True
    seen = total = 0
    for step in steps:
        starts_now = starts(n_ids, step, global_size, seq_len, seed)
        for s in starts_now:
            seen += int(covered[s + 1:s + 1 + seq_len].sum())
            total += seq_len
        for s in starts_now:
            covered[s + 1:s + 1 + seq_len] = True
    return seen / total


def expected_seen_fraction(n_ids: int, step: int, global_size: int, seq_len: int) -> float:
    """The same, in closed form, for the batch of `step`: a target position is covered by one
    earlier window with probability T/(n − T − 1), so by at least one of the step·B earlier
    windows with 1 − (1 − T/(n − T − 1))^(step·B) (ends of the corpus neglected)."""
    return 1 - (1 - seq_len / (n_ids - seq_len - 1)) ** (step * global_size)


def seen_tolerance(p: float, windows: int) -> float:
    """Four standard errors of a fraction averaged over `windows` windows: one window's fraction
    lies in [0, 1] with mean p, so its variance is at most p(1 − p) (Bhatia–Davis); the windows
    are drawn independently."""
    return 4 * (p * (1 - p) / windows) ** 0.5


def rank_slice(batch, rank: int, world_size: int):
    """This rank's contiguous share of a global batch."""
    return tuple(t.chunk(world_size)[rank] for t in batch)


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token). `use_cache=False`: a training forward must
    not grow a KV cache (with activation checkpointing the recomputed forward would append to it
    a second time)."""
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def eval_loss(model, ids, micro_batch_size: int, seq_len: int, seed: int, device,
              batches: int = 4) -> float:
    """Mean loss on held-out windows (the last tenth of the corpus), the same on every rank."""
    total = 0.0
    for b in range(batches):
        x, y = global_batch(ids, 10_000 + b, micro_batch_size, seq_len, seed)
        total += lm_loss(model, x.to(device), y.to(device)).item()
    return total / batches


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU (FSDP2's are DTensor shards: gathered)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = t.detach().cpu().clone()
    return out


def train_wrapped(kind: str, config, ids, steps: int, micro_batch_size: int, seq_len: int,
                  lr: float, seed: int, device: torch.device,
                  dtype: torch.dtype = torch.float32) -> dict:
    """Train `steps` steps wrapped as `kind`: "fsdp2", "ddp", "ddp-nosync" (the broken control)
    or "fsdp2-fp32-reduce" (a subtly wrong mixed-precision policy: gradients summed in float32
    in a `dtype` run), in `dtype`. Returns the losses (global means) and the final parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(config, seed, device).to(dtype)
    if kind.startswith("fsdp2"):
        reduce = torch.float32 if kind == "fsdp2-fp32-reduce" else dtype
        apply_fsdp(model, param_dtype=dtype, reduce_dtype=reduce)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=ADAM_EPS,
                            weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = rank_slice(global_batch(ids, step, micro_batch_size * world, seq_len, seed),
                          rank, world)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, max(1, steps // 2), steps)
        with model.no_sync() if kind == "ddp-nosync" else nullcontext():
            loss = lm_loss(model, x.to(device), y.to(device))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # on the model's device: NCCL takes CUDA tensors only
        losses.append(total.item() / world)
    inner = model if kind.startswith("fsdp2") else model.module
    return {"losses": losses, "params": full_params(inner)}


def compare(config, ids, steps: int, micro_batch_size: int, seq_len: int, lr: float,
            seed: int, device: torch.device, dtype: torch.dtype = torch.float32,
            kinds=("fsdp2", "ddp", "ddp-nosync")) -> dict:
    """The runs (by default FSDP2, DDP, DDP without gradient sync) from the same start."""
    return {kind: train_wrapped(kind, config, ids, steps, micro_batch_size, seq_len, lr, seed,
                                device, dtype)
            for kind in kinds}


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def layers_resharded_after_forward(config, ids, seq_len: int, micro_batch_size: int,
                                   device: torch.device, reshard_after_forward: bool = True) -> bool:
    """After one forward (backward still to come), is every decoder layer's parameter a DTensor
    shard again? FSDP2 swaps each module's parameters to whole tensors while it is unsharded and
    back to its shards when it reshards: what frees a layer's gathered weights between its
    forward and its backward."""
    from torch.distributed.tensor import DTensor

    from chapters.ch25_llm.model import decoder_layers

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(config, 0, device)
    apply_fsdp(model, param_dtype=torch.float32, reshard_after_forward=reshard_after_forward)
    x, _ = rank_slice(global_batch(ids, 0, micro_batch_size * world, seq_len, 0), rank, world)
    model(input_ids=x.to(device), use_cache=False)
    return all(isinstance(p, DTensor) for layer in decoder_layers(model) for p in layer.parameters())


def worker(steps: int = 4, vocab_size: int = 512) -> dict:
    """For tests (run on gloo ranks by `common.launch.run_on_ranks`): the three runs on the cpu
    preset's model with a `vocab_size` tokenizer; parameters returned by rank 0 only."""
    from chapters.ch25_llm import tokenizer
    from chapters.ch25_llm.model import PRESETS, llama_config

    p = PRESETS["cpu"]
    train_text, _ = tokenizer.corpus_split()
    tok = tokenizer.train_tokenizer(train_text[:100_000], vocab_size)
    ids = tokenizer.encode(tok, train_text[:100_000])
    config = llama_config(vocab_size, p["hidden_size"], p["n_layers"], p["n_heads"],
                          p["n_kv_heads"], p["ffn_size"], p["seq_len"])
    runs = compare(config, ids, steps, p["micro_batch_size"], p["seq_len"], p["lr"], 0,
                   torch.device("cpu"))
    # the same in float64, where rounding is 2^-29 times smaller: a tight check, and a control
    # that only such a check sees (gradients reduced in float32: a wrong mixed-precision policy)
    runs64 = compare(config, ids, steps, p["micro_batch_size"], p["seq_len"], p["lr"], 0,
                     torch.device("cpu"), torch.float64, ("fsdp2", "ddp", "fsdp2-fp32-reduce"))
    if dist.get_rank() != 0:
        for run in (*runs.values(), *runs64.values()):
            run.pop("params")
    resharded = {keep: layers_resharded_after_forward(config, ids, p["seq_len"],
                                                      p["micro_batch_size"], torch.device("cpu"),
                                                      reshard_after_forward=keep)
                 for keep in (True, False)}
    return {"runs": runs, "runs64": runs64, "ids": ids, "config": config.to_dict(),
            "resharded": resharded}
