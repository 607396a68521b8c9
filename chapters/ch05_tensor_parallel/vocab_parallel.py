"""The two ends of a language model split over the vocabulary: a vocabulary-parallel embedding
and a vocabulary-parallel cross-entropy ("loss parallel"), by hand and with DTensor.

The embedding table (V × h) is split by rows: rank r holds the tokens [r·V/t, (r+1)·V/t). Each
rank looks up the tokens it holds, writes zeros for the others, and one all-reduce (g) sums the
rows into the whole embedding. The LM head (h → V) is column-parallel: rank r computes the
logits of its V/t tokens. Gathering the B·S·V logits to take a softmax would move a tensor V
times larger than needed; instead the cross-entropy is computed on the shards with three
all-reduces of B·S numbers each: the row maxima, the sums of exponentials and the target's
logit (Megatron's `vocab_parallel_cross_entropy`; DTensor's `loss_parallel`).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch05_tensor_parallel import tp_comm, tp_layers


class DenseLM(nn.Module):
    """Embedding then LM head: the single-device reference, its loss F.cross_entropy. (The
    blocks of the rest of the chapter sit between the two in a real model.)"""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Dense logits; under DTensor's `loss_parallel()` the same call takes logits sharded
        on the vocabulary."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding table; tokens outside the range give zeros here and
    their rows come from the rank that holds them, through the all-reduce."""

    def __init__(self, vocab_size: int, d_model: int, rank: int, tp: int):
        super().__init__()
        self.start, self.end = rank * vocab_size // tp, (rank + 1) * vocab_size // tp
        self.weight = nn.Parameter(torch.empty(self.end - self.start, d_model))
        self.weight.tensor_parallel = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_layers.reduce_from_tp(rows)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from this rank's logit columns [start, start + V/t). Three
    all-reduces of one number per token; the gradient (softmax − one-hot) is local."""

    @staticmethod
    def forward(ctx, logits, targets, start):
        # Any constant common to all ranks keeps exp() finite; a per-rank max would not be
        # common, and the sums of exponentials of different ranks could not be added.
        z = logits - tp_layers.all_reduce(logits.max(dim=-1).values, op="max").unsqueeze(-1)
        outside = (targets < start) | (targets >= start + logits.shape[-1])
        local = (targets - start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = tp_layers.all_reduce(target_logit)
        exp = z.exp()
        sum_exp = tp_layers.all_reduce(exp.sum(dim=-1))
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1),
                                                     (~outside).to(softmax.dtype).unsqueeze(-1))
        return (softmax - one_hot) * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int) -> torch.Tensor:
    return VocabParallelCrossEntropy.apply(logits, targets, start)


class VocabParallelLM(nn.Module):
    """DenseLM split over the vocabulary: the embedding by rows, the head by output columns."""

    def __init__(self, vocab_size: int, d_model: int, rank: int, tp: int):
        super().__init__()
        self.embed = VocabParallelEmbedding(vocab_size, d_model, rank, tp)
        self.head = tp_layers.ColumnParallelLinear(d_model, vocab_size // tp, sequence_parallel=False,
                                                   bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))  # (B, S, V/t): never gathered

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.embed.start)
        return losses.mean()  # every rank holds every token's loss


def shard_lm_state(dense: dict, rank: int, tp: int) -> dict:
    """This rank's VocabParallelLM tensors from a DenseLM's: both weights by rows (tokens)."""
    return {name: t.chunk(tp, dim=0)[rank] for name, t in dense.items()}


def lm_plan() -> dict:
    """The same split with DTensor: RowwiseParallel on an nn.Embedding shards the table by rows
    (vocabulary) and masks out-of-range tokens; the head's logits stay sharded on the vocabulary
    (`use_local_output=False` keeps them a DTensor) for `loss_parallel`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"embed": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


def make_tokens(cfg, device: torch.device):
    """Input tokens and next-token targets, (steps, B, S), the same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 2)
    shape = (cfg.steps, cfg.batch_size, cfg.seq_len)
    tokens, targets = (torch.randint(cfg.vocab_size, shape, generator=g) for _ in range(2))
    return tokens.to(device), targets.to(device)


def train_lm(model: nn.Module, data, cfg, kind: str) -> dict:
    """SGD on the mean cross-entropy. DTensor's loss runs inside `loss_parallel()` (forward and
    backward), so F.cross_entropy works on vocabulary-sharded logits. Step 0 keeps the
    gradients and the collectives of each phase."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from chapters.ch05_tensor_parallel import dtensor_tp

    tokens, targets = data
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    out, losses = {"modes": {}}, []
    context = loss_parallel if kind == "dtensor" else nullcontext
    for step in range(cfg.steps):
        tp_comm.COMM.reset()
        modes = out["modes"] if kind == "dtensor" and step == 0 else None
        with context():
            with dtensor_tp.phase("forward", modes):
                logits = model(tokens[step])
            with dtensor_tp.phase("loss", modes):
                loss = model.loss(logits, targets[step])
            with dtensor_tp.phase("backward", modes):
                loss.backward()
        if step == 0:
            with dtensor_tp.phase("inspection"):
                out.update(grads={n: dtensor_tp.to_full(p.grad) for n, p in model.named_parameters()},
                           comm=copy.deepcopy(tp_comm.COMM))
        opt.step()
        opt.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    out.update(final=dtensor_tp.full_state(model), losses=losses, params_held=dtensor_tp.local_numel(model))
    return out


def train_lm_versions(cfg, info, dtype: torch.dtype) -> dict:
    """The dense LM, the hand-written vocabulary-parallel one and DTensor's, from the same
    weights on the same tokens."""
    from torch.distributed.tensor.parallel import parallelize_module

    from chapters.ch05_tensor_parallel import dtensor_tp

    torch.manual_seed(cfg.seed + 3)
    dense = DenseLM(cfg.vocab_size, cfg.d_model).to(info.device, dtype)
    data = make_tokens(cfg, info.device)
    hand = VocabParallelLM(cfg.vocab_size, cfg.d_model, info.rank, info.world_size).to(info.device, dtype)
    hand.load_state_dict(shard_lm_state(dense.state_dict(), info.rank, info.world_size))
    dtensor = parallelize_module(copy.deepcopy(dense), dtensor_tp.make_mesh(info), lm_plan())
    return {"dense": train_lm(copy.deepcopy(dense), data, cfg, "dense"),
            "hand": train_lm(hand, data, cfg, "hand"),
            "DTensor": train_lm(dtensor, data, cfg, "dtensor")}


def record_lm(rec, lm: dict, cfg, rank: int, tp: int) -> None:
    """Parity with the dense LM; collectives and bytes against the formulas (N = B·S tokens):
    forward one all-reduce of N·h (embedding), the loss three of N, backward one of N·h (the
    head's f); parameters held 2·V·h/t. A loss on gathered logits would all-gather N·V."""
    from chapters.ch05_tensor_parallel import checks, dtensor_tp

    ref, tol = lm["dense"], checks.tolerance(cfg)
    N, h, V = cfg.batch_size * cfg.seq_len, cfg.d_model, cfg.vocab_size
    b = torch.finfo(checks.dtype_of(cfg)).bits // 8
    for name, label in (("hand", "vocab-parallel LM, hand"), ("DTensor", "vocab-parallel LM, DTensor")):
        run = lm[name]
        state = (lambda s: shard_lm_state(s, rank, tp)) if name == "hand" else (lambda s: s)
        rec.check(f"{label}: losses == dense", "parity",
                  max(abs(x - y) for x, y in zip(run["losses"], ref["losses"])), 0.0, tol)
        rec.check(f"{label}: gradients == dense", "parity",
                  checks.max_diff(run["grads"], state(ref["grads"])), 0.0, tol)
        rec.check(f"{label}: trained == dense", "parity",
                  checks.max_diff(run["final"], state(ref["final"])), 0.0, tol)
        rec.check(f"{label}: parameter elements held per rank = 2Vh/t", "formula",
                  run["params_held"], 2 * V * h // tp)
    comm = lm["hand"]["comm"]
    for phase, calls, nbytes, formula in (("forward", 1, N * h * b, "N*h*b"), ("loss", 3, 3 * N * b, "3N*b"),
                                          ("backward", 1, N * h * b, "N*h*b")):
        rec.check(f"vocab-parallel LM, hand: all-reduce calls, {phase}", "count",
                  comm.total("calls", phase, "all_reduce"), calls)
        rec.check(f"vocab-parallel LM, hand: bytes handed to all-reduce, {phase} = {formula}", "formula",
                  comm.total("bytes_in", phase, "all_reduce"), nbytes)
    got = dtensor_tp.counts(lm["DTensor"]["modes"])
    for phase, calls in (("forward", 1), ("loss", 3), ("backward", 1)):
        # loss_parallel calls its all-reduces itself, even on a mesh of one rank
        rec.check(f"vocab-parallel LM, DTensor: collectives, {phase}", "count",
                  got.get(phase, {}), {"all_reduce": calls} if tp > 1 or phase == "loss" else {})
    rec.figure("loss on gathered logits instead: bytes each rank would receive, (t-1)/t*N*V*b",
               "not run", expected=(tp - 1) / tp * N * V * b, unit="bytes")
