"""A mixture-of-experts layer by hand, on one process and expert-parallel (chapter 19).

- `route`: router probabilities, top-k choice, gates, capacity with token dropping (first choices
  before second choices, tokens in order), the Switch/GShard balancing loss and the router z-loss.
- `MoELayer`: every expert on one process; the tokens are cut into `groups` (one per rank of an
  expert-parallel run), each routed with its own capacity, as an expert-parallel rank routes its own.
- `ExpertParallelMoE`: this rank holds `n_experts / world` experts; kept tokens travel to the rank
  of their expert and back with `all_to_all_single` of uneven splits, the counts exchanged first.
  Its router is replicated (data-parallel); its experts are not.
- `AllToAllTap`: what torch's `all_to_all_single` was handed (bytes, bytes leaving the rank),
  recorded at the call, for the byte checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def capacity(n_tokens: int, n_experts: int, k: int, factor: float) -> int:
    """Slots per expert for one group of tokens: ceil(factor · k · n_tokens / n_experts)."""
    return math.ceil(factor * k * n_tokens / n_experts)


@dataclass
class Routing:
    """One group's routing decision; every tensor has one row per token."""

    probs: torch.Tensor  # (N, E) router softmax
    experts: torch.Tensor  # (N, k) chosen experts, best first
    gates: torch.Tensor  # (N, k) combine weights (renormalised over the k choices when k > 1)
    keep: torch.Tensor  # (N, k) bool: the choice found a slot (not dropped)
    capacity: int
    routed: torch.Tensor  # (E,) choices routed to each expert, before dropping
    kept: torch.Tensor  # (E,) choices each expert processes (min(routed, capacity))
    aux_loss: torch.Tensor  # balancing loss E · Σ_e f_e P_e
    z_loss: torch.Tensor  # mean over tokens of logsumexp(logits)²


def route(logits: torch.Tensor, k: int, capacity_factor: float) -> Routing:
    """Top-k routing with capacity for one group of tokens (logits: (N, E))."""
    n, E = logits.shape
    probs = logits.softmax(dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    if k > 1:  # GShard: the k gates of a token sum to one
        gates = gates / gates.sum(dim=-1, keepdim=True)
    # Slot order: every token's first choice, then every token's second choice (GShard), tokens in
    # order within a choice. A choice's position in its expert = earlier choices routed there.
    flat = experts.t().reshape(-1)  # (k·N,), choice-major
    onehot = F.one_hot(flat, E)
    position = (onehot.cumsum(0) - 1).gather(1, flat[:, None]).view(k, n).t()
    cap = capacity(n, E, k, capacity_factor)
    routed = onehot.sum(0)
    top1 = F.one_hot(experts[:, 0], E).to(probs.dtype)
    aux = E * (top1.mean(0) * probs.mean(0)).sum()  # f_e (top-1 fraction, no gradient) · P_e
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return Routing(probs, experts, gates, position < cap, cap, routed, routed.clamp(max=cap), aux, z)


class Expert(nn.Module):
    """One expert: the transformer's MLP, d → d_ff → d."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def combine(gates: torch.Tensor, slot_out: torch.Tensor) -> torch.Tensor:
    """y_i = Σ_j gate_ij · expert_out_ij over the k choices (a dropped choice's output is zero).
    Both layers combine through this one function, in the same order of additions."""
    return (gates.unsqueeze(-1) * slot_out).sum(1)


@dataclass
class LayerStats:
    """What a forward decided, per group: for the checks and the figures."""

    routings: list[Routing] = field(default_factory=list)


class MoELayer(nn.Module):
    """Every expert on this process. Tokens (…, d) are cut into `groups` equal groups, each routed
    with its own capacity; the losses are the groups' means."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int = 2,
                 capacity_factor: float = 1.25, groups: int = 1):
        super().__init__()
        self.k, self.capacity_factor, self.groups = k, capacity_factor, groups
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_experts))
        self.stats = LayerStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, xt = x.shape, x.reshape(-1, x.shape[-1])
        outs, self.stats = [], LayerStats()
        for g in xt.chunk(self.groups):
            r = route(self.router(g), self.k, self.capacity_factor)
            slot_out = g.new_zeros(g.shape[0], self.k, g.shape[1])
            for e, expert in enumerate(self.experts):  # on zero rows too, as ExpertParallelMoE must
                tok, choice = torch.nonzero((r.experts == e) & r.keep, as_tuple=True)
                slot_out = slot_out.index_put((tok, choice), expert(g[tok]))
            outs.append(combine(r.gates, slot_out))
            self.stats.routings.append(r)
        self.aux_loss = torch.stack([r.aux_loss for r in self.stats.routings]).mean()
        self.z_loss = torch.stack([r.z_loss for r in self.stats.routings]).mean()
        return torch.cat(outs).view(shape)


@dataclass(frozen=True)
class Handed:
    """One all_to_all_single call as torch received it: the bytes of its input, the part of them
    addressed to other ranks (by its input_split_sizes), the bytes of its output, the dtype."""

    dtype: torch.dtype
    nbytes: int
    off_rank: int
    received: int


class AllToAllTap:
    """Every `torch.distributed.all_to_all_single` call made while the block runs, whoever makes
    it, recorded where torch receives it (chapter 09's `WireTap` does the same for every
    collective; this one also reads the splits, to count what leaves the rank). A counter kept by
    the layer itself would count what the layer meant to send, and would still pass if the
    layer sent something else."""

    def __init__(self):
        self.calls: list[Handed] = []

    def __enter__(self) -> AllToAllTap:
        import torch.distributed.distributed_c10d as c10d

        self._original = original = dist.all_to_all_single

        def tapped(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                   async_op=False):
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            splits = input_split_sizes or [input.shape[0] // world] * world
            row = input.shape[1:].numel() * input.element_size()  # 0 rows is legal: no input[0]
            self.calls.append(Handed(input.dtype, input.numel() * input.element_size(),
                                     row * (sum(splits) - splits[rank]),
                                     output.numel() * output.element_size()))
            return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

        self._modules = [m for m in (dist, c10d) if m.all_to_all_single is original]
        for m in self._modules:
            m.all_to_all_single = tapped
        return self

    def __exit__(self, *exc) -> None:
        for m in self._modules:
            m.all_to_all_single = self._original

    def total(self, field: str, floating: bool = True) -> int:
        """Sum of one field over the calls that carried rows (floating) or counts (integers)."""
        return sum(getattr(c, field) for c in self.calls if c.dtype.is_floating_point == floating)


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
               group=None) -> torch.Tensor:
    """Rows [offset_q, offset_q + send_splits[q]) of x go to rank q; rank s's rows arrive in
    block s of the output (recv_splits[s] rows). Uneven splits; a split may be 0, and so may
    every split of a rank that has nothing to send: it still takes part in the call."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_single with a gradient: backward sends the gradients back along the same
    routes (the splits swapped). Autograd cannot see through a collective by itself."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return all_to_all(grad, recv_splits, send_splits, ctx.group), None, None, None


def exchange_counts(per_expert: torch.Tensor, world: int, group=None) -> torch.Tensor:
    """Before any token moves, every rank learns how many rows it will receive: each rank sends
    rank q the counts for q's experts; returns (world, experts per rank): row s = from rank s."""
    mine = per_expert.view(world, -1)
    return all_to_all(mine.flatten(), [mine.shape[1]] * world, [mine.shape[1]] * world,
                      group).view(world, -1)


class ExpertParallelMoE(nn.Module):
    """This rank's share of a MoELayer: the replicated router, experts [rank·m, (rank+1)·m)."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int, capacity_factor: float,
                 rank: int, world: int, group=None):
        super().__init__()
        if n_experts % world:
            raise ValueError(f"{world} ranks cannot share {n_experts} experts evenly")
        self.k, self.capacity_factor, self.rank, self.world, self.group = k, capacity_factor, rank, world, group
        self.n_experts, self.per_rank = n_experts, n_experts // world
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(self.per_rank))
        self.wrong_combine_order = False  # negative controls: see `forward`
        self.send_dropped = False
        self.stats = LayerStats()
        self.received = torch.zeros(self.per_rank, dtype=torch.long)

    def run_local_experts(self, rows: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        """Rows arrive by source rank, then by expert; apply each local expert to its rows.
        Every expert runs, on zero rows if none arrived: skipping it would leave the output
        without a gradient path to `rows` on a rank that received nothing, autograd would then
        skip this rank's backward all-to-alls, and the other ranks' would wait for it forever."""
        expert_of_row = torch.arange(self.per_rank, device=rows.device).repeat(self.world)
        expert_of_row = expert_of_row.repeat_interleave(recv.flatten())
        out = torch.zeros_like(rows)
        for j, expert in enumerate(self.experts):
            idx = torch.nonzero(expert_of_row == j, as_tuple=True)[0]
            out = out.index_put((idx,), expert(rows[idx]))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, xt = x.shape, x.reshape(-1, x.shape[-1])
        n = xt.shape[0]
        r = route(self.router(xt), self.k, self.capacity_factor)
        # 1. this rank's kept choices, sorted by destination expert (stable: slot order inside)
        sent = torch.ones_like(r.keep) if self.send_dropped else r.keep  # control: every choice
        tok, choice = torch.nonzero(sent, as_tuple=True)
        dest = r.experts[tok, choice]
        order = torch.argsort(dest * (self.k * n) + choice * n + tok)
        tok, choice, dest = tok[order], choice[order], dest[order]
        per_expert = torch.bincount(dest, minlength=self.n_experts)
        # 2. counts first: the receivers size their buffers from them
        recv = exchange_counts(per_expert, self.world, self.group)
        send_splits = per_expert.view(self.world, -1).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        self.received = recv.sum(0).cpu()
        # 3. dispatch, 4. experts, 5. combine: the rows come back in the order they were sent
        rows = AllToAll.apply(xt[tok], send_splits, recv_splits, self.group)
        rows = self.run_local_experts(rows, recv)
        back = AllToAll.apply(rows, recv_splits, send_splits, self.group)
        if self.wrong_combine_order:  # each row returned to a slot in token order, not send order
            tok, choice = torch.nonzero(r.keep, as_tuple=True)
        slot_out = xt.new_zeros(n, self.k, xt.shape[1]).index_put((tok, choice), back)
        if self.send_dropped:  # ... and the dropped ones' outputs thrown away: same numbers, more rows
            slot_out = slot_out * r.keep.unsqueeze(-1)
        self.stats = LayerStats([r])
        self.aux_loss, self.z_loss = r.aux_loss, r.z_loss
        return combine(r.gates, slot_out).view(shape)


def expert_slice(n_experts: int, rank: int, world: int) -> range:
    """The global ids of the experts rank `rank` holds."""
    m = n_experts // world
    return range(rank * m, (rank + 1) * m)


def shard_moe_state(state: dict, rank: int, world: int, n_experts: int) -> dict:
    """This rank's state dict of an expert-parallel model from the one-process model's: every
    non-expert tensor, and experts.{e} renumbered from the first expert the rank holds."""
    keep = expert_slice(n_experts, rank, world)
    out = {}
    for name, t in state.items():
        if not ("." + name).count(".experts."):
            out[name] = t
            continue
        head, rest = ("." + name).split(".experts.", 1)
        e, tail = rest.split(".", 1)
        if int(e) in keep:
            out[f"{head}.experts.{int(e) - keep.start}.{tail}".lstrip(".")] = t
    return out
