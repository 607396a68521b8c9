"""Chapter 25's Llama trained as large models are: pipeline, tensor, context and data parallelism
composed on one named `DeviceMesh` ("pp", "dp", "cp", "tp"), in torchtitan's order, and proven
against one process.

The order (torchtitan's `parallelize_llama` after `pipeline_llama`):
1. pipeline: every rank builds the whole model from the same weights, then keeps its stage's
   part (embedding + the first layers, ..., the last layers + norm + head); the layers live in a
   `ModuleDict` keyed by their global index, so a parameter's name is the same on every layout
   (what lets a DCP checkpoint reshard across layouts). `torch.distributed.pipelining` runs the
   stages with the 1F1B schedule over the "pp" dimension;
2. tensor parallelism per stage (`parallelize_module` on "tp"): q, k, v, gate, up column-wise,
   o and down row-wise (Megatron's split: one all-reduce after attention and one after the MLP);
3. context parallelism on "cp": each rank holds a zigzag shard of every sequence; attention is
   chapter 18's ring attention (`RING_ADAPTER`: grouped-query heads repeated before the ring,
   RoPE at the tokens' global positions);
4. activation checkpointing per block;
5. FSDP2 per block, then per stage, over the flattened "dp" × "cp" mesh (`dp_cp`), with
   `reshard_after_forward=False` under pipelining (1F1B interleaves micro-batches: resharding
   would all-gather every block again for every micro-batch's backward).

Gradient clipping sees every dimension: each parameter's local squared gradient is summed over
the mesh dimensions its DTensor is sharded on (dp_cp by FSDP2, tp for the split matrices), then
the stages' sums over "pp" (`grad_norm`). The pipeline's loss is a mean per micro-batch and
the schedule divides gradients by the number of micro-batches (`scale_grads`).

Run (CPU, gloo; the one-process reference and its checks run in the same program):
    torchrun --standalone --nproc_per_node=8 chapters/ch25_llm/composed.py --dp 2 --tp 2 --pp 2
    torchrun --standalone --nproc_per_node=8 chapters/ch25_llm/composed.py --pp 2 --tp 2 --cp 2
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.config import RunConfig, parse_config, require_at_least_one

DIMS = ("pp", "dp", "cp", "tp")  # outermost to innermost: tp on neighbouring ranks (one node)
BROKEN = ("none", "no_reduce:dp", "no_reduce:cp", "pp_unscaled", "clip_local_stage",
          "tp_unreduced")


# --------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class Cfg:
    """A Llama's shape (HF `LlamaConfig` names in the comments)."""

    vocab: int = 256            # vocab_size
    hidden: int = 64            # hidden_size
    layers: int = 2             # num_hidden_layers
    heads: int = 4              # num_attention_heads
    kv_heads: int = 2           # num_key_value_heads (grouped-query attention)
    ffn: int = 176              # intermediate_size
    rope_theta: float = 10000.0
    eps: float = 1e-6           # rms_norm_eps

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_hf(cls, c) -> Cfg:
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        return cls(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                   c.num_key_value_heads, c.intermediate_size, float(theta), c.rms_norm_eps)


class RMSNorm(nn.Module):
    """x / rms(x) · w, in the input's dtype (HF computes it in float32 even in a float64 model)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple:
    """HF's default RoPE tables at `positions` (global token positions): frequencies in float32,
    cast to the model's dtype, as `LlamaRotaryEmbedding` does."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _ReplicateNoReduce(torch.autograd.Function):
    """The tensor-parallel bug of the `tp_unreduced` control: the activation entering the
    column-parallel q, k, v (or gate, up) is made a replicated DTensor whose backward keeps this
    rank's *partial* input gradient (each tp rank holds only its heads' share) instead of
    all-reducing it: Megatron's "f" operator with its backward all-reduce dropped. DTensor's own
    `from_local` (what `ColwiseParallel` calls on a plain tensor) would all-reduce it."""

    @staticmethod
    def forward(ctx, x, mesh):
        from torch.distributed.tensor import DTensor, Replicate

        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        return grad.to_local(), None  # a Partial DTensor's local value: not summed over tp


class Attention(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        d = cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)
        self.ctx: dict = {}  # set by `set_context`: positions, cp group, the tp control's mesh

    def forward(self, x):
        B, T, _ = x.shape
        d = self.cfg.head_dim
        if self.ctx.get("no_reduce_mesh") is not None:
            x = _ReplicateNoReduce.apply(x, self.ctx["no_reduce_mesh"])
        q = self.q_proj(x).view(B, T, -1, d).transpose(1, 2)  # local heads under tp
        k = self.k_proj(x).view(B, T, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, d).transpose(1, 2)
        pos = self.ctx.get("positions")
        pos = torch.arange(T) if pos is None else pos
        cos, sin = rope_cos_sin(pos, d, self.cfg.rope_theta, q.dtype)
        q, k = rotate(q, cos.to(q.device), sin.to(q.device)), rotate(k, cos.to(q.device), sin.to(q.device))
        rep = q.shape[1] // k.shape[1]  # the same ratio on every tp rank (kv heads % tp == 0)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.ctx.get("cp_group") is not None:
            out = ring_attention_adapter(q, k, v, self.ctx["cp_group"])
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def ring_attention_adapter(q, k, v, group):
    """Chapter 18's ring attention as the attention of the cp dimension. It takes q, k, v of one
    shape: grouped-query K/V heads are repeated first (autograd sums their gradients back); the
    tokens are the zigzag shard `set_context` gave this rank, whose RoPE used global positions."""
    from chapters.ch18_long_context.ring import ring_attention

    return ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), layout="zigzag",
                          causal=True, group=group)


class MLP(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        self.ctx: dict = {}

    def forward(self, x):
        if self.ctx.get("no_reduce_mesh") is not None:
            x = _ReplicateNoReduce.apply(x, self.ctx["no_reduce_mesh"])
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """The course's Llama: HF `LlamaForCausalLM`'s parameter names without the "model." prefix,
    so HF weights load one to one (`from_hf`). A pipeline stage is this module with the parts
    of other stages set to None: it maps token ids (first stage) or hidden states to hidden
    states or logits (last stage)."""

    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, h):
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def hf_state_to_course(sd: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in sd.items()}


def from_hf(hf_model) -> Llama:
    """The course's Llama with the weights of an HF `LlamaForCausalLM` (names mapped one to one)."""
    model = Llama(Cfg.from_hf(hf_model.config)).to(next(hf_model.parameters()).dtype)
    model.load_state_dict(hf_state_to_course(hf_model.state_dict()), strict=True)
    return model


def reference_model(cfg: Cfg, seed: int, dtype=torch.float64) -> Llama:
    """Every rank (and the one-process reference) builds the same start from `seed`: HF's
    initialisation of a Llama (every matrix and embedding N(0, 0.02²), norms 1), drawn here so
    that the ranks need not import `transformers` (8 s each on a loaded 2-core machine)."""
    g = torch.Generator().manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.to(dtype)


# --------------------------------------------------------------------------- the layout

@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def name(self) -> str:
        return " x ".join(f"{d}{getattr(self, d)}" for d in DIMS if getattr(self, d) > 1) or "1"


def layout_error(layout: Layout, cfg: Cfg, global_batch: int, seq_len: int, microbatches: int,
                 world: int | None = None) -> str | None:
    """One line saying why `layout` cannot run (checked before any rank starts), else None."""
    problems = []
    if world is not None and layout.world != world:
        problems.append(f"dp*tp*pp*cp = {layout.world} != world {world}")
    if cfg.heads % layout.tp or cfg.kv_heads % layout.tp:
        problems.append(f"tp {layout.tp} must divide heads {cfg.heads} and kv heads {cfg.kv_heads}")
    if cfg.ffn % layout.tp:
        problems.append(f"tp {layout.tp} must divide ffn {cfg.ffn}")
    if cfg.layers % layout.pp:
        problems.append(f"pp {layout.pp} must divide layers {cfg.layers}")
    if microbatches < layout.pp:
        problems.append(f"1F1B needs microbatches {microbatches} >= pp {layout.pp}")
    if global_batch % (layout.dp * microbatches):
        problems.append(f"batch {global_batch} must split into dp {layout.dp} x {microbatches} "
                        f"micro-batches")
    if seq_len % (2 * layout.cp):
        problems.append(f"sequence {seq_len} must split into 2 x cp {layout.cp} zigzag chunks")
    return "; ".join(problems) or None


def build_mesh(layout: Layout, device_type: str = "cpu"):
    """The named 4-D mesh and its flattened data dimension "dp_cp" (FSDP2's mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(getattr(layout, d) for d in DIMS),
                            mesh_dim_names=DIMS)
    mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def split_stage(model: Llama, stage: int, stages: int) -> Llama:
    """Keep stage `stage` of `stages`: its contiguous share of the layers; the embedding on the
    first stage, the final norm and head on the last (torchtitan's `pipeline_module_split`)."""
    per = model.cfg.layers // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if stage != 0:
        model.embed_tokens = None
    if stage != stages - 1:
        model.norm, model.lm_head = None, None
    return model


def apply_tp(model: Llama, tp_mesh) -> None:
    """Megatron's split of every block on the tp mesh (torchtitan's plan without sequence
    parallelism): the embedding, norms and head stay whole on every tp rank."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


def set_context(model: Llama, positions, cp_group, no_reduce_mesh=None) -> None:
    for block in model.layers.values():
        block = getattr(block, "_checkpoint_wrapped_module", block)
        block.self_attn.ctx = {"positions": positions, "cp_group": cp_group,
                               "no_reduce_mesh": no_reduce_mesh}
        block.mlp.ctx = {"no_reduce_mesh": no_reduce_mesh}


def apply_ac(model: Llama) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for key in list(model.layers.keys()):
        model.layers[key] = checkpoint_wrapper(model.layers[key])


def apply_fsdp2(model: Llama, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def grad_norm(params, pp_group, over_pp: bool = True, device="cpu") -> torch.Tensor:
    """The global gradient norm of a composed model: each parameter's local squared gradient is
    summed over the mesh dimensions its DTensor is sharded on (replicated dimensions hold copies:
    summing them would count them twice), then over the pipeline stages. `over_pp=False` is the
    `clip_local_stage` control: each stage clips by its own stages' norm."""
    from torch.distributed.tensor import DTensor

    sums: dict = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            # not `is_shard()`: FSDP2 over TP gives `_StridedShard`, for which it is False
            local, groups = g.to_local(), tuple(g.device_mesh.get_group(i) for i, pl in
                                                enumerate(g.placements) if not pl.is_replicate())
        else:
            local, groups = g, ()
        key = tuple(tuple(dist.get_process_group_ranks(gr)) for gr in groups)
        s, _ = sums.get(key, (torch.zeros((), dtype=torch.float64, device=local.device), groups))
        sums[key] = (s + local.double().pow(2).sum(), groups)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for s, groups in sums.values():
        for group in groups:
            dist.all_reduce(s, group=group)
        total = total + s
    if over_pp and dist.get_world_size(pp_group) > 1:  # pp = 1: nothing to sum, no collective
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


# --------------------------------------------------------------------------- training

@dataclass
class Run:
    """Settings shared by the composed run and its one-process reference."""

    cfg: Cfg = field(default_factory=Cfg)
    steps: int = 3
    global_batch: int = 8
    seq_len: int = 32
    microbatches: int = 2
    lr: float = 3e-3
    max_norm: float = 0.5       # chosen below the measured norms: clipping acts at every step
    seed: int = 0
    dtype: torch.dtype = torch.float64


def batch(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: random token windows (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(run.seed * 7919 + step)
    ids = torch.randint(0, run.cfg.vocab, (run.global_batch, run.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def make_optimizer(params, lr: float):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def reference_steps(model, opt, run: Run, steps: range) -> dict:
    """One process's steps on the whole global batch: mean cross-entropy, torch's own
    `clip_grad_norm_`, AdamW. Returns losses, pre-clip norms and the final parameters."""
    losses, norms = [], []
    for step in steps:
        x, y = batch(run, step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def one_process(run: Run) -> dict:
    """The reference: the whole model, the whole global batch, mean cross-entropy, torch's own
    `clip_grad_norm_`, AdamW. Returns losses, pre-clip norms and the final parameters."""
    model = reference_model(run.cfg, run.seed, run.dtype)
    opt = make_optimizer(model.parameters(), run.lr)
    return reference_steps(model, opt, run, range(run.steps))


def build_composed(run: Run, layout: Layout, mesh, broken: str = "none", device="cpu"):
    """This rank's stage of the model, parallelized in torchtitan's order; returns
    (stage module, pipeline schedule)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    coords = {d: mesh[d].get_local_rank() for d in DIMS}
    model = reference_model(run.cfg, run.seed, run.dtype).to(device)
    model = split_stage(model, coords["pp"], layout.pp)                       # 1. pipeline
    if layout.tp > 1:
        apply_tp(model, mesh["tp"])                                           # 2. tensor
    positions, cp_group = None, None
    if layout.cp > 1:                                                        # 3. context
        from chapters.ch18_long_context.ring import positions as zigzag_positions

        positions = zigzag_positions(run.seq_len, coords["cp"], layout.cp, "zigzag")
        cp_group = mesh["cp"].get_group()
    set_context(model, positions, cp_group,
                mesh["tp"] if broken == "tp_unreduced" and layout.tp > 1 else None)
    apply_ac(model)                                                           # 4. recompute
    data_dims = {"none": "dp_cp", "no_reduce:dp": "cp", "no_reduce:cp": "dp"}.get(broken, "dp_cp")
    if mesh[data_dims].size() > 1:
        apply_fsdp2(model, mesh[data_dims])                                   # 5. FSDP2

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    stage = PipelineStage(model, coords["pp"], layout.pp, torch.device(device),
                          group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, run.microbatches, loss_fn=loss_fn,
                            scale_grads=broken != "pp_unscaled")
    return model, schedule


def local_batch(run: Run, layout: Layout, coords: dict, step: int):
    """This rank's share of the global batch: its dp rows, its cp zigzag shard of each row."""
    from chapters.ch18_long_context.ring import shard_sequence

    x, y = batch(run, step)
    rows = run.global_batch // layout.dp
    x, y = (t[coords["dp"] * rows:(coords["dp"] + 1) * rows] for t in (x, y))
    return tuple(shard_sequence(t, coords["cp"], layout.cp, "zigzag", dim=1) for t in (x, y))


def train_composed(run: Run, layout: Layout, mesh, broken: str = "none",
                   device="cpu", start: int = 0, load: str | None = None,
                   save: str | None = None) -> dict:
    """Train `run.steps` steps on `layout`. Every rank returns losses (global means) and pre-clip
    norms; the ranks at dp = cp = tp = 0 return their stage's whole parameters."""
    assert broken in BROKEN, broken
    coords = {d: mesh[d].get_local_rank() for d in DIMS}
    model, schedule = build_composed(run, layout, mesh, broken, device)
    opt = make_optimizer(model.parameters(), run.lr)
    if load:
        dcp_load(model, opt, load)
    first, last = coords["pp"] == 0, coords["pp"] == layout.pp - 1
    losses, norms = [], []
    for step in range(start, start + run.steps):
        x, y = (t.to(device) for t in local_batch(run, layout, coords, step))
        mb_losses: list = []
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": mb_losses} if last else {}
        with CommCounter(mesh) as comm:  # the step's traffic (the last step's is returned)
            schedule.step(*args, **kwargs)
            norm = grad_norm(model.parameters(), mesh["pp"].get_group(),
                             over_pp=broken != "clip_local_stage", device=device)
            coef = torch.clamp(run.max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef.item())
            opt.step()
        state = state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        # the global loss: the mean of the last stage's micro-batch means over dp x cp
        mine = torch.stack(mb_losses).mean().detach() if last and coords["tp"] == 0 \
            else torch.zeros((), dtype=run.dtype, device=device)
        dist.all_reduce(mine)
        losses.append(mine.item() / (layout.dp * layout.cp))
        norms.append(norm.item())
    if save:
        dcp_save(model, opt, save)
    params = None
    if coords["dp"] == coords["cp"] == coords["tp"] == 0:
        params = full_params(model)
    elif any(getattr(layout, d) > 1 for d in ("dp", "cp", "tp")):
        full_params(model)  # the gathers are collectives: every rank of the stage takes part
    return {"losses": losses, "norms": norms, "params": params, "state_bytes": state,
            "coords": coords, "comm_bytes": comm.bytes, "comm_calls": comm.calls}


def dcp_save(model, opt, path: str) -> None:
    """The composed model's and AdamW's state in DCP's sharded format: every rank writes its own
    shards (its stage, its tp slice, its dp x cp shard) under the parameters' full names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load(model, opt, path: str) -> None:
    """Load a DCP checkpoint saved by any layout into this rank's part of this layout: DCP
    reads, for each of this rank's shards, the pieces of the saved shards that overlap it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def resume_one_process(run: Run, path: str, start: int) -> dict:
    """A different world: one process, no process group, loads the composed run's DCP
    checkpoint into the whole model and AdamW and trains `run.steps` more steps from `start`."""
    import torch.distributed.checkpoint as dcp

    model = reference_model(run.cfg, run.seed, run.dtype)
    opt = make_optimizer(model.parameters(), run.lr)
    # AdamW's state exists after a first step: make it (zero gradients), then overwrite it all
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    names = {p: n for n, p in model.named_parameters()}
    state = {"model": model.state_dict(),
             "optim": {"state": {names[p]: st for p, st in opt.state.items()}}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])
    return reference_steps(model, opt, run, range(start, start + run.steps))


class CommCounter:
    """Bytes this rank hands to collectives, by mesh dimension, counted at the collective
    boundary: a `TorchDispatchMode` sees every c10d op (FSDP2's all-gather and reduce-scatter,
    DTensor's functional all-reduce and all-gather, the pipeline's and the ring's send/recv) with
    its process group, which `dims` maps back to a name. Counted: the input of an all-reduce,
    all-gather or reduce-scatter, the tensor of a send (receives are the peer's sends)."""

    OPS = {"allreduce_": 0, "all_reduce": 0, "_allgather_base_": 1, "all_gather_into_tensor": 0,
           "_reduce_scatter_base_": 1, "reduce_scatter_tensor": 0, "send": 0}

    def __init__(self, mesh):
        def by_ranks(order):  # where two dimensions have the same ranks, the later one wins
            return {tuple(dist.get_process_group_ranks(mesh[d].get_group())): d
                    for d in order if mesh[d].size() > 1}

        # at dp = 1 the cp ranks are the dp_cp ranks: sends there are the ring's, collectives
        # FSDP2's (and at cp = 1 the dp ranks are dp_cp's: FSDP2 is counted as dp_cp)
        self.p2p = by_ranks(("dp", "dp_cp", "tp", "cp", "pp"))
        self.collective = by_ranks(("pp", "cp", "tp", "dp", "dp_cp"))
        self.bytes: dict = {}
        self.calls: dict = {}

    def _dim(self, group, p2p: bool) -> str:
        from torch.distributed.distributed_c10d import _resolve_process_group

        # functional ops name their group; c10d ops carry it as a TorchBind object. Groups are
        # matched by their ranks: DTensor and FSDP2 make their own groups for the same ranks.
        pg = _resolve_process_group(group) if isinstance(group, str) \
            else dist.ProcessGroup.unbox(group)
        dims = self.p2p if p2p else self.collective
        return dims.get(tuple(dist.get_process_group_ranks(pg)), "other")

    def record(self, func, args) -> None:
        op = func.__name__.split(".")[0]
        if op not in self.OPS:
            return
        t = args[self.OPS[op]]
        t = t[0] if isinstance(t, (list, tuple)) else t
        group = [a for a in args[1:] if isinstance(a, str) or type(a).__name__ in
                 ("ProcessGroup", "ScriptObject")][-1 if isinstance(args[-1], str) else 0]
        dim = self._dim(group, p2p=op == "send")
        self.bytes[dim] = self.bytes.get(dim, 0) + t.numel() * t.element_size()
        self.calls[dim] = self.calls.get(dim, 0) + 1

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.record(func, args)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model, opt) -> dict:
    """Model-state bytes this rank holds after an optimizer step (before the gradients are
    freed), counted from its tensors: parameter shards, gradient shards, AdamW's two moments."""
    params = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    grads = sum(_local(p.grad).numel() * _local(p.grad).element_size()
                for p in model.parameters() if p.grad is not None)
    moments = sum(_local(t).numel() * _local(t).element_size() for st in opt.state.values()
                  for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    return {"params": params, "grads": grads, "optimizer": moments}


def expected_state_bytes(cfg: Cfg, layout: Layout, stage: int, elem: int = 8) -> dict:
    """The same by formula (what chapter 30's planner predicts): the stage's parameters, the
    block matrices divided by tp, everything divided by dp x cp (FSDP2's shards; exact when
    the sharded dimensions divide, as here); gradients as large; AdamW two moments each."""
    h, d = cfg.hidden, cfg.head_dim
    matrices = h * cfg.heads * d * 2 + 2 * h * cfg.kv_heads * d + 3 * h * cfg.ffn
    block = matrices // layout.tp + 2 * h
    n = cfg.layers // layout.pp * block
    if stage == 0:
        n += cfg.vocab * h
    if stage == layout.pp - 1:
        n += h + cfg.vocab * h
    n //= layout.dp * layout.cp
    return {"params": n * elem, "grads": n * elem, "optimizer": 2 * n * elem}


def expected_comm_bytes(run: Run, layout: Layout, stage: int, elem: int = 8) -> dict:
    """What one training step hands to collectives, by mesh dimension, by formula; m
    micro-batches of B/(dp·m) sequences of T/cp tokens, an activation a = B/(dp·m)·T/cp·h
    elements, L/pp blocks on the stage.
    - pp: each micro-batch's activation (forward, first stage) or its gradient (backward, last
      stage): m·a; plus the 8-byte gradient-norm sum.
    - dp_cp (FSDP2, `reshard_after_forward=False`): one all-gather of this rank's shard and one
      reduce-scatter of its whole (tp-local) gradient, dp·cp shards: (1 + dp·cp) × shard bytes;
      plus one 8-byte norm sum per kind of sharding (1-D; 2-D when tp > 1).
    - tp, per block and micro-batch, all-reduces of one activation a: 2 forward (after o and
      down), 1 in the recomputation (activation checkpointing stops before the MLP's down
      projection: its output is not needed by backward), 5 backward (the input gradients of q,
      k, v and gate, up: each column-parallel input all-reduces its own); plus 8 (the norm).
    - cp: chapter 18's ring, `ring_bytes_per_rank`, per block and micro-batch, its forward twice
      (once more in the recomputation) and its backward once; K/V heads are repeated to the
      query heads before the ring (heads/tp of them)."""
    from chapters.ch18_long_context.ring import ring_bytes_per_rank

    cfg = run.cfg
    rows = run.global_batch // (layout.dp * run.microbatches)
    local_len = run.seq_len // layout.cp
    act = rows * local_len * cfg.hidden * elem
    blocks = cfg.layers // layout.pp
    out = {}
    if layout.pp > 1:
        out["pp"] = run.microbatches * act * (1 if stage in (0, layout.pp - 1) else 2) + 8
    if layout.dp * layout.cp > 1:
        shard = expected_state_bytes(cfg, layout, stage, elem)["params"]
        out["dp_cp"] = (1 + layout.dp * layout.cp) * shard + 8 * (2 if layout.tp > 1 else 1)
    if layout.tp > 1:
        out["tp"] = blocks * run.microbatches * (2 + 1 + 5) * act + 8
    if layout.cp > 1:
        ring = ring_bytes_per_rank(rows, cfg.heads // layout.tp, local_len, cfg.head_dim, elem,
                                   layout.cp)
        out["cp"] = blocks * run.microbatches * (2 * ring["forward"] + ring["backward"])
    return out


def measured_figures(results_by_rank: list, plans: list = None) -> list[dict]:
    """Chapter 25's measured per-layout figures for chapter 30's planner: for each correct run
    of `layout_worker` (one list per rank), each rank's coordinates, its model-state bytes
    (params, grads, AdamW moments) and the bytes it handed to collectives in one training step
    by mesh dimension ("pp", "dp", "cp", "tp", "dp_cp"), with the number of calls."""
    plans = PLANS if plans is None else plans
    rows = []
    for i, (layout, _) in enumerate(plans):
        for rank, r in enumerate(results_by_rank):
            res = r[i]["none"]
            rows.append({"layout": layout.name(), "rank": rank, "coords": res["coords"],
                         "state_bytes": res["state_bytes"], "comm_bytes": res["comm_bytes"],
                         "comm_calls": res["comm_calls"]})
    return rows


def full_params(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = t.detach().cpu().clone()
    return out


def merge_stages(results: list[dict]) -> dict:
    """One run's parameters from every stage's reporting rank, as one state dict."""
    out: dict = {}
    for r in results:
        if r["params"] is not None:
            out.update(r["params"])
    return out


def differences(composed: dict, reference: dict) -> dict:
    """Largest differences: loss (relative), pre-clip norm (relative), parameters (absolute)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(composed["losses"], reference["losses"]))
    norm = max(abs(a - b) / abs(b) for a, b in zip(composed["norms"], reference["norms"]))
    params = composed["params"]
    assert set(params) == set(reference["params"]), set(params) ^ set(reference["params"])
    p = max((params[k].double() - reference["params"][k].double()).abs().max().item()
            for k in params)
    return {"loss": loss, "norm": norm, "params": p}


def tolerances(run: Run) -> dict:
    """The lesson's float64 tolerances. The composed run and one process compute the same sums
    in another order (over tokens, micro-batches, dp x cp ranks, tp shards, ring blocks): a sum
    of n terms reordered moves by at most n·u times the sum of their magnitudes, n at most the
    B·T tokens of the global batch, u = 2^-53. The loss and the norm are such sums (relative
    n·u); a weight moves by at most η·n·u/ε per AdamW step (the chapter's first-order bound,
    gradients clipped to norm <= 1), k steps."""
    u = torch.finfo(run.dtype).eps / 2
    n = run.global_batch * run.seq_len
    return {"loss": n * u, "norm": n * u, "params": run.steps * run.lr * n * u / 1e-8}


def layout_worker(run: Run, plans: list, save: str | None = None) -> list:
    """For tests: on every spawned rank, `plans` is a list of (layout, [broken...]); one mesh per
    layout, every run on it. Returns per plan per broken this rank's result. With `save`, the
    first plan's correct run also writes its DCP checkpoint there."""
    out = []
    for i, (layout, brokens) in enumerate(plans):
        mesh = build_mesh(layout)
        out.append({b: train_composed(run, layout, mesh, b,
                                      save=save if i == 0 and b == "none" else None)
                    for b in brokens})
    return out


def parity_worker(ckpt: str | None = None) -> dict:
    """The chapter's 8-rank job: dp2 x tp2 x pp2 with its four controls, pp2 x tp2 x cp2 with its
    cp control; with `ckpt`, the resharding: dp2 x tp2 x pp2 trains `Run().steps` steps and saves
    a DCP checkpoint there, which dp4 x tp2 (one stage: no pipeline) loads and trains one step
    on. The same folder is then resumed by one process (`resume_one_process`), in the test."""
    run = Run()
    out = {"plans": layout_worker(run, PLANS, save=ckpt)}
    if ckpt:
        b = RESHARD[1]
        one_more = Run(steps=1)
        out["resumed"] = train_composed(one_more, b, build_mesh(b), start=run.steps, load=ckpt)
    return out


PLANS = [(Layout(dp=2, tp=2, pp=2), ["none", "no_reduce:dp", "pp_unscaled", "clip_local_stage",
                                     "tp_unreduced"]),
         (Layout(pp=2, tp=2, cp=2), ["none", "no_reduce:cp"])]

RESHARD = (PLANS[0][0], Layout(dp=4, tp=2))  # saved by, resumed on


def compare_plans(run: Run, plans: list, results_by_rank: list, reference: dict) -> list[dict]:
    """One row per (layout, run) of `layout_worker`'s results on every rank: the largest
    differences from the one-process `reference` and whether all are within `tolerances`."""
    tol = tolerances(run)
    rows = []
    for i, (layout, brokens) in enumerate(plans):
        for b in brokens:
            per_rank = [r[i][b] for r in results_by_rank]
            composed = {"losses": per_rank[0]["losses"], "norms": per_rank[0]["norms"],
                        "params": merge_stages(per_rank)}
            d = differences(composed, reference)
            rows.append({"layout": layout.name(), "broken": b, **d,
                         "within": all(d[k] <= tol[k] for k in tol)})
    return rows


@dataclass
class Config(RunConfig):
    steps: int = 3
    """Optimizer steps of the composed run (and of its one-process reference)."""
    dp: int = 0
    """Data-parallel degree (FSDP2, with cp); 0: what the world leaves, world / (tp*pp*cp)."""
    tp: int = 1
    """Tensor-parallel degree: divides the heads, the kv heads and the MLP width."""
    pp: int = 1
    """Pipeline stages (1F1B): divides the layers; at most --microbatches."""
    cp: int = 1
    """Context-parallel degree (ring attention, zigzag): --seq-len divisible by 2*cp."""
    microbatches: int = 2
    """Micro-batches per step on every pipeline (1F1B needs at least --pp)."""
    micro_batch_size: int = 2
    """Sequences per micro-batch per data-parallel rank: global batch = dp*microbatches*this."""
    seq_len: int = 32
    """Tokens per sequence."""
    layers: int = 2
    """Decoder blocks of the Llama."""
    broken: str = "none"
    """A deliberate bug (a negative control): none, no_reduce:dp, no_reduce:cp, pp_unscaled,
    clip_local_stage or tp_unreduced; the parity checks must then fail."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "tp", "pp", "cp", "microbatches", "micro_batch_size",
                             "seq_len", "layers")
        if self.dp < 0:
            raise ValueError(f"--dp must be 0 (the rest of the world) or more, not {self.dp}")
        if self.broken not in BROKEN:
            raise ValueError(f"--broken must be one of {', '.join(BROKEN)}, not {self.broken!r}")


def resolve(cfg: Config, world: int) -> tuple[Layout, Run]:
    others = cfg.tp * cfg.pp * cfg.cp
    dp = cfg.dp or max(1, world // others)
    layout = Layout(dp=dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp)
    run = Run(cfg=Cfg(layers=cfg.layers), steps=cfg.steps, seq_len=cfg.seq_len,
              global_batch=dp * cfg.microbatches * cfg.micro_batch_size,
              microbatches=cfg.microbatches, seed=cfg.seed)
    return layout, run


def validate(cfg: Config, world_size: int) -> None:
    """Refuse, in one line before any rank starts, a layout the world or the model cannot hold."""
    layout, run = resolve(cfg, world_size)
    if error := layout_error(layout, run.cfg, run.global_batch, run.seq_len, run.microbatches,
                             world_size):
        raise ValueError(f"layout {layout.name()}: {error}")


def main(cfg: Config) -> int:
    from common.distributed import gather_numbers, setup_distributed, teardown_distributed
    from common.log import log, setup_logging
    from common.results import RunRecorder

    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        layout, run = resolve(cfg, info.world_size)
        log.info("composed Llama on %s (world %d, %s/%s): %d steps, global batch %d x %d tokens, "
                 "%d micro-batches, float64%s", layout.name(), info.world_size, info.device,
                 info.backend, run.steps, run.global_batch, run.seq_len, run.microbatches,
                 "" if cfg.broken == "none" else f", BROKEN: {cfg.broken}")
        mesh = build_mesh(layout, info.device.type)
        result = train_composed(run, layout, mesh, cfg.broken, info.device)
        parts = [None] * info.world_size
        dist.all_gather_object(parts, {"params": result["params"]})
        composed = {"losses": result["losses"], "norms": result["norms"],
                    "params": merge_stages(parts)}
        for step, (loss, norm) in enumerate(zip(result["losses"], result["norms"])):
            rec.metrics(step, loss=loss, grad_norm=norm)
            log.info("step %d  loss %.12f  grad norm %.12f", step, loss, norm)
        d, tol = None, tolerances(run)
        if info.is_main:
            d = differences(composed, one_process(run))
        d = [None] * info.world_size if d is None else d
        box = [d]
        dist.broadcast_object_list(box, src=0)
        d = box[0]
        for key, what in (("loss", "losses (relative)"), ("norm", "pre-clip grad norms (relative)"),
                          ("params", "weights")):
            rec.check(f"{layout.name()}: {what} = one process", "parity", d[key], tol[key],
                      compare="<=")
        want = expected_state_bytes(run.cfg, layout, result["coords"]["pp"])
        mine = sum(result["state_bytes"].values())
        ok = gather_numbers(int(mine == sum(want.values())))
        rec.check("model-state bytes per rank = formula (every rank)", "count", sum(ok),
                  info.world_size)
        rec.figure("model-state bytes per rank (largest)", max(gather_numbers(mine)), unit="B")
        traffic = result["comm_bytes"] == expected_comm_bytes(run, layout, result["coords"]["pp"])
        rec.check("bytes to collectives per step, by mesh dimension = formula (every rank)",
                  "count", sum(gather_numbers(int(traffic))), info.world_size)
        for dim, n in sorted(result["comm_bytes"].items()):
            rec.figure(f"bytes to collectives per step over {dim} (rank 0)", n, unit="B")
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
