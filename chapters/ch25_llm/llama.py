"""The course's Llama for the composed run (composed.py): HF `LlamaForCausalLM`'s modules and
parameter names, written out so that it cuts into pipeline stages. HF's model computes its RoPE
tables once in `LlamaModel` and returns `ModelOutput` objects; a stage here is this module with
the other stages' parts set to None, mapping token ids or hidden states to hidden states or
logits. HF's weights load into it one to one (`from_hf`; the chapter's tests check the logits).

Attention reads its context (`Attention.ctx`, set by composed.set_context): the RoPE tables at
the tokens' global positions (built once per layout, on the model's device), the context-parallel
group (then attention is chapter 18's ring attention)
and, for one negative control, the tensor-parallel mesh whose backward all-reduce it drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
        self.ctx: dict = {}  # set by `set_context`: RoPE tables, cp group, the tp control's mesh

    def forward(self, x):
        B, T, _ = x.shape
        d = self.cfg.head_dim
        if self.ctx.get("no_reduce_mesh") is not None:
            x = _ReplicateNoReduce.apply(x, self.ctx["no_reduce_mesh"])
        q = self.q_proj(x).view(B, T, -1, d).transpose(1, 2)  # local heads under tp
        k = self.k_proj(x).view(B, T, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, d).transpose(1, 2)
        if "rope" in self.ctx:  # the composed run's: built once per layout, on the device
            cos, sin = self.ctx["rope"]
            assert cos.shape[0] == T, (cos.shape, T)  # tables for the tokens attention sees
        else:  # one process, positions 0..T-1
            cos, sin = (t.to(q.device) for t in rope_cos_sin(torch.arange(T), d,
                                                             self.cfg.rope_theta, q.dtype))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
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
