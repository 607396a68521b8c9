"""Tensor parallelism by hand: the f/g conjugate operators, column- and row-parallel linear
layers, and Megatron's transformer block, with and without sequence parallelism.

The four operators are autograd functions over the counted collectives of tp_comm.py (every
call recorded in `COMM`: per phase, the calls, the elements of the whole tensor, and the bytes of
the tensor this rank handed to the collective):

    f  copy_to_tp           forward: identity        backward: all-reduce
    g  reduce_from_tp       forward: all-reduce      backward: identity
    f̄  gather_from_sp       forward: all-gather(seq) backward: reduce-scatter(seq)
    ḡ  reduce_scatter_to_sp forward: reduce-scatter  backward: all-gather

What a library collective puts on the wire is its own business (NCCL picks ring or tree). With
`tp_comm.use_ring(True)` the sums and gathers run as a ring written with send/recv, and `COMM`
also records the bytes this rank's sends carried: the ring formula measured, not assumed.

Tensor-parallel group = the whole world here; with a device mesh it is the mesh's TP axis
(chapter 06).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch05_tensor_parallel.block import causal_attention, dropout_seed, seeded_dropout
from chapters.ch05_tensor_parallel.tp_comm import all_gather_seq, all_reduce, reduce_scatter_seq


class CopyToTP(torch.autograd.Function):
    """f: each rank uses the whole input; each rank's input gradient is partial, so sum them."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad)


class ReduceFromTP(torch.autograd.Function):
    """g: each rank holds a partial sum of the output; sum it. Its gradient is already whole."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class GatherFromSP(torch.autograd.Function):
    """f̄: sequence shards -> full sequence; backward sums the partial gradients and keeps
    this rank's shard (reduce-scatter), which is f's all-reduce without the useless half."""

    @staticmethod
    def forward(ctx, x):
        return all_gather_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad)


class ReduceScatterToSP(torch.autograd.Function):
    """ḡ: partial sums over the full sequence -> this rank's summed shard; backward gathers."""

    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad)


def copy_to_tp(x):
    return CopyToTP.apply(x)


def reduce_from_tp(x):
    return ReduceFromTP.apply(x)


def gather_from_sp(x):
    return GatherFromSP.apply(x)


def reduce_scatter_to_sp(x):
    return ReduceScatterToSP.apply(x)


class ColumnParallelLinear(nn.Module):
    """Y_r = X W_rᵀ + b_r: this rank's rows of W (output features); the input enters the
    parallel region through f (or f̄ with sequence parallelism)."""

    def __init__(self, d_in: int, d_out_local: int, sequence_parallel: bool, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out_local, d_in))
        self.bias = nn.Parameter(torch.empty(d_out_local)) if bias else None
        for p in self.parameters():
            p.tensor_parallel = True  # a shard: its gradient norm is summed over the ranks
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        x = gather_from_sp(x) if self.sequence_parallel else copy_to_tp(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = Σ_r X_r W_rᵀ + b: this rank's columns of W (input features); the partial sums leave
    through g (or ḡ), and the bias is added once, after the sum."""

    def __init__(self, d_in_local: int, d_out: int, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in_local))
        self.weight.tensor_parallel = True
        self.bias = nn.Parameter(torch.empty(d_out))
        self.bias.sequence_parallel = sequence_parallel  # replicated, fed a sequence shard
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sp(y) if self.sequence_parallel else reduce_from_tp(y)
        return y + self.bias


def tp_layout_error(tp: int, n_heads: int, d_ff: int, seq_len: int, sequence_parallel: bool) -> str | None:
    """One sentence saying why this tensor-parallel degree cannot split the block, or None."""
    if n_heads % tp:
        return (f"tensor-parallel degree {tp} does not divide the {n_heads} attention heads; "
                f"use a degree that divides {n_heads}")
    if d_ff % tp:
        return f"tensor-parallel degree {tp} does not divide the MLP hidden size {d_ff}"
    if sequence_parallel and seq_len % tp:
        return (f"tensor-parallel degree {tp} does not divide the sequence length {seq_len} "
                f"(sequence parallelism gives every rank S/t tokens)")
    return None


class TPBlock(nn.Module):
    """Megatron's block: attention = column (q, k, v of this rank's heads, fused) then row;
    MLP = column then row. One all-reduce each in forward (or all-gather + reduce-scatter)."""

    def __init__(self, d_model, n_heads, d_ff, dropout, layer, rank, tp, sequence_parallel):
        super().__init__()
        if error := tp_layout_error(tp, n_heads, d_ff, 1, False):
            raise ValueError(error)
        sp = sequence_parallel
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        for ln in (self.ln1, self.ln2):
            for p in ln.parameters():
                p.sequence_parallel = sp
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model // tp, sp)
        self.proj = RowParallelLinear(d_model // tp, d_model, sp)
        self.fc1 = ColumnParallelLinear(d_model, d_ff // tp, sp)
        self.fc2 = RowParallelLinear(d_ff // tp, d_model, sp)
        self.head_dim, self.p, self.layer = d_model // n_heads, dropout, layer
        self.rank, self.tp, self.sp = rank, tp, sp

    def drop(self, y, step, site):
        """The dense block's dropout mask, this rank's rows of it under sequence parallelism."""
        S = y.shape[1]
        offset, total = (self.rank * S, S * self.tp) if self.sp else (0, S)
        return seeded_dropout(y, self.p, dropout_seed(step, self.layer, site), offset, total)

    def forward(self, x, step: int = 0):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.drop(self.proj(causal_attention(q, k, v, self.head_dim)), step, 0)
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))), step, 1)


class TPModel(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, n_layers, dropout, rank, tp, sequence_parallel):
        super().__init__()
        self.blocks = nn.ModuleList(
            TPBlock(d_model, n_heads, d_ff, dropout, i, rank, tp, sequence_parallel)
            for i in range(n_layers))

    def forward(self, x, step: int = 0):
        for block in self.blocks:
            x = block(x, step)
        return x


def shard_state(dense: dict, rank: int, tp: int) -> dict:
    """This rank's TPModel tensors from a DenseModel's (parameters or gradients): q, k, v and
    fc1 by rows (heads / hidden units), proj and fc2 weights by columns, the rest replicated."""
    def rows(t):
        return t.chunk(tp, dim=0)[rank]

    out = {}
    for name, t in dense.items():
        if ".attn.v." in name:
            out[name.replace(".attn.v.", ".qkv.")] = torch.cat(
                [rows(dense[name.replace(".attn.v.", f".attn.{p}.")]) for p in "qkv"])
        elif name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
            out[name.replace("attn.", "").replace("mlp.", "")] = t.chunk(tp, dim=1)[rank]
        elif ".mlp.fc1." in name:
            out[name.replace("mlp.", "")] = rows(t)
        elif ".attn.q." not in name and ".attn.k." not in name:
            out[name.replace("attn.", "").replace("mlp.", "")] = t  # LayerNorms, row biases
    return out


def sync_sequence_parallel_grads(model: nn.Module) -> int:
    """Under sequence parallelism a replicated parameter (LayerNorm, row-parallel bias) sees
    only this rank's tokens: sum its gradient over the TP ranks. Returns the calls made."""
    calls = 0
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            p.grad.copy_(all_reduce(p.grad))
            calls += 1
    return calls


def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ for the hand-written TP model: the squared norms of the
    shards (`tensor_parallel`) are summed over the ranks by one all-reduce of one number;
    replicated parameters (LayerNorms, row biases, already summed under SP) count once.
    Returns the total norm, the same on every rank."""
    grads = [p for p in model.parameters() if p.grad is not None]
    ref = grads[0].grad
    sharded = sum((p.grad.pow(2).sum() for p in grads if getattr(p, "tensor_parallel", False)),
                  torch.zeros((), dtype=ref.dtype, device=ref.device))
    replicated = sum((p.grad.pow(2).sum() for p in grads if not getattr(p, "tensor_parallel", False)),
                     torch.zeros((), dtype=ref.dtype, device=ref.device))
    norm = (all_reduce(sharded) + replicated).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's formula, so the dense run agrees
    for p in grads:
        p.grad.mul_(coef)
    return norm.item()
