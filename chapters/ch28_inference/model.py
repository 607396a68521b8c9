"""A Llama written by hand, with a KV cache, loaded from a `transformers` LlamaForCausalLM built
from a local `LlamaConfig`; the same model split over tensor-parallel ranks (chapter 05's f and g).

The hand model is functional: `forward(ids, cache, start)` runs the decoder on `ids` (B, T) whose
first token sits at position `start`, appends each layer's keys and values to `cache` (a list of
[k, v] per layer, or None for no cache) and returns the logits (B, T, V). Without a cache every
step re-runs the whole sequence; with one, a step runs one token against the stored keys/values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chapters.ch05_tensor_parallel.tp_layers import copy_to_tp, reduce_from_tp


def llama_config(vocab_size: int = 96, hidden_size: int = 64, n_layers: int = 2, n_heads: int = 16,
                 ffn_size: int = 128, max_len: int = 256):
    """A small LlamaConfig (no download): n_kv_heads = n_heads, untied head, no biases."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn_size,
                       num_hidden_layers=n_layers, num_attention_heads=n_heads,
                       num_key_value_heads=n_heads, max_position_embeddings=max_len,
                       rms_norm_eps=1e-6, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)


def hf_model(config, seed: int = 0, dtype=torch.float64):
    """transformers' LlamaForCausalLM from `config`, random weights from `seed`, eval mode."""
    from common.log import library_output

    with library_output():
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model


def rope_theta(config) -> float:
    """The rotary base: `rope_parameters["rope_theta"]` in transformers 5, `rope_theta` before."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class HandLlama:
    """The decoder by hand. `rank`/`tp` > 1 keeps this rank's heads and FFN columns only:
    q, k, v, gate, up are column-parallel (enter through f), o and down row-parallel (leave
    through g, an all-reduce). `reduce=False` drops g: the negative control of TP parity."""

    def __init__(self, state: dict, config, rank: int = 0, tp: int = 1, reduce: bool = True,
                 device: torch.device | str = "cpu"):
        self.c, self.tp, self.reduce, self.device = config, tp, reduce, torch.device(device)
        self.h = config.hidden_size
        self.n_heads = config.num_attention_heads // tp
        self.d = config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        w = {k.removeprefix("model."): v.detach().to(self.device) for k, v in state.items()}
        rows = lambda t: t.chunk(tp, dim=0)[rank].contiguous()  # noqa: E731  (output features)
        cols = lambda t: t.chunk(tp, dim=1)[rank].contiguous()  # noqa: E731  (input features)
        self.embed, self.norm, self.head = w["embed_tokens.weight"], w["norm.weight"], w["lm_head.weight"]
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"layers.{i}."
            self.layers.append({
                "in_norm": w[p + "input_layernorm.weight"], "post_norm": w[p + "post_attention_layernorm.weight"],
                "q": rows(w[p + "self_attn.q_proj.weight"]), "k": rows(w[p + "self_attn.k_proj.weight"]),
                "v": rows(w[p + "self_attn.v_proj.weight"]), "o": cols(w[p + "self_attn.o_proj.weight"]),
                "gate": rows(w[p + "mlp.gate_proj.weight"]), "up": rows(w[p + "mlp.up_proj.weight"]),
                "down": cols(w[p + "mlp.down_proj.weight"])})
        d = self.d
        self.inv_freq = 1.0 / (rope_theta(config) ** (torch.arange(0, d, 2, dtype=torch.float64,
                                                                    device=self.device) / d))

    def rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x, start: int):
        """Rotary position embedding (rotate-half form) at positions start .. start + T - 1."""
        pos = torch.arange(start, start + x.shape[-2], dtype=torch.float64, device=x.device)
        return self.rope_at(x, pos[None].expand(x.shape[0], -1))

    def rope_at(self, x, pos: torch.Tensor):
        """Rotary embedding of x (B, heads, T, d) at per-token positions pos (B, T)."""
        ang = pos.to(torch.float64)[..., None] * self.inv_freq  # (B, T, d/2)
        ang = torch.cat([ang, ang], -1)[:, None]  # (B, 1, T, d): the same angle for every head
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2:]
        return x * ang.cos().to(x.dtype) + torch.cat([-x2, x1], -1) * ang.sin().to(x.dtype)

    def attention_paged(self, x, L, kv, pos, slots, tables):
        """Attention whose keys and values live in a paged pool: the new tokens' keys and values
        are written to their slots, then every key of each sequence is gathered through its
        block table (what vLLM's PagedAttention kernel reads in place, here an index_select)."""
        B, T, _ = x.shape
        x = self.f(x)
        heads = lambda t: t.view(B, T, self.n_heads, self.d).transpose(1, 2)  # noqa: E731
        q, k = self.rope_at(heads(x @ L["q"].T), pos), self.rope_at(heads(x @ L["k"].T), pos)
        v = heads(x @ L["v"].T)
        pool_k, pool_v = kv  # (n_blocks, block_size, heads, d)
        flat = slots.reshape(-1)
        pool_k.view(-1, self.n_heads, self.d).index_copy_(0, flat, k.transpose(1, 2).reshape(-1, self.n_heads, self.d))
        pool_v.view(-1, self.n_heads, self.d).index_copy_(0, flat, v.transpose(1, 2).reshape(-1, self.n_heads, self.d))
        keys = lambda pool: pool.index_select(0, tables.reshape(-1)).view(  # noqa: E731
            B, -1, self.n_heads, self.d).transpose(1, 2)  # (B, heads, blocks x block_size, d)
        S = tables.shape[1] * pool_k.shape[1]
        mask = (torch.arange(S, device=x.device) <= pos[..., None])[:, None]  # key j at position j
        out = F.scaled_dot_product_attention(q, keys(pool_k), keys(pool_v), attn_mask=mask)
        return self.g(out.transpose(1, 2).reshape(B, T, -1) @ L["o"].T)

    @torch.no_grad()
    def forward_paged(self, ids, pos, slots, tables, pool) -> torch.Tensor:
        """Logits (B, T, V) of `ids` (B, T) at positions `pos` (B, T), whose keys and values go to
        the flat pool `slots` (B, T); row b reads its keys through block table `tables[b]`
        (padded with any block: positions beyond pos are masked). A prefill is B = 1 and T
        prompt tokens; a decode step is B running sequences and T = 1."""
        x = self.embed[ids]
        for i, L in enumerate(self.layers):
            x = x + self.attention_paged(self.rms(x, L["in_norm"]), L, pool.layers[i], pos, slots, tables)
            x = x + self.mlp(self.rms(x, L["post_norm"]), L)
        return self.rms(x, self.norm) @ self.head.T

    def kv_pool(self, n_blocks: int, block_size: int):
        """A paged pool for this rank's heads (1/tp of them under tensor parallelism)."""
        from chapters.ch28_inference.paged import KVPool

        return KVPool(len(self.layers), n_blocks, block_size, self.n_heads, self.d,
                      self.embed.dtype, self.device)

    def g(self, y):
        return reduce_from_tp(y) if self.tp > 1 and self.reduce else y

    def f(self, x):
        return copy_to_tp(x) if self.tp > 1 else x

    def attention(self, x, L, cache_l, start):
        B, T, _ = x.shape
        x = self.f(x)
        heads = lambda t: t.view(B, T, self.n_heads, self.d).transpose(1, 2)  # noqa: E731
        q = self.rope(heads(x @ L["q"].T), start)
        k = self.rope(heads(x @ L["k"].T), start)
        v = heads(x @ L["v"].T)
        if cache_l is not None:  # the KV cache: keep every past key and value, append the new ones
            if cache_l[0] is not None:
                k, v = torch.cat([cache_l[0], k], 2), torch.cat([cache_l[1], v], 2)
            cache_l[0], cache_l[1] = k, v
        S = k.shape[2]  # keys seen: the T new ones end at position start + T - 1
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.g(out.transpose(1, 2).reshape(B, T, -1) @ L["o"].T)

    def mlp(self, x, L):
        x = self.f(x)
        return self.g((F.silu(x @ L["gate"].T) * (x @ L["up"].T)) @ L["down"].T)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: list | None = None, start: int = 0) -> torch.Tensor:
        x = self.embed[ids.to(self.device)]
        for i, L in enumerate(self.layers):
            x = x + self.attention(self.rms(x, L["in_norm"]), L, None if cache is None else cache[i], start)
            x = x + self.mlp(self.rms(x, L["post_norm"]), L)
        return self.rms(x, self.norm) @ self.head.T

    def new_cache(self) -> list:
        return [[None, None] for _ in self.layers]


def generate(model: HandLlama, prompt: torch.Tensor, n_new: int, use_cache: bool = True):
    """Greedy generation from `prompt` (B, T): returns (tokens (B, n_new), logits (B, n_new, V)).
    With the cache: one prefill over the prompt, then one token per step. Without: every step
    re-runs the model over the whole sequence so far and keeps the last position's logits."""
    prompt = prompt.to(model.device)
    seq, toks, logits = prompt, [], []
    cache = model.new_cache() if use_cache else None
    step_in, start = prompt, 0
    for _ in range(n_new):
        if use_cache:
            out = model.forward(step_in, cache, start)[:, -1]
            start += step_in.shape[1]
        else:
            out = model.forward(seq)[:, -1]
        nxt = out.argmax(-1, keepdim=True)
        toks.append(nxt)
        logits.append(out)
        seq, step_in = torch.cat([seq, nxt], 1), nxt
    return torch.cat(toks, 1), torch.stack(logits, 1)


def hf_generate(hf, prompt: torch.Tensor, n_new: int):
    """transformers' own greedy generate: (tokens, logits) of the new positions."""
    from common.log import library_output

    with library_output(), torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          return_dict_in_generate=True, output_logits=True, pad_token_id=0,
                          eos_token_id=None)
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, 1)


def top2_margin(logits: torch.Tensor) -> float:
    """The smallest gap between the best and second-best logit over all positions: a token can
    flip only if two computations differ by more than half of it."""
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())
